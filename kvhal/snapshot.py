"""Crash-safe snapshot files of a cache's sequences (safetensors), and their validated restore. The file's layout
and its validation: ``kvhal.snapshot_file``.

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
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .backend_util import blocks_to_pages, pages_to_blocks
from .errors import (
    CapacityError,
    FingerprintMismatchError,
    KVHalError,
    SequenceError,
    SnapshotCorruptError,
    SnapshotError,
    UnsupportedError,
)
from .fingerprint import FORMAT_VERSION, hash_chain
from .fsutil import fsync_path
from .seqs import Seq
from .snapshot_file import (
    SNAPSHOT_VERSION,
    SnapshotReader,
    crc32,
    file_path,
    header,
    inspect,
    remove_dead_temps,
    safetensors_module,
    side_tensors,
    spec_of,
    text_crc,
    threads,
    validate,
)

if TYPE_CHECKING:  # cache.py imports this module when a cache saves or restores
    from .cache import KVCache

__all__ = ["SNAPSHOT_VERSION", "header", "inspect", "restore", "save", "validate"]


def _check_cache(cache: Any) -> None:
    from .cache import KVCache

    if not isinstance(cache, KVCache):
        raise SnapshotError(f"cache must be a kvhal.KVCache, got {type(cache).__name__}")


def save(cache: KVCache, path: Any, seqs: list[int] | None = None) -> None:
    _check_cache(cache)
    target = file_path(path)
    try:
        if target.is_dir():
            raise SnapshotError(
                f"{str(target)!r} is a directory; pass a file path, such as {str(target / 'cache.kvs')!r}"
            )
        if target.exists() and not target.is_file():  # os.replace would put the snapshot in a device's place
            raise SnapshotError(f"{str(target)!r} is not a regular file (a device, FIFO or socket); pass a file path")
    except OSError as e:  # a name too long, a directory that may not be searched
        raise SnapshotError(f"cannot look up {str(target)!r} ({e}); pass a writable path") from None
    ids = cache.seqs if seqs is None else seqs
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise SequenceError(f"seqs must be a list of sequence ids, got {type(ids).__name__}")
    objs = [cache.seq_table.resident(s, "save") for s in ids]
    if len({id(o) for o in objs}) < len(objs):  # a restore would make two sequences of one
        raise SequenceError(f"seqs names a sequence twice: {list(ids)}; list each once")
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
    tensors.update(side_tensors(cache.resolved_spec))
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
                if spec.sinks:  # the f16 sink rows (CacheSpec.sinks): min(sink_tokens, length) per layer
                    tensors[f"seq{i}.sink.l{layer}.k"] = np.ascontiguousarray(s.sink_k.get(layer, empty))
                    tensors[f"seq{i}.sink.l{layer}.v"] = np.ascontiguousarray(s.sink_v.get(layer, empty))
        seq_meta.append(m)
    meta = {
        "snapshot_version": SNAPSHOT_VERSION,
        "format_version": FORMAT_VERSION,
        "fingerprint": {**cache.fingerprint.as_dict(), "digest": cache.root_hash.hex()},
        "spec": cache.fingerprint.as_dict(cache.resolved_spec)["spec"],
        "n_blocks": len(order),
        "seqs": seq_meta,
        "checksum": "crc32",
        "checksums": dict(zip(tensors, threads().map(crc32, tensors.values()))),
        "backend": cache.backend.name,
    }
    st = safetensors_module()
    remove_dead_temps(target.parent)
    tmp = str(target.parent / f".{target.name}.kvhal-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except (OSError, ValueError) as e:  # (ValueError: a NUL byte in the path)
        raise SnapshotError(f"cannot write a snapshot at {str(target)!r} ({e}); pass a writable path") from None
    text = json.dumps(meta)
    try:
        st.numpy.save_file(tensors, tmp, metadata={"kvhal": text, "kvhal_crc32": text_crc(text)})
        fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError | st.SafetensorError):  # a full disk, a file size limit, an I/O error
            raise SnapshotError(
                f"cannot write the snapshot {str(target)!r} ({e}); free space or pass another path (a file "
                "already there is unchanged)"
            ) from None
        raise
    fsync_path(str(target.parent))


def restore(cache: KVCache, path: Any) -> list[int]:
    _check_cache(cache)
    r = SnapshotReader(file_path(path))
    try:
        r.check_version()
        validate(r)  # the whole header, before anything below reads it or touches the cache
        return _restore(cache, r)
    finally:
        r.close()


def _restore(cache: KVCache, r: SnapshotReader) -> list[int]:
    r.check_version()
    meta, spec = r.meta, cache.spec
    fp = meta.get("fingerprint", {})
    mine = cache.fingerprint.as_dict(cache.resolved_spec)["spec"]
    adopt, root = _adopt_scales(cache, meta.get("spec"))
    side, side_root = _adopt_side(cache, r, meta.get("spec"))
    if side:
        root = side_root
    if meta.get("spec") != mine and not adopt and not side:
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
    list(threads().map(lambda nw: r.check_rows(nw[0], nw[1], chunk), wanted))
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
        sinks: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})
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
                for w, d in zip("kv", sinks) if spec.sinks else ():
                    shape = (min(spec.sink_tokens, n), spec.n_kv_heads, spec.head_dim)
                    d[layer] = np.array(r.tensor(f"seq{i}.sink.l{layer}.{w}", np.float16, shape))
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
            t.paged, (t.tail_k, t.tail_v), (t.sink_k, t.sink_v) = paged, tails, sinks
        staged.append(t)
    allocator = cache.seq_table.allocator
    if n_blocks > allocator.n_usable:
        raise CapacityError(
            f"restoring {str(r.path)!r} needs {n_blocks} free blocks but {allocator.n_usable} of {cache.n_blocks} "
            "are free; free sequences first or create the cache with a larger capacity_tokens"
        )
    cache.prefix.check_tiers(writing=True)  # a closed tier the restored blocks would be written through to
    # everything checked: stage the bytes, then publish
    ids = allocator.alloc(n_blocks)
    try:

        def stage(c0: int) -> None:  # chunks write disjoint blocks: two at a time
            c1 = min(n_blocks, c0 + chunk)
            part = [r.rows(name, c0, c1) for name, _ in wanted]
            data = pages_to_blocks(spec, zip(part[0::2], part[1::2]))
            cache.backend.write_blocks(cache.pools, np.array(ids[c0:c1], np.int64), data)

        list(threads().map(stage, range(0, n_blocks, chunk)))
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
    for w, x in side.items():  # a kltq cache that had not stored yet takes the snapshot's side data
        cache.adopt_side(x, w)
    named: dict[int, bytes] = {}
    for s in staged:
        s.blocks = [ids[j] for j in s.blocks]
        for b, h in zip(s.blocks, s.hashes):
            named.setdefault(b, h)  # a block has one hash: the first sequence's
    cache.prefix.publish(named)
    return [cache.seq_table.add(s) for s in staged]


def _adopt_side(cache: KVCache, r: SnapshotReader, saved: Any) -> tuple[dict[str, Any], bytes]:
    """The kltq side data ("k"/"v" -> Side) a cache that has not calibrated any layer of it yet (nor was given
    any) would take from a snapshot (with the root hash it gives), when that makes the specs equal; else none
    and the cache's root."""
    import dataclasses

    spec = cache.spec
    if not isinstance(saved, dict):
        return {}, cache.root_hash
    take = [
        w
        for w in "kv"
        if getattr(spec, f"{w}_fmt").side_data
        and getattr(spec, f"{w}_side") is None
        and f"{w}_side" in saved
        and all(x is None for x in cache.codec.side_list(w))
    ]
    if not take:
        return {}, cache.root_hash
    theirs = spec_of(r, saved)
    sides = {w: getattr(theirs, f"{w}_side") for w in take}
    cand = dataclasses.replace(cache.resolved_spec, **{f"{w}_side": x for w, x in sides.items()})
    if cache.fingerprint.as_dict(cand)["spec"] != saved:
        return {}, cache.root_hash
    return sides, cache.fingerprint.digest(cand)


def _adopt_scales(cache: KVCache, saved: Any) -> tuple[dict[str, list[np.ndarray | None]], bytes]:
    """Scales a "calibrate" cache that has not calibrated yet would take from a snapshot's spec (with the
    root hash they give), when that makes the specs equal; else nothing and the cache's own root."""
    import dataclasses

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
