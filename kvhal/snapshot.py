"""Crash-safe snapshot files of a cache's sequences (safetensors), and their validated restore.

File layout (safetensors; every tensor little-endian):

* ``blocks.l{L}.k`` / ``blocks.l{L}.v`` — U8 ``[n_blocks, n_kv_heads, block_size, row_bytes]``: the raw
  stored pages of layer ``L`` of every block the saved sequences hold, each block once (shared blocks
  stay shared), in the backend-independent pool layout;
* ``seq{i}.blocks`` — I32, sequence ``i``'s page list as indices into those blocks;
* ``seq{i}.tokens`` — I32, its recorded token ids;
* ``seq{i}.tail.l{L}.k`` / ``.v`` — F16 ``[tokens, n_kv_heads, head_dim]``: for a cache with an f16 tail,
  sequence ``i``'s tail rows of layer ``L`` (stored form: scaled and rotated); its metadata then holds
  ``paged``, the tokens per layer in the quantized pages;
* ``__metadata__`` ``{"kvhal": JSON, "kvhal_crc32": "<8 hex digits>"}``: the JSON holds the format version,
  the fingerprint (model, extra, digest), the spec (calibrated scales filled in), each sequence's per-layer
  lengths, token count, extra-key digest and block hash chain, and a CRC-32 of every tensor's bytes;
  ``kvhal_crc32`` is the CRC-32 of the JSON text's UTF-8 bytes (snapshot version 2; version 1 files, without
  it and without token counts, are still read).

Reading validates before anything touches the cache (``validate``): the metadata checksum, every field's type
and nesting depth, the fingerprint digest against the file's own model, extra and spec (a file whose digest
names another model than its fields is corrupt, not another model's), every tensor's presence, dtype and shape
against the spec and lengths, token counts, token ids in [0, 2**31), page indices, and the hash chains. Every
failure is a ``SnapshotError``; ``inspect`` runs the same checks and reports the same verdict as ``restore``.

Writing goes to a temp file in the same directory (``.<name>.kvhal-<pid>-<hex>.tmp``; those of dead
writers are removed by the next save into the directory), fsynced, ``os.replace``d over the target, then
the directory is fsynced: a crash at any moment leaves the old file or the new one. Restore checks
everything (version, fingerprint, spec, shapes, checksums, hash chains, free blocks) before it
changes anything, stages the bytes into free blocks (any, not contiguous ones), then publishes the
sequences, whose full blocks are at once matchable by ``match_prefix``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import secrets
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .backend import Backend, Pools
from .backend_util import blocks_to_pages, pages_to_blocks
from .codec import Codec
from .errors import (
    CapacityError,
    FingerprintMismatchError,
    KVHalError,
    SequenceError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotVersionError,
    UnsupportedError,
)
from .fingerprint import FORMAT_VERSION, Fingerprint, hash_chain
from .seqs import Seq, SeqTable
from .spec import CacheSpec


class SnapshotCache(Protocol):
    """What a snapshot reads of a cache and writes into it (``kvhal.KVCache`` is one)."""

    spec: CacheSpec
    backend: Backend
    pools: Pools
    fingerprint: Fingerprint
    n_blocks: int
    seq_table: SeqTable
    codec: Codec

    @property
    def seqs(self) -> list[int]: ...

    @property
    def resolved_spec(self) -> CacheSpec: ...

    @property
    def root_hash(self) -> bytes: ...

    def calibrating(self) -> bool: ...

    def adopt_scales(self, per_layer: dict[str, list[np.ndarray | None]]) -> None: ...


SNAPSHOT_VERSION = 2  # the file layout above; FORMAT_VERSION covers the meaning of the stored bytes
READ_VERSIONS = (1, 2)  # 1: no metadata checksum, no token counts
MAX_DEPTH = 16  # JSON nesting the metadata may have (the spec's per-layer scales need 3; extra keys a few)
_TEMP = re.compile(r"\..+\.kvhal-(\d+)-[0-9a-f]{8}\.tmp")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise SnapshotError("snapshots need the safetensors package: pip install 'kvhal[lifecycle]'") from None
    return safetensors


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data)


def _threads() -> ThreadPoolExecutor:
    """Checksums and tensor reads release the GIL: two threads use both cores of a small machine."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvhal-snapshot")
    return _POOL


_POOL: ThreadPoolExecutor | None = None


def _path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise SnapshotError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def save(cache: SnapshotCache, path: Any, seqs: list[int] | None = None) -> None:
    target = _path(path)
    if target.is_dir():
        raise SnapshotError(f"{str(target)!r} is a directory; pass a file path, such as {str(target / 'cache.kvs')!r}")
    ids = cache.seqs if seqs is None else seqs
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise SequenceError(f"seqs must be a list of sequence ids, got {type(ids).__name__}")
    objs = [cache.seq_table.resident(s, "save") for s in ids]
    if not target.parent.is_dir():
        raise SnapshotError(f"directory {str(target.parent)!r} does not exist; create it first")
    if cache.calibrating():
        raise UnsupportedError(
            'a snapshot of a cache whose "calibrate" scales are fixed for some layers only would not name its '
            "bytes: store to every layer first (or give the scales in the spec)"
        )
    spec = cache.spec
    order: dict[int, int] = {}  # block id -> index in the file
    for s in objs:
        for b in s.blocks:
            order.setdefault(b, len(order))
    block_ids = np.fromiter(order, np.int64, len(order))
    tensors: dict[str, np.ndarray] = {}
    for layer in range(spec.n_layers):
        tensors[f"blocks.l{layer}.k"] = np.empty(spec.pool_shape(len(order), "k"), np.uint8)
        tensors[f"blocks.l{layer}.v"] = np.empty(spec.pool_shape(len(order), "v"), np.uint8)
    chunk = max(1, (8 << 20) // spec.block_nbytes)  # read ~8 MiB of blocks at a time, straight into the tensors
    for c0 in range(0, len(block_ids), chunk):
        raw = cache.backend.read_blocks(cache.pools, block_ids[c0 : c0 + chunk])
        for layer, (k, v) in enumerate(blocks_to_pages(spec, raw)):
            tensors[f"blocks.l{layer}.k"][c0 : c0 + len(raw)] = k
            tensors[f"blocks.l{layer}.v"][c0 : c0 + len(raw)] = v
    seq_meta = []
    for i, s in enumerate(objs):
        tensors[f"seq{i}.blocks"] = np.array([order[b] for b in s.blocks], np.int32)
        tensors[f"seq{i}.tokens"] = np.array(s.tokens, np.int32)
        m: dict[str, Any] = {
            "lens": list(s.lens),
            "extra": s.extra.hex(),
            "hashes": [h.hex() for h in s.hashes],
            "sealable": s.sealable,
            "n_tokens": len(s.tokens),
        }
        if spec.uses_tail:
            m["paged"] = list(s.pages())
            empty = np.zeros((0, spec.n_kv_heads, spec.head_dim), np.float16)
            for layer in range(spec.n_layers):
                tensors[f"seq{i}.tail.l{layer}.k"] = np.ascontiguousarray(s.tail_k.get(layer, empty))
                tensors[f"seq{i}.tail.l{layer}.v"] = np.ascontiguousarray(s.tail_v.get(layer, empty))
        seq_meta.append(m)
    meta = {
        "snapshot_version": SNAPSHOT_VERSION,
        "format_version": FORMAT_VERSION,
        "fingerprint": {**cache.fingerprint.as_dict(), "digest": cache.root_hash.hex()},
        "spec": cache.fingerprint.as_dict(cache.resolved_spec)["spec"],
        "n_blocks": len(order),
        "seqs": seq_meta,
        "checksum": "crc32",
        "checksums": dict(zip(tensors, _threads().map(_crc, tensors.values()))),
        "backend": cache.backend.name,
    }
    st = _safetensors()
    _remove_dead_temps(target.parent)
    tmp = str(target.parent / f".{target.name}.kvhal-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    text = json.dumps(meta)
    try:
        st.numpy.save_file(tensors, tmp, metadata={"kvhal": text, "kvhal_crc32": _text_crc(text)})
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _text_crc(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_temps(directory: Path) -> None:
    """Temp files of kvhal's snapshot naming whose writer is dead (killed during a save): removed."""
    try:
        with os.scandir(directory) as it:
            for e in it:
                m = _TEMP.fullmatch(e.name)
                if m and int(m[1]) != os.getpid() and not _pid_alive(int(m[1])):
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass  # another saver removed it first, or not ours to remove: the save goes on
    except OSError:
        pass


class _Reader:
    """A snapshot file opened and checked; tensors read and verified on demand."""

    def __init__(self, path: Path, defer: bool = False) -> None:
        """``defer``: an unusable metadata section is kept in ``problem`` (raised by ``validate``), not raised."""
        st = _safetensors()
        if not path.is_file():
            raise SnapshotError(f"no snapshot file at {str(path)!r}")
        try:
            self._file = st.safe_open(str(path), framework="numpy")
            header = self._file.metadata() or {}
            self.names = set(self._file.keys())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise SnapshotCorruptError(
                f"{str(path)!r} is not a readable safetensors file ({type(e).__name__}: {e}); "
                "it is truncated or not a kvhal snapshot: save it again"
            ) from None
        self.path = path
        if "kvhal" not in header:
            raise SnapshotCorruptError(f"{str(path)!r} is a safetensors file without kvhal metadata; not a snapshot")
        self.meta: dict[str, Any] = {}
        self.version: int | None = None
        self.problem: SnapshotCorruptError | None = None  # why the metadata is unusable, when deferred
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        try:
            self._parse_meta(header["kvhal"], header.get("kvhal_crc32"))
        except SnapshotCorruptError as e:
            if not defer:
                raise
            self.problem = e

    def _parse_meta(self, text: str, crc: str | None) -> None:
        path = self.path
        if crc is not None and crc != _text_crc(text):
            try:  # kept for inspect's report (nothing is trusted from it)
                parsed = json.loads(text)
                self.meta = parsed if isinstance(parsed, dict) else {}
            except (ValueError, RecursionError):
                pass
            raise SnapshotCorruptError(
                f"{str(path)!r}: the kvhal metadata fails its checksum; the file is corrupt (bit flips or an edit): "
                "restore an intact copy or recompute"
            )
        try:
            meta = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise SnapshotCorruptError(
                f"{str(path)!r} has unreadable kvhal metadata ({type(e).__name__}); save it again"
            ) from None
        if not isinstance(meta, dict):
            raise SnapshotCorruptError(f"{str(path)!r}: the kvhal metadata is not a JSON object; not a snapshot")
        self.meta = meta
        version = meta.get("snapshot_version")
        if type(version) is not int:
            raise SnapshotCorruptError(f"{str(path)!r}: the kvhal metadata has no snapshot_version; not a snapshot")
        self.version = version
        if version >= 2 and crc is None:
            raise SnapshotCorruptError(
                f"{str(path)!r}: a version {version} snapshot without its metadata checksum; the file is corrupt"
            )

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of it still lives (in an exception's traceback): it goes with it
                pass
            self._mm = None

    def _mapped(self, name: str) -> tuple[mmap.mmap, int, tuple[int, ...]]:
        """The file mapped once, and ``name``'s byte offset and shape in it: checksums and staging read the
        page cache in place instead of copying each tensor out (safe_open has already checked the header)."""
        with self._lock:  # the checksum threads ask at once: map and index the file exactly once
            if self._mm is None:
                with open(self.path, "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                n = int.from_bytes(mm[:8], "little")  # the safetensors layout: u64 header size, JSON header
                for key, info in json.loads(mm[8 : 8 + n]).items():
                    if key != "__metadata__":
                        self._layout[key] = (8 + n + int(info["data_offsets"][0]), tuple(info["shape"]))
                self._mm = mm
            offset, shape = self._layout[name]
            return self._mm, offset, shape

    def check_version(self) -> None:
        got = (self.meta.get("snapshot_version"), self.meta.get("format_version"))
        if got[0] not in READ_VERSIONS or got[1] != FORMAT_VERSION or type(got[1]) is not int:
            raise SnapshotVersionError(
                f"{str(self.path)!r} has snapshot/format version {got}; this kvhal reads snapshot versions "
                f"{READ_VERSIONS} of format {FORMAT_VERSION}: restore it with the kvhal that wrote it, or recompute"
            )

    def verified(self, name: str) -> np.ndarray:
        """Tensor ``name``, checked against its checksum."""
        if name not in self.names:
            raise SnapshotCorruptError(f"{str(self.path)!r} lacks tensor {name}; the file is incomplete")
        try:
            t = self._file.get_tensor(name)
        except Exception as e:
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} is unreadable ({e}); truncated file"
            ) from None
        sums = self.meta.get("checksums")
        want = sums.get(name) if isinstance(sums, dict) else None
        if type(want) is not int or _crc(t) != want:
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} fails its checksum; the file is corrupt (bit flips or a torn "
                "copy): restore an intact copy or recompute"
            )
        return t

    def check_rows(self, name: str, shape: tuple[int, ...], rows: int) -> None:
        """Check tensor ``name``'s dtype, shape and checksum reading ``rows`` rows at a time (the file's
        pages are read in place, never all copied at once)."""
        if name not in self.names:
            raise SnapshotCorruptError(f"{str(self.path)!r} lacks tensor {name}; the file is incomplete")
        try:
            sl = self._file.get_slice(name)
            got_dtype, got_shape = sl.get_dtype(), tuple(sl.get_shape())
            if got_dtype != "U8" or got_shape != shape:
                raise SnapshotCorruptError(
                    f"{str(self.path)!r}: tensor {name} is {got_dtype} {got_shape}, expected U8 {shape}"
                )
            mm, offset, _ = self._mapped(name)
            crc = 0
            step = rows * math.prod(shape[1:])
            with memoryview(mm) as whole, whole[offset : offset + math.prod(shape)] as view:
                for b0 in range(0, len(view), step):
                    crc = zlib.crc32(view[b0 : b0 + step], crc)
        except SnapshotCorruptError:
            raise
        except Exception as e:
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} is unreadable ({e}); truncated file"
            ) from None
        sums = self.meta.get("checksums")
        if not isinstance(sums, dict) or crc != sums.get(name):
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} fails its checksum; the file is corrupt (bit flips or a torn "
                "copy): restore an intact copy or recompute"
            )

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a U8 tensor already checked: a view of the mapped file, no copy."""
        mm, offset, shape = self._mapped(name)
        row = math.prod(shape[1:])
        return np.frombuffer(mm, np.uint8, (r1 - r0) * row, offset + r0 * row).reshape(r1 - r0, *shape[1:])

    def tensor(self, name: str, dtype: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
        t = self.verified(name)
        if t.dtype != dtype or (shape is not None and t.shape != shape):
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} is {t.dtype} {t.shape}, expected {np.dtype(dtype)} {shape}"
            )
        return t


def restore(cache: SnapshotCache, path: Any) -> list[int]:
    r = _Reader(_path(path))
    try:
        r.check_version()
        validate(r)  # the whole header, before anything below reads it or touches the cache
        return _restore(cache, r)
    finally:
        r.close()


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile file may nest thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                return deepest
            stack += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _is_int(x: Any, lo: int = 0, hi: int | None = None) -> bool:
    return type(x) is int and x >= lo and (hi is None or x < hi)


def _tupled(value: Any) -> Any:
    return tuple(_tupled(x) for x in value) if isinstance(value, list) else value


def validate(r: _Reader) -> None:
    """Every check on the file that needs no cache: SnapshotCorruptError (or SnapshotVersionError) on the first
    failure. ``restore`` runs it before reading the header for the cache; ``inspect`` reports its verdict."""
    where = repr(str(r.path))

    def bad(what: str) -> SnapshotCorruptError:
        return SnapshotCorruptError(
            f"{where}: {what}; the file is corrupt or was not written by kvhal: restore an intact copy or recompute"
        )

    if r.problem is not None:
        raise r.problem
    r.check_version()
    m: Any = r.meta
    if _depth(m) > MAX_DEPTH:
        raise bad(f"its metadata nests deeper than {MAX_DEPTH} levels")
    fp: Any = m.get("fingerprint")
    spec_d: Any = m.get("spec")
    n_blocks: Any = m.get("n_blocks")
    seqs: Any = m.get("seqs")
    sums: Any = m.get("checksums")
    if not (isinstance(fp, dict) and isinstance(fp.get("model"), str) and isinstance(fp.get("extra"), dict)):
        raise bad("its fingerprint is not an object with a model name (str) and extra keys (object)")
    if not (isinstance(fp.get("digest"), str) and _HEX64.fullmatch(fp["digest"])):
        raise bad("its fingerprint digest is not 64 hex digits")
    if not isinstance(spec_d, dict) or not _is_int(n_blocks) or not isinstance(seqs, list):
        raise bad("spec (object), n_blocks (int >= 0) or seqs (list) is missing or of another type")
    if (
        m.get("checksum") != "crc32"
        or not isinstance(sums, dict)
        or not all(_is_int(v, 0, 1 << 32) for v in sums.values())
    ):
        raise bad('checksum is not "crc32" with a CRC-32 (int) per tensor')
    try:
        spec = CacheSpec(**{k: _tupled(v) for k, v in spec_d.items()})
        finger = Fingerprint(fp["model"], fp["extra"])
        canonical = finger.as_dict(spec)["spec"]
    except (KVHalError, TypeError, ValueError) as e:
        raise bad(f"its spec is not a valid cache spec ({e})") from None
    if canonical != spec_d:
        raise bad("its spec is not in the form kvhal writes")
    root = bytes.fromhex(fp["digest"])
    if finger.digest(spec) != root:
        raise bad(
            f"its fingerprint digest is not the digest of its own model {fp['model']!r}, extra keys and spec "
            "(a digest of another model under a stale name, or an edit)"
        )
    bs, tail = spec.block_size, spec.uses_tail
    want = {f"blocks.l{layer}.{w}" for layer in range(spec.n_layers) for w in "kv"}
    for i in range(len(seqs)):
        want |= {f"seq{i}.blocks", f"seq{i}.tokens"}
        if tail:
            want |= {f"seq{i}.tail.l{layer}.{w}" for layer in range(spec.n_layers) for w in "kv"}
    if r.names != want or set(sums) != want:
        odd = sorted((r.names ^ want) | (set(sums) ^ want))[:4]
        raise bad(f"its tensors or checksums do not match its spec and sequences (e.g. {', '.join(odd)})")

    def shape(name: str, dtype: str, expect: tuple[int, ...]) -> None:
        try:
            sl = r._file.get_slice(name)
            got = (sl.get_dtype(), tuple(sl.get_shape()))
        except Exception as e:  # safetensors' own error types
            raise bad(f"tensor {name} is unreadable ({e})") from None
        if got != (dtype, expect):
            raise bad(f"tensor {name} is {got[0]} {got[1]}, its header says {dtype} {expect}")

    for layer in range(spec.n_layers):
        for w in "kv":
            shape(f"blocks.l{layer}.{w}", "U8", spec.pool_shape(n_blocks, w))
    for i, s in enumerate(seqs):
        if not isinstance(s, dict):
            raise bad(f"sequence {i}'s metadata is not an object")
        lens: Any = s.get("lens")
        extra: Any = s.get("extra")
        hashes: Any = s.get("hashes")
        sealable: Any = s.get("sealable")
        paged: Any = s.get("paged") if tail else lens
        for name, v in (("lens", lens), ("paged", paged)):
            if not (isinstance(v, list) and len(v) == spec.n_layers and all(_is_int(x) for x in v)):
                raise bad(f"sequence {i}'s {name} is not one int >= 0 per layer ({spec.n_layers})")
        if tail and any(p % bs or p > n for p, n in zip(paged, lens)):
            raise bad(f"sequence {i}'s paged and total lengths disagree")
        if not (isinstance(extra, str) and _HEX64.fullmatch(extra)):
            raise bad(f"sequence {i}'s extra-key digest is not 64 hex digits")
        if not (isinstance(hashes, list) and all(isinstance(h, str) and _HEX64.fullmatch(h) for h in hashes)):
            raise bad(f"sequence {i}'s block hashes are not a list of 64 hex digits each")
        if sealable is not None and not _is_int(sealable):
            raise bad(f"sequence {i}'s sealable is not null or an int >= 0")
        need = math.ceil(max(paged, default=0) / bs)
        shape(f"seq{i}.blocks", "I32", (need,))
        try:
            n_tok = tuple(r._file.get_slice(f"seq{i}.tokens").get_shape())
        except Exception as e:
            raise bad(f"tensor seq{i}.tokens is unreadable ({e})") from None
        if (r.version or 0) >= 2 and not (_is_int(s.get("n_tokens")) and n_tok == (s["n_tokens"],)):
            raise bad(f"sequence {i}'s token count {s.get('n_tokens')!r} is not its token tensor's {n_tok}")
        shape(f"seq{i}.tokens", "I32", n_tok if len(n_tok) == 1 else (-1,))
        if tail:
            for layer, (p, n) in enumerate(zip(paged, lens)):
                for w in "kv":
                    shape(f"seq{i}.tail.l{layer}.{w}", "F16", (n - p, spec.n_kv_heads, spec.head_dim))
        blocks = r.verified(f"seq{i}.blocks")
        tokens = r.verified(f"seq{i}.tokens")
        if need and (blocks.min() < 0 or blocks.max() >= n_blocks):
            raise bad(f"sequence {i} points outside the saved blocks")
        if tokens.size and tokens.min() < 0:
            raise bad(f"sequence {i} has a negative token id ({int(tokens.min())}); ids are in [0, 2**31)")
        sealed = min(len(tokens), min(paged, default=0)) // bs
        sealed = sealed if sealable is None else min(sealed, sealable)
        if [bytes.fromhex(h) for h in hashes] != hash_chain(
            root, tokens[: sealed * bs].tolist(), bs, bytes.fromhex(extra)
        ):
            raise bad(f"sequence {i}'s block hash chain does not match its token ids")


def _restore(cache: SnapshotCache, r: _Reader) -> list[int]:
    r.check_version()
    meta, spec = r.meta, cache.spec
    fp = meta.get("fingerprint", {})
    mine = cache.fingerprint.as_dict(cache.resolved_spec)["spec"]
    adopt, root = _adopt_scales(cache, meta.get("spec"))
    if meta.get("spec") != mine and not adopt:
        raise FingerprintMismatchError(
            f"{str(r.path)!r} holds a cache of spec {meta.get('spec')}, this cache is {mine}; "
            "restore it into a cache created with the same spec (and, with calibrated scales, the same scales)"
        )
    if fp.get("digest") != root.hex():
        raise FingerprintMismatchError(
            f"{str(r.path)!r} was saved for model {fp.get('model')!r} (extra {fp.get('extra')}), this cache is for "
            f"{cache.fingerprint.model!r} (extra {dict(cache.fingerprint.extra)}); K/V of another model are never "
            "restored: recompute, or create the cache with the snapshot's fingerprint"
        )
    try:
        n_blocks = int(meta["n_blocks"])
        seq_meta = list(meta["seqs"])
    except (KeyError, TypeError, ValueError):
        raise SnapshotCorruptError(f"{str(r.path)!r}: kvhal metadata lacks n_blocks/seqs; save it again") from None
    # the block bytes are checked in chunks of ~8 MiB of blocks, then staged chunk by chunk: a 1 GiB
    # snapshot never needs 1 GiB of fresh memory (its page faults cost as much as the copy)
    chunk = max(1, (8 << 20) // spec.block_nbytes)
    wanted = [(f"blocks.l{layer}.{w}", spec.pool_shape(n_blocks, w)) for layer in range(spec.n_layers) for w in "kv"]
    list(_threads().map(lambda nw: r.check_rows(nw[0], nw[1], chunk), wanted))
    bs = spec.block_size
    staged: list[Seq] = []
    uses = np.zeros(n_blocks, np.int64)
    for i, m in enumerate(seq_meta):
        try:
            lens = [int(x) for x in m["lens"]]
            extra = bytes.fromhex(m["extra"])
            hashes = [bytes.fromhex(h) for h in m["hashes"]]
            sealable = None if m["sealable"] is None else int(m["sealable"])
        except (KeyError, TypeError, ValueError):
            raise SnapshotCorruptError(f"{str(r.path)!r}: sequence {i}'s metadata is malformed") from None
        blocks = r.tensor(f"seq{i}.blocks", np.int32)
        tokens = r.tensor(f"seq{i}.tokens", np.int32).tolist()
        paged = lens
        tails: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})
        if spec.uses_tail:
            try:
                paged = [int(x) for x in m["paged"]]
            except (KeyError, TypeError, ValueError):
                raise SnapshotCorruptError(f"{str(r.path)!r}: sequence {i} lacks its f16 tail's metadata") from None
            if len(paged) != len(lens) or any(p % bs or not 0 <= p <= n for p, n in zip(paged, lens)):
                raise SnapshotCorruptError(f"{str(r.path)!r}: sequence {i}'s paged and total lengths disagree")
            for layer, (p, n) in enumerate(zip(paged, lens)):
                for w, d in zip("kv", tails):
                    shape = (n - p, spec.n_kv_heads, spec.head_dim)
                    d[layer] = np.array(r.tensor(f"seq{i}.tail.l{layer}.{w}", np.float16, shape))
        need = math.ceil(max(paged, default=0) / bs)
        if len(lens) != spec.n_layers or min(lens, default=0) < 0 or blocks.shape != (need,) or len(extra) != 32:
            raise SnapshotCorruptError(f"{str(r.path)!r}: sequence {i}'s lengths and page list disagree")
        if need and (blocks.min() < 0 or blocks.max() >= n_blocks):
            raise SnapshotCorruptError(f"{str(r.path)!r}: sequence {i} points outside the saved blocks")
        sealed = min(len(tokens), min(paged)) // bs
        sealed = sealed if sealable is None else min(sealed, sealable)
        if hashes != hash_chain(root, tokens[: sealed * bs], bs, extra):
            raise SnapshotCorruptError(
                f"{str(r.path)!r}: sequence {i}'s block hash chain does not match its token ids; the file is corrupt"
            )
        np.add.at(uses, blocks, 1)
        t = cache.seq_table.new(lens, blocks=blocks.tolist(), tokens=tokens, hashes=hashes, extra=extra)
        t.sealable = sealable
        if spec.uses_tail:
            t.paged, (t.tail_k, t.tail_v) = paged, tails
        staged.append(t)
    allocator = cache.seq_table.allocator
    if n_blocks > allocator.n_usable:
        raise CapacityError(
            f"restoring {str(r.path)!r} needs {n_blocks} free blocks but {allocator.n_usable} of {cache.n_blocks} "
            "are free; free sequences first or create the cache with a larger capacity_tokens"
        )
    # everything checked: stage the bytes, then publish
    ids = allocator.alloc(n_blocks)
    try:

        def stage(c0: int) -> None:  # chunks write disjoint blocks: two at a time
            c1 = min(n_blocks, c0 + chunk)
            part = [r.rows(name, c0, c1) for name, _ in wanted]
            data = pages_to_blocks(spec, zip(part[0::2], part[1::2]))
            cache.backend.write_blocks(cache.pools, np.array(ids[c0:c1], np.int64), data)

        list(_threads().map(stage, range(0, n_blocks, chunk)))
    except BaseException:
        allocator.release(ids)
        raise
    for b, n in zip(ids, uses.tolist()):
        for _ in range(n - 1):
            allocator.acquire(b)
        if n == 0:
            allocator.release([b])
    if adopt:  # a "calibrate" cache that had not stored yet takes the snapshot's scales
        cache.adopt_scales(adopt)
    out = []
    for s in staged:
        s.blocks = [ids[j] for j in s.blocks]
        for b, h in zip(s.blocks, s.hashes):
            allocator.register(b, h)
        out.append(cache.seq_table.add(s))
    return out


def _adopt_scales(cache: SnapshotCache, saved: Any) -> tuple[dict[str, list[np.ndarray | None]], bytes]:
    """Scales a "calibrate" cache that has not calibrated yet would take from a snapshot's spec (with the
    root hash they give), when that makes the specs equal; else nothing and the cache's own root."""
    import dataclasses

    from .errors import KVHalError

    spec = cache.spec
    fields = {
        f"{w}_scale": saved.get(f"{w}_scale")
        for w in "kv"
        if isinstance(saved, dict) and getattr(spec, f"{w}_scale") == "calibrate" and cache.codec.uncalibrated(w)
    }
    if not fields or not all(isinstance(x, list) and all(isinstance(r, list) for r in x) for x in fields.values()):
        return {}, cache.root_hash
    try:
        scales: dict[str, Any] = {k: tuple(tuple(r) for r in v) for k, v in fields.items() if isinstance(v, list)}
        cand = dataclasses.replace(cache.resolved_spec, **scales)
    except (KVHalError, TypeError):
        return {}, cache.root_hash
    if cache.fingerprint.as_dict(cand)["spec"] != saved:
        return {}, cache.root_hash
    per_layer: dict[str, list[np.ndarray | None]] = {
        k[0]: [np.asarray(r, np.float64) for r in v] for k, v in scales.items()
    }
    return per_layer, cache.fingerprint.digest(cand)


def inspect(path: Any) -> dict[str, Any]:
    """The snapshot's header, every tensor's checksum, and the verdict ``restore`` would give on the file itself
    (``ok``; ``error``: why not). Raises only if the path is not a readable safetensors file with kvhal metadata."""
    r = _Reader(_path(path), defer=True)
    try:
        error = None
        try:
            validate(r)
        except SnapshotError as e:
            error = str(e)
        checks: dict[str, str] = {}
        for name in sorted(r.names):
            try:
                r.verified(name)
                checks[name] = "ok"
            except SnapshotCorruptError as e:
                checks[name] = str(e)
        ok = all(v == "ok" for v in checks.values())
        if error is None and not ok:
            error = next(v for v in checks.values() if v != "ok")
        m = r.meta
        seqs: list[Any] = m["seqs"] if isinstance(m.get("seqs"), list) else []
        summary = []
        for s in seqs:
            lens: Any = s.get("lens") if isinstance(s, dict) else None
            hashes: Any = s.get("hashes") if isinstance(s, dict) else None
            summary.append(
                {
                    "tokens": max((x for x in lens if _is_int(x)), default=0) if isinstance(lens, list) else None,
                    "hashed_blocks": len(hashes) if isinstance(hashes, list) else None,
                }
            )
        return {
            "path": str(r.path),
            "bytes": r.path.stat().st_size,
            "snapshot_version": r.version,
            "format_version": m.get("format_version"),
            "fingerprint": m.get("fingerprint") if isinstance(m.get("fingerprint"), dict) else None,
            "spec": m.get("spec") if isinstance(m.get("spec"), dict) else None,
            "n_blocks": m.get("n_blocks") if _is_int(m.get("n_blocks")) else None,
            "seqs": summary,
            "checksums_ok": ok,
            "checksums": checks,
            "ok": error is None,
            "error": error,
        }
    finally:
        r.close()
