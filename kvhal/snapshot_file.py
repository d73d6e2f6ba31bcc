"""The snapshot file: its layout, reading and validation (``SnapshotReader``, ``validate``), ``inspect`` and
``header``; ``kvhal.snapshot`` writes files and restores them into a cache.

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

"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .errors import KVHalError, SnapshotCorruptError, SnapshotError, SnapshotVersionError
from .fingerprint import FORMAT_VERSION, Fingerprint, hash_chain
from .fsutil import pid_alive
from .spec import CacheSpec

SNAPSHOT_VERSION = 2  # the file layout above; FORMAT_VERSION covers the meaning of the stored bytes
READ_VERSIONS = (1, 2)  # 1: no metadata checksum, no token counts
MAX_DEPTH = 16  # JSON nesting the metadata may have (the spec's per-layer scales need 3; extra keys a few)
TEMP_NAME = re.compile(r"\..+\.kvhal-(\d+)-[0-9a-f]{8}\.tmp")
HEX64 = re.compile(r"[0-9a-f]{64}")


def safetensors_module() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise SnapshotError("snapshots need the safetensors package: pip install 'kvhal[lifecycle]'") from None
    return safetensors


def crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data)


def threads() -> ThreadPoolExecutor:
    """Checksums and tensor reads release the GIL: two threads use both cores of a small machine."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvhal-snapshot")
    return _POOL


_POOL: ThreadPoolExecutor | None = None


def file_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise SnapshotError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def text_crc(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def remove_dead_temps(directory: Path) -> None:
    """Temp files of kvhal's snapshot naming whose writer is dead (killed during a save): removed."""
    try:
        with os.scandir(directory) as it:
            for e in it:
                m = TEMP_NAME.fullmatch(e.name)
                if m and int(m[1]) != os.getpid() and not pid_alive(int(m[1])):
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass  # another saver removed it first, or not ours to remove: the save goes on
    except OSError:
        pass


class SnapshotReader:
    """A snapshot file opened and checked; tensors read and verified on demand."""

    def __init__(self, path: Path, defer: bool = False) -> None:
        """``defer``: an unusable metadata section is kept in ``problem`` (raised by ``validate``), not raised."""
        st = safetensors_module()
        try:
            found = path.is_file()
        except OSError as e:  # a name too long, a directory that may not be searched
            raise SnapshotError(f"cannot look up {str(path)!r} ({e}); pass a readable snapshot path") from None
        if not found:
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
        if crc is not None and crc != text_crc(text):
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
        if type(want) is not int or crc32(t) != want:
            raise SnapshotCorruptError(
                f"{str(self.path)!r}: tensor {name} fails its checksum; the file is corrupt (bit flips or a torn "
                "copy): restore an intact copy or recompute"
            )
        return t

    def dtype_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        """Tensor ``name``'s dtype and shape as its header gives them (safetensors' errors pass through)."""
        sl = self._file.get_slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

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


def json_depth(value: Any) -> int:
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


def json_int(x: Any, lo: int = 0, hi: int | None = None) -> bool:
    return type(x) is int and x >= lo and (hi is None or x < hi)


def tupled(value: Any) -> Any:
    return tuple(tupled(x) for x in value) if isinstance(value, list) else value


# the tensors of a kltq K (V) format's side data: kltq.<name> (kltq_v.<name>) for each of Side.arrays()
SIDE_PREFIX = {"k_side": "kltq.", "v_side": "kltq_v."}


def side_tensors(spec: CacheSpec) -> dict[str, np.ndarray]:
    """The tensors a snapshot of ``spec`` (resolved) carries for its kltq side data (none without one)."""
    out = {}
    for name, prefix in SIDE_PREFIX.items():
        if (side := getattr(spec, name)) is not None:
            out.update({prefix + k: np.ascontiguousarray(v) for k, v in side.arrays().items()})
    return out


def spec_of(r: SnapshotReader, spec_d: dict[str, Any]) -> CacheSpec:
    """The spec a snapshot's metadata names, with its kltq side data read back from its tensors (the metadata
    holds the side data's digest; tensors of another digest are SnapshotCorruptError)."""
    from .formats import kltq

    fields = {k: tupled(v) for k, v in spec_d.items()}
    for name, prefix in SIDE_PREFIX.items():
        digest = fields.pop(name, None)
        if digest is None:
            continue
        arrays = {n[len(prefix) :]: r.verified(n) for n in r.names if n.startswith(prefix)}
        side = kltq.from_arrays(arrays, f"snapshot {str(r.path)!r}")
        if side.digest() != digest:
            raise SnapshotCorruptError(
                f"{str(r.path)!r}: its kltq side data ({name}) is not the side data its spec names (digest {digest}); "
                "the file is corrupt or edited: restore an intact copy"
            )
        fields[name] = side
    return CacheSpec(**fields)


def validate(r: SnapshotReader) -> None:
    """Every check on the file that needs no cache: SnapshotCorruptError (or SnapshotVersionError) on the first
    failure. ``restore`` runs it before reading the header for the cache; ``inspect`` reports its verdict."""
    if not isinstance(r, SnapshotReader):
        raise SnapshotError(
            f"validate takes an open SnapshotReader, not {type(r).__name__}; for a path, inspect(path) runs the same "
            "checks and reports their verdict"
        )
    where = repr(str(r.path))

    def bad(what: str) -> SnapshotCorruptError:
        return SnapshotCorruptError(
            f"{where}: {what}; the file is corrupt or was not written by kvhal: restore an intact copy or recompute"
        )

    if r.problem is not None:
        raise r.problem
    r.check_version()
    m: Any = r.meta
    if json_depth(m) > MAX_DEPTH:
        raise bad(f"its metadata nests deeper than {MAX_DEPTH} levels")
    fp: Any = m.get("fingerprint")
    spec_d: Any = m.get("spec")
    n_blocks: Any = m.get("n_blocks")
    seqs: Any = m.get("seqs")
    sums: Any = m.get("checksums")
    if not (isinstance(fp, dict) and isinstance(fp.get("model"), str) and isinstance(fp.get("extra"), dict)):
        raise bad("its fingerprint is not an object with a model name (str) and extra keys (object)")
    if not (isinstance(fp.get("digest"), str) and HEX64.fullmatch(fp["digest"])):
        raise bad("its fingerprint digest is not 64 hex digits")
    if not isinstance(spec_d, dict) or not json_int(n_blocks) or not isinstance(seqs, list):
        raise bad("spec (object), n_blocks (int >= 0) or seqs (list) is missing or of another type")
    if (
        m.get("checksum") != "crc32"
        or not isinstance(sums, dict)
        or not all(json_int(v, 0, 1 << 32) for v in sums.values())
    ):
        raise bad('checksum is not "crc32" with a CRC-32 (int) per tensor')
    try:
        spec = spec_of(r, spec_d)
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
    want = {f"blocks.l{layer}.{w}" for layer in range(spec.n_layers) for w in "kv"} | set(side_tensors(spec))
    for i in range(len(seqs)):
        want |= {f"seq{i}.blocks", f"seq{i}.tokens"}
        if tail:
            want |= {f"seq{i}.tail.l{layer}.{w}" for layer in range(spec.n_layers) for w in "kv"}
        if tail and spec.sinks:
            want |= {f"seq{i}.sink.l{layer}.{w}" for layer in range(spec.n_layers) for w in "kv"}
    if r.names != want or set(sums) != want:
        odd = sorted((r.names ^ want) | (set(sums) ^ want))[:4]
        raise bad(f"its tensors or checksums do not match its spec and sequences (e.g. {', '.join(odd)})")

    def shape(name: str, dtype: str, expect: tuple[int, ...]) -> None:
        try:
            got = r.dtype_shape(name)
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
            if not (isinstance(v, list) and len(v) == spec.n_layers and all(json_int(x) for x in v)):
                raise bad(f"sequence {i}'s {name} is not one int >= 0 per layer ({spec.n_layers})")
        if tail and any(p % bs or p > n for p, n in zip(paged, lens)):
            raise bad(f"sequence {i}'s paged and total lengths disagree")
        if not (isinstance(extra, str) and HEX64.fullmatch(extra)):
            raise bad(f"sequence {i}'s extra-key digest is not 64 hex digits")
        if not (isinstance(hashes, list) and all(isinstance(h, str) and HEX64.fullmatch(h) for h in hashes)):
            raise bad(f"sequence {i}'s block hashes are not a list of 64 hex digits each")
        if sealable is not None and not json_int(sealable):
            raise bad(f"sequence {i}'s sealable is not null or an int >= 0")
        need = math.ceil(max(paged, default=0) / bs)
        shape(f"seq{i}.blocks", "I32", (need,))
        try:
            n_tok = r.dtype_shape(f"seq{i}.tokens")[1]
        except Exception as e:
            raise bad(f"tensor seq{i}.tokens is unreadable ({e})") from None
        if (r.version or 0) >= 2 and not (json_int(s.get("n_tokens")) and n_tok == (s["n_tokens"],)):
            raise bad(f"sequence {i}'s token count {s.get('n_tokens')!r} is not its token tensor's {n_tok}")
        shape(f"seq{i}.tokens", "I32", n_tok if len(n_tok) == 1 else (-1,))
        if tail:
            for layer, (p, n) in enumerate(zip(paged, lens)):
                for w in "kv":
                    shape(f"seq{i}.tail.l{layer}.{w}", "F16", (n - p, spec.n_kv_heads, spec.head_dim))
                    if spec.sinks:
                        shape(
                            f"seq{i}.sink.l{layer}.{w}",
                            "F16",
                            (min(spec.sink_tokens, n), spec.n_kv_heads, spec.head_dim),
                        )
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


def inspect(path: Any) -> dict[str, Any]:
    """The snapshot's header, every tensor's checksum, and the verdict ``restore`` would give on the file itself
    (``ok``; ``error``: why not). Raises only if the path is not a readable safetensors file with kvhal metadata."""
    r = SnapshotReader(file_path(path), defer=True)
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
                    "tokens": max((x for x in lens if json_int(x)), default=0) if isinstance(lens, list) else None,
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
            "n_blocks": m.get("n_blocks") if json_int(m.get("n_blocks")) else None,
            "seqs": summary,
            "checksums_ok": ok,
            "checksums": checks,
            "ok": error is None,
            "error": error,
        }
    finally:
        r.close()


def header(path: Any) -> tuple[CacheSpec, Fingerprint, int]:
    """The spec, fingerprint and block count a snapshot was saved with (``KVCache.from_snapshot``), after the
    checks ``restore`` makes on the file itself (``validate``)."""
    r = SnapshotReader(file_path(path))
    try:
        validate(r)
        m = r.meta
        spec = spec_of(r, m["spec"])
        return spec, Fingerprint(m["fingerprint"]["model"], m["fingerprint"]["extra"]), int(m["n_blocks"])
    finally:
        r.close()
