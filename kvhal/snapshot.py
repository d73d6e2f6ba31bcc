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
* ``__metadata__`` ``{"kvhal": JSON}`` with the format version, the fingerprint (model, extra, digest),
  the spec (calibrated scales filled in), each sequence's per-layer lengths, extra-key digest and block hash chain, and a CRC-32 of
  every tensor's bytes.

Writing goes to a temp file in the same directory, fsynced, ``os.replace``d over the target, then
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
import tempfile
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


SNAPSHOT_VERSION = 1  # the file layout above; FORMAT_VERSION covers the meaning of the stored bytes


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
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        st.numpy.save_file(tensors, tmp, metadata={"kvhal": json.dumps(meta)})
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


class _Reader:
    """A snapshot file opened and checked; tensors read and verified on demand."""

    def __init__(self, path: Path) -> None:
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
        try:
            self.meta = json.loads(header["kvhal"])
            self.version = int(self.meta["snapshot_version"])
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotCorruptError(f"{str(path)!r} has unreadable kvhal metadata ({e}); save it again") from None
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}

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
        if got != (SNAPSHOT_VERSION, FORMAT_VERSION):
            raise SnapshotVersionError(
                f"{str(self.path)!r} has snapshot/format version {got}; this kvhal reads "
                f"{(SNAPSHOT_VERSION, FORMAT_VERSION)}: restore it with the kvhal that wrote it, or recompute"
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
        want = self.meta.get("checksums", {}).get(name)
        if want is None or _crc(t) != want:
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
        if crc != self.meta.get("checksums", {}).get(name):
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
        return _restore(cache, r)
    finally:
        r.close()


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
    """The snapshot's header and whether every tensor passes its checksum (raises only if unreadable)."""
    r = _Reader(_path(path))
    checks: dict[str, str] = {}
    for name in sorted(r.names):
        try:
            r.verified(name)
            checks[name] = "ok"
        except SnapshotCorruptError as e:
            checks[name] = str(e)
    seqs = r.meta.get("seqs", [])
    return {
        "path": str(r.path),
        "bytes": r.path.stat().st_size,
        "snapshot_version": r.meta.get("snapshot_version"),
        "format_version": r.meta.get("format_version"),
        "fingerprint": r.meta.get("fingerprint"),
        "spec": r.meta.get("spec"),
        "n_blocks": r.meta.get("n_blocks"),
        "seqs": [
            {"tokens": max(m.get("lens", [0]), default=0), "hashed_blocks": len(m.get("hashes", []))} for m in seqs
        ],
        "checksums_ok": all(v == "ok" for v in checks.values()),
        "checksums": checks,
    }


def header(path: Any) -> tuple[CacheSpec, Fingerprint, int]:
    """The spec, fingerprint and block count a snapshot was saved with (``KVCache.from_snapshot``): the version
    is checked, the tensors are not (``restore`` checks them)."""
    from .errors import KVHalError

    r = _Reader(_path(path))
    try:
        r.check_version()
        meta = r.meta
        fp, saved = meta.get("fingerprint"), meta.get("spec")
        try:
            if not isinstance(fp, dict) or not isinstance(saved, dict):
                raise TypeError("fingerprint/spec missing")
            spec_args: dict[str, Any] = {k: tuple(_tuples(v)) if isinstance(v, list) else v for k, v in saved.items()}
            spec = CacheSpec(**spec_args)
            fingerprint = Fingerprint(model=fp["model"], extra=fp.get("extra", {}))
            n_blocks = int(meta["n_blocks"])
        except (KVHalError, KeyError, TypeError, ValueError) as e:
            raise SnapshotCorruptError(
                f"{str(r.path)!r}: its kvhal metadata does not name a spec and fingerprint ({e}); save it again"
            ) from None
        return spec, fingerprint, n_blocks
    finally:
        r.close()


def _tuples(value: list[Any]) -> Any:
    return [tuple(_tuples(x)) if isinstance(x, list) else x for x in value]
