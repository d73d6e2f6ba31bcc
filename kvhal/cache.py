"""KVCache: the public API of one paged, quantized cache in front of one backend.

The facade checks every argument (``validate``) and routes each call to the component that owns the state:

* ``SeqTable`` (seqs.py) over ``BlockAllocator`` (blocks.py): page lists, refcounts, copy-on-write, fork, trim;
* ``Codec`` (codec.py): scales, calibration and rotation of what is stored, q and the output;
* ``TailStore`` (tail.py): the f16 precision tail of ``tail > 0`` and per-channel K formats;
* ``PrefixIndex`` (prefix.py): block hashes, ``match_prefix``, tiers below the pools;
* ``Streamer`` (streaming.py): sequences offloaded to host memory;
* ``Evictor`` (eviction.py): observed attention mass, ``evict``, eviction on a full cache;
* ``collect`` (stats.py): the ``stats()`` record.

Every public method validates everything and reserves every block it needs before it changes anything,
so a call that raises leaves the cache as it was.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import registry, validate
from .backend import AttentionBatch, Backend, check_shape
from .blocks import BlockAllocator
from .codec import Codec, Pending
from .errors import CapacityError, NonFiniteError, PositionError, ShapeError, SpecError, UnsupportedError
from .eviction import EvictionResult, EvictOnFull, Evictor, OnEvict, Policy
from .fingerprint import Fingerprint, extra_digest
from .formats import kltq
from .interop import cast_into
from .prefix import PrefixIndex
from .seqs import Seq, SeqTable
from .spec import CacheSpec
from .stats import CacheStats, collect
from .streaming import Streamer
from .tail import TailStore

__all__ = ["CacheStats", "KVCache"]


class KVCache:
    def __init__(
        self,
        spec: CacheSpec,
        capacity_tokens: int,
        backend: str | Backend = "auto",
        *,
        allow_fallback: bool = False,
        backend_options: dict[str, Any] | None = None,
        fingerprint: Fingerprint | None = None,
        on_full: str | EvictOnFull = "prefix_lru",
        on_evict: OnEvict | None = None,
        observe_window: int = 32,
        tiers: Sequence[Any] | None = None,
        write_through: bool = False,
        stream_arena_tokens: int = 0,
    ) -> None:
        """``on_full``: what a store does when no block is free. "prefix_lru" (default): free blocks
        that still hold cached prefixes are reused, least recently released first (counted in
        ``stats().prefix_evicted_blocks``), then ``CapacityError``; "raise": cached prefixes are never
        reused by a store (``CapacityError`` instead); ``EvictOnFull(policy, keep_tokens)``: as
        "prefix_lru", then the longest sequence is evicted with ``policy``. ``on_evict`` is called with
        every ``EvictionResult``. ``observe_window``: the queries ``attention(observe=True)`` keeps
        apart for ``SnapKV``. ``tiers`` (``kvhal.tiers``: HostTier, DiskTier, RedisTier, in lookup order):
        a cached block whose space is reused is written down to the first tier that takes it
        (``write_through``: as soon as it gets its hash), and ``match_prefix`` continues its lookup in
        each tier, pulling hits back into the pools. ``stream_arena_tokens``: device blocks set aside (beyond
        ``capacity_tokens``) through which ``attention`` streams the host-resident part of sequences moved
        out with ``offload``, so a sequence may be far longer than the pools."""
        if not isinstance(spec, CacheSpec):
            raise SpecError(f"spec must be a kvhal.CacheSpec, got {type(spec).__name__}")
        capacity_tokens = validate.count(capacity_tokens, "capacity_tokens", 1)
        validate.check_bool(allow_fallback, "allow_fallback", SpecError)
        if fingerprint is not None and not isinstance(fingerprint, Fingerprint):
            raise SpecError(f"fingerprint must be a kvhal.Fingerprint, got {type(fingerprint).__name__}")
        if not (on_full in ("prefix_lru", "raise") or isinstance(on_full, EvictOnFull)):
            raise SpecError(f"on_full must be 'prefix_lru', 'raise' or a kvhal.eviction.EvictOnFull, got {on_full!r}")
        if on_evict is not None and not callable(on_evict):
            raise SpecError(f"on_evict must be callable or None, got {type(on_evict).__name__}")
        observe_window = validate.count(observe_window, "observe_window", 1)
        tier_list = validate.tiers(tiers)
        if validate.check_bool(write_through, "write_through", SpecError) and not tier_list:
            raise SpecError("write_through=True needs tiers=[...] to write to")
        arena = math.ceil(validate.count(stream_arena_tokens, "stream_arena_tokens") / spec.block_size)
        self.n_blocks = math.ceil(capacity_tokens / spec.block_size) + arena
        if self.n_blocks * spec.block_nbytes >= 2**48:  # 256 TiB: beyond any machine, and beyond numpy's arrays
            raise CapacityError(
                f"capacity_tokens={capacity_tokens} needs {self.n_blocks * spec.block_nbytes} bytes of pools; "
                "ask for what the device holds"
            )
        self.spec = spec
        self.fingerprint = fingerprint if fingerprint is not None else Fingerprint(model="")
        self.write_through = write_through
        self.backend = registry.resolve(backend, spec, allow_fallback, backend_options)
        try:
            self.pools = self.backend.allocate(spec, self.n_blocks)
        except MemoryError as e:  # host pools numpy could not allocate (a device's own out-of-memory is its backend's)
            raise CapacityError(
                f"capacity_tokens={capacity_tokens} needs {self.n_blocks * spec.block_nbytes} bytes of pools, more than "
                f"{self.backend.name} can allocate here ({e}); ask for less"
            ) from None
        allocator = BlockAllocator(self.n_blocks, spec.block_size, reuse_cached=on_full != "raise")
        self.codec = Codec(spec)
        self.pools.side = self.codec.sides  # a kltq K format's side data, per layer, as the backend reads it
        self.pools.v_side = self.codec.v_sides  # a kltq V format's
        self.seq_table = SeqTable(spec, self.backend, self.pools, allocator)
        self.prefix = PrefixIndex(
            spec, self.backend, self.pools, allocator, self.fingerprint.digest(spec), tier_list, write_through
        )
        self.streamer = Streamer(spec, self.backend, self.pools, self.seq_table, allocator.alloc(arena))
        self.tail = TailStore(spec, self.backend, self.pools, self.seq_table)
        self.evictor = Evictor(
            spec, self.backend, self.pools, self.seq_table, self.tail, self._kv_f32, observe_window, on_full, on_evict
        )

    @property
    def on_full(self) -> str | EvictOnFull:
        return self.evictor.on_full

    @property
    def observe_window(self) -> int:
        return self.evictor.observe_window

    @property
    def on_evict(self) -> OnEvict | None:
        """Called with every ``EvictionResult``; may be replaced on a live cache."""
        return self.evictor.on_evict

    @on_evict.setter
    def on_evict(self, callback: OnEvict | None) -> None:
        if callback is not None and not callable(callback):
            raise SpecError(f"on_evict must be callable or None, got {type(callback).__name__}")
        self.evictor.on_evict = callback

    @property
    def tiers(self) -> list[Any]:
        """The tiers below the pools, in lookup and write-down order."""
        return self.prefix.tiers

    @tiers.setter
    def tiers(self, value: Sequence[Any]) -> None:
        """Replace or reorder the tiers of a live cache (blocks already written stay where they are)."""
        tier_list = validate.tiers(value)
        if self.write_through and not tier_list:
            raise SpecError("write_through=True needs tiers=[...] to write to")
        self.prefix.set_tiers(tier_list)

    @property
    def root_hash(self) -> bytes:
        """The parent of every block hash chain: the fingerprint's digest of the resolved spec."""
        return self.prefix.root_hash

    # -- sequences -----------------------------------------------------------------------------------

    def new_seq(self, extra: dict[str, Any] | None = None) -> int:
        """A new empty sequence. ``extra`` keys (LoRA id, cache salt) enter its block hashes, so
        sequences with different extra keys never share cached blocks."""
        return self.seq_table.add(self.seq_table.new(extra=extra_digest(extra)))

    @property
    def seqs(self) -> list[int]:
        return self.seq_table.ids

    def seq_len(self, seq: int, layer: int | None = None) -> int:
        """Tokens stored for ``seq`` (at ``layer``; the longest layer when None)."""
        s = self.seq_table.get(seq)
        return max(s.lens) if layer is None else s.lens[validate.layer(layer, self.spec.n_layers)]

    def block_ids(self, seq: int) -> list[int]:
        """The block ids of ``seq``'s resident pages, in position order (what its block table holds)."""
        return list(self.seq_table.get(seq).blocks)

    def free_seq(self, seq: int) -> None:
        self.seq_table.remove(seq)

    def seq_keep(self, seq: int) -> None:
        """Free every sequence but ``seq``."""
        self.seq_table.get(seq)
        for other in [o for o in self.seq_table.ids if o != seq]:
            self.seq_table.remove(other)

    def seq_rm(self, seq: int, p0: int = -1, p1: int | None = -1) -> None:
        """Remove positions ``[p0, p1)`` (llama.cpp: p0 < 0 is the start, p1 < 0 the end).

        Sequences are dense: removing a middle range shifts the later tokens down by ``p1 - p0``
        (llama.cpp's ``seq_rm`` followed by ``seq_add``). K is stored as given (post-RoPE): an
        engine that needs re-rotated keys re-stores them.
        """
        s = self.seq_table.resident(seq, "seq_rm")
        lo, hi = validate.pos_range(p0, p1)
        self.prefix.check_tiers(writing=True)
        if self.spec.uses_tail:
            self.tail.remove(s, lo, hi)
            return
        self.seq_table.remove_range(s, lo, hi)
        self.prefix.seal(s)

    def seq_cp(self, seq: int, p0: int = -1, p1: int | None = -1) -> int:
        """A new sequence holding positions ``[p0, p1)`` of ``seq``; whole pages are shared, not copied."""
        s = self.seq_table.resident(seq, "seq_cp")
        lo, hi = validate.pos_range(p0, p1)
        self.prefix.check_tiers(writing=True)
        if self.spec.uses_tail:
            return self.seq_table.add(self.tail.fork(s, lo, hi))
        t = self.seq_table.fork(s, lo, hi)
        self.prefix.seal(t)
        return self.seq_table.add(t)

    # -- token ids and the prefix cache --------------------------------------------------------------

    def append_tokens(self, seq: int, token_ids: Any) -> None:
        """Record the token ids of ``seq``'s next positions (before or after their layers are stored).

        A full block whose token ids are known and whose every layer is stored gets its hash and
        becomes matchable by ``match_prefix``."""
        s = self.seq_table.get(seq)
        ids = validate.token_ids(token_ids)
        self.prefix.check_tiers(writing=True)
        s.tokens.extend(ids)
        self.prefix.seal(s)

    def tokens(self, seq: int) -> list[int]:
        """The token ids recorded for ``seq``."""
        return list(self.seq_table.get(seq).tokens)

    def match_prefix(self, token_ids: Any, extra: dict[str, Any] | None = None) -> tuple[int, int]:
        """A new sequence sharing the longest cached prefix of ``token_ids``, and its token count.

        Only whole blocks are shared, and at most ``len(token_ids) - 1`` tokens, so the caller always
        computes the last token (its logits are needed). The new sequence holds the matched tokens'
        ids; the caller appends and stores the rest."""
        ids = validate.token_ids(token_ids)
        ex = extra_digest(extra)
        blocks, hashes = self.prefix.match(ids, ex)
        n = len(blocks) * self.spec.block_size
        t = self.seq_table.new([n] * self.spec.n_layers, blocks=list(blocks), tokens=ids[:n], hashes=hashes, extra=ex)
        return self.seq_table.add(t), n

    # -- transforms (scales, rotation) ---------------------------------------------------------------

    @property
    def resolved_spec(self) -> CacheSpec:
        """The spec with calibrated scales filled in: what names this cache's bytes."""
        return self.codec.resolved_spec

    def calibrating(self) -> bool:
        """True while a "calibrate" scale is fixed for some layers but not yet for all of them."""
        return self.codec.calibrating()

    def scales(self) -> dict[str, tuple[tuple[float, ...] | None, ...]]:
        """The ``k``/``v`` scales in use: per layer, one per KV head (None: a "calibrate" layer before its
        first store)."""
        return self.codec.scales()

    def adopt_scales(self, per_layer: dict[str, Any]) -> None:
        """Take calibrated scales for every layer (a snapshot's, before this cache stored anything):
        ``{"k": [layer 0's per-head scales, ...], "v": ...}`` for a ``"calibrate"`` scale no store has fixed
        yet, one positive finite float per KV head. Checked whole, as the spec they make, before any is taken."""
        if not isinstance(per_layer, dict) or not per_layer or not set(per_layer) <= {"k", "v"}:
            raise SpecError(f"adopt_scales takes a dict of 'k' and/or 'v' per-layer scales, not {per_layer!r:.80}")
        fields: dict[str, Any] = {}
        for w, layers in per_layer.items():
            scale = getattr(self.spec, f"{w}_scale")
            if scale != "calibrate":
                raise SpecError(
                    f"adopt_scales: {w.upper()}'s scale is {scale!r}; only a 'calibrate' scale takes scales"
                )
            if not self.codec.uncalibrated(w):
                raise SpecError(f"adopt_scales: {w.upper()}'s scales are fixed already (by a store or an adopt)")
            rows: list[Any] = list(layers) if isinstance(layers, (list, tuple)) else [None]
            if not all(isinstance(r, (list, tuple, np.ndarray)) and np.ndim(r) == 1 for r in rows):
                raise SpecError(f"adopt_scales: {w!r} is a list of one sequence of per-head scales per layer")
            fields[f"{w}_scale"] = tuple(tuple(r.tolist() if isinstance(r, np.ndarray) else r) for r in rows)
        spec = replace(self.codec.resolved_spec, **fields)  # CacheSpec checks them: SpecError before any is taken
        self.codec.adopt({n[0]: [np.asarray(r, np.float64) for r in x] for n, x in fields.items()})
        self.prefix.root_hash = self.fingerprint.digest(spec)

    def adopt_side(self, side: kltq.Side, which: str = "k") -> None:
        """Take every layer's kltq side data of K (``which="v"``: V) (a snapshot's, before this cache stored
        anything): only where the format takes side data that neither the spec gave nor a store calibrated."""
        if not isinstance(which, str) or which not in ("k", "v"):
            raise SpecError(f"adopt_side: which is 'k' or 'v', not {which!r}")
        if not isinstance(side, kltq.Side):
            raise SpecError(f"adopt_side: side is a kvhal.formats.kltq.Side, not {type(side).__name__}")
        fmt = getattr(self.spec, f"{which}_fmt")
        if not fmt.side_data:
            raise SpecError(f"adopt_side: {which.upper()}'s format {fmt.name} takes no side data")
        if getattr(self.spec, f"{which}_side") is not None or any(x is not None for x in self.codec.side_list(which)):
            raise SpecError(f"adopt_side: {which.upper()} has side data already (given or calibrated by a store)")
        fields: dict[str, Any] = {f"{which}_side": side}
        spec = replace(self.codec.resolved_spec, **fields)  # CacheSpec checks it against the shape
        self.codec.adopt_side(side, which)
        self.prefix.root_hash = self.fingerprint.digest(spec)

    # -- data ----------------------------------------------------------------------------------------

    def store(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Append ``k``, ``v`` ``[n_new, n_kv_heads, head_dim]`` to ``seq`` at ``layer``."""
        s = self.seq_table.get(seq)
        layer = validate.layer(layer, self.spec.n_layers)
        k, v = self.backend.asarray(k, "k"), self.backend.asarray(v, "v")
        if validate.kv_rows(k, v, self.spec.n_kv_heads, self.spec.head_dim) == 0:
            return
        self.prefix.check_tiers(writing=True)
        spec, pending = self.spec, Pending()
        make_room = self.evictor.make_room if isinstance(self.evictor.on_full, EvictOnFull) else None
        if spec.transformed or spec.uses_tail or spec.k_codec or spec.v_codec:
            k, v, pending = self.codec.encode(self.backend, layer, k, v)
            if spec.uses_tail:
                with self.codec.staging(pending):  # side data a backend's store reads
                    self.tail.store(s, layer, k, v, make_room)
                self._committed(pending)
                self.prefix.seal(s)
                return
            k, v = self.backend.asarray(k, "k"), self.backend.asarray(v, "v")
        self.backend.check_values(spec.k_fmt, k)
        self.backend.check_values(spec.v_fmt, v)
        with self.codec.staging(pending):
            p1 = self.seq_table.write(s, layer, k, v, s.lens[layer] - s.base, make_room)
        self._committed(pending)
        s.lens[layer] = p1 + s.base
        if len(s.tokens) > len(s.hashes) * spec.block_size:
            self.prefix.seal(s)

    def store_rows(self, seq: int, layer: int, k_rows: Any, v_rows: Any) -> None:
        """Append already-stored rows to ``seq`` at ``layer``, byte for byte: ``k_rows``/``v_rows`` in the pool's
        row byte layout, uint8 ``[n_new, n_kv_heads, row_bytes]`` (``spec.k_row_bytes``/``v_row_bytes``: one
        head's ``head_dim`` values in the spec's format, stored form: scaled and rotated where the spec says),
        or ``bytes`` of whole tokens. Validated like ``store`` (shapes, the decoded values finite) and all or
        nothing. Not for a cache with an f16 tail, nor before a "calibrate" scale is fixed (the bytes would
        have no scale to mean)."""
        s = self.seq_table.resident(seq, "store_rows")
        layer = validate.layer(layer, self.spec.n_layers)
        spec = self.spec
        k = validate.stored_rows(k_rows, "k_rows", spec.n_kv_heads, spec.k_row_bytes)
        v = validate.stored_rows(v_rows, "v_rows", spec.n_kv_heads, spec.v_row_bytes)
        if len(k) != len(v):
            raise ShapeError(f"k_rows has {len(k)} tokens but v_rows has {len(v)}; store both for the same tokens")
        self._raw_rows_supported("store_rows")
        if any(
            self.codec.uncalibrated(w) or self.codec.calibrating()
            for w in "kv"
            if getattr(spec, f"{w}_scale") == "calibrate"
        ) or any(getattr(spec, f"{w}_fmt").side_data and any(x is None for x in self.codec.side_list(w)) for w in "kv"):
            raise UnsupportedError(
                'store_rows on a "calibrate" (or kltq) cache before every layer\'s scale (side data) is fixed: the '
                "rows would have nothing to mean; create the cache with the scales (k_side/v_side) the rows were "
                "stored with"
            )
        if len(k) == 0:
            return
        self.prefix.check_tiers(writing=True)
        for fmt, rows, what in ((spec.k_fmt, k, "k_rows"), (spec.v_fmt, v, "v_rows")):
            if fmt.side_data:
                values = kltq.dequantize(self.codec.side(layer, what[0]), 0, rows)
            else:
                values = fmt.dequantize(rows)
            if not np.isfinite(values).all():
                raise NonFiniteError(
                    f"{what} decode to non-finite values in format {fmt.name}: the bytes are not rows of this "
                    "spec's format (or are corrupt); check the format and the byte layout"
                )
        make_room = self.evictor.make_room if isinstance(self.evictor.on_full, EvictOnFull) else None
        p1 = self.seq_table.write(s, layer, k, v, s.lens[layer] - s.base, make_room, raw=True)
        s.lens[layer] = p1 + s.base
        if len(s.tokens) > len(s.hashes) * spec.block_size:
            self.prefix.seal(s)

    def load_rows(self, seq: int, layer: int, p0: int = 0, p1: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The stored bytes of positions ``[p0, p1)`` (``p1`` None or < 0: the end) at ``layer``, as ``store_rows``
        takes them: host uint8 ``[n, n_kv_heads, k_row_bytes]`` and ``[n, n_kv_heads, v_row_bytes]``."""
        s = self.seq_table.resident(seq, "load_rows")
        layer = validate.layer(layer, self.spec.n_layers)
        self._raw_rows_supported("load_rows")
        p0, hi = validate.stored_range(p0, p1, s.lens[layer], f"load_rows of sequence {seq} at layer {layer}")
        return self.seq_table.read_rows(s, layer, p0, hi)

    def _raw_rows_supported(self, what: str) -> None:
        if self.spec.uses_tail:
            raise UnsupportedError(
                f"{what} on a cache with an f16 tail (tail > 0 or a per-channel K format): its newest rows are f16, "
                "not the format's bytes; use store/load, or a spec with tail=0 and a per-token K format"
            )

    def _committed(self, pending: Pending) -> None:
        if self.codec.commit(pending):
            self.prefix.root_hash = self.fingerprint.digest(self.codec.resolved_spec)

    def load(
        self, seq: int, layer: int, p0: int = 0, p1: int | None = None, *, out: Any = None, dtype: str | None = None
    ) -> tuple[Any, Any]:
        """Dequantized K, V of positions ``[p0, p1)`` (``p1`` None or < 0: the end): f32 on the backend's device.

        ``out=(k, v)``: write them into these host buffers instead (numpy arrays, ``ml_dtypes.bfloat16`` arrays or
        CPU torch tensors; C-contiguous, ``[p1 - p0, n_kv_heads, head_dim]``, float32, float16 or bfloat16) and
        return them: a buffer reused across calls costs no allocation or page faults. ``dtype`` ("float32",
        "float16", "bfloat16"): the output dtype (that of ``out`` when both are given); without ``out`` it returns
        new host arrays, bfloat16 as ``ml_dtypes.bfloat16`` (install ml_dtypes, or pass torch tensors as ``out``).
        Narrowing rounds to nearest even; values past float16's range become inf, as in ``astype``. A call that
        raises writes nothing."""
        s = self.seq_table.resident(seq, "load")
        layer = validate.layer(layer, self.spec.n_layers)
        p0, hi = validate.stored_range(p0, p1, s.lens[layer], f"load of sequence {seq} at layer {layer}")
        dtype = validate.load_dtype(dtype)
        shape = (hi - p0, self.spec.n_kv_heads, self.spec.head_dim)
        if out is None and dtype not in (None, "float32"):
            out = self._new_out(shape, dtype)
        dst = None if out is None else validate.load_out(out, dtype, shape)
        if hi == p0:  # nothing to read: a kltq layer before its first store has no side data to decode with
            if dst is not None:
                return dst.result
            empty = np.zeros(shape, np.float32)
            return self.backend.asarray(empty, "k"), self.backend.asarray(empty.copy(), "v")
        bs = self.spec.block_size
        if not (self.spec.uses_tail or self.spec.transformed):
            first = p0 // bs
            blocks = np.asarray(s.blocks[first : math.ceil(hi / bs)], np.int64)
            skip = p0 - first * bs
            if dst is not None:
                self.backend.load_into(self.pools, layer, blocks, hi - first * bs, skip, dst)
                return dst.result
            k, v = self.backend.load(self.pools, layer, blocks, hi - first * bs)
            return k[skip:], v[skip:]
        pages, rows = self._tail_parts(s, layer, p0, hi)
        if dst is not None and not self.spec.transformed:  # pages straight into out, then the f16 rows over them
            if pages is not None:
                blocks, n, skip, m = pages
                self.backend.load_into(self.pools, layer, blocks, n, skip, replace(dst, k=dst.k[:m], v=dst.v[:m]))
            for r0, rk, rv in rows:
                cast_into(dst.k[r0 : r0 + len(rk)], dst.dtype, rk)
                cast_into(dst.v[r0 : r0 + len(rv)], dst.dtype, rv)
            return dst.result
        k, v = self._assemble_f32(shape, pages, rows, layer)
        if dst is not None:
            cast_into(dst.k, dst.dtype, k)
            cast_into(dst.v, dst.dtype, v)
            return dst.result
        return self.backend.asarray(k, "k"), self.backend.asarray(v, "v")

    def _kv_f32(self, s: Seq, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host f32 K, V of every stored position of ``s`` at ``layer``, as ``load`` returns them (for scorers)."""
        n, bs = s.lens[layer], self.spec.block_size
        if not (self.spec.uses_tail or self.spec.transformed):
            blocks = np.asarray(s.blocks[: -(-n // bs)], np.int64)
            k, v = (self.backend.to_numpy(x) for x in self.backend.load(self.pools, layer, blocks, n))
            return np.asarray(k, np.float32), np.asarray(v, np.float32)
        shape = (n, self.spec.n_kv_heads, self.spec.head_dim)
        return self._assemble_f32(shape, *self._tail_parts(s, layer, 0, n), layer)

    @staticmethod
    def _new_out(shape: tuple[int, int, int], dtype: str) -> tuple[np.ndarray, np.ndarray]:
        if dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise UnsupportedError(
                    'load(dtype="bfloat16") returns ml_dtypes.bfloat16 arrays (numpy has no bfloat16): pip install '
                    "ml_dtypes, or pass out=(k, v) as torch.bfloat16 CPU tensors"
                ) from None
            np_dtype: Any = ml_dtypes.bfloat16
        else:
            np_dtype = np.dtype(dtype)
        return np.empty(shape, np_dtype), np.empty(shape, np_dtype)

    def _tail_parts(
        self, s: Seq, layer: int, p0: int, hi: int
    ) -> tuple[tuple[np.ndarray, int, int, int] | None, list[tuple[int, np.ndarray, np.ndarray]]]:
        """``[p0, hi)`` of a cache with an f16 tail or sink rows: the paged part as ``(blocks, n, skip, rows)`` for
        ``load``/``load_into`` (None when there is none), and the f32 rows that stand over or after it, as
        ``(first output row, k, v)``: the f16 sink rows (which stand for their quantized pages), then the tail's."""
        bs = self.spec.block_size
        paged = s.pages()[layer]
        pages = None
        rows: list[tuple[int, np.ndarray, np.ndarray]] = []
        end = min(hi, paged)
        if p0 < end:
            first = p0 // bs
            pages = (
                np.asarray(s.blocks[first : math.ceil(end / bs)], np.int64),
                end - first * bs,
                p0 - first * bs,
                end - p0,
            )
            sink = min(self.spec.sink_tokens, end)
            if p0 < sink:
                sk, sv = self.tail.sink_rows(s, layer)
                rows.append((0, sk[p0:sink], sv[p0:sink]))
        if hi > paged:
            kt, vt = self.tail.rows(s, layer, max(p0, paged) - paged, hi - paged)
            rows.append((max(p0, paged) - p0, kt, vt))
        return pages, rows

    def _assemble_f32(
        self,
        shape: tuple[int, int, int],
        pages: tuple[np.ndarray, int, int, int] | None,
        rows: list[tuple[int, np.ndarray, np.ndarray]],
        layer: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host f32 K, V of ``_tail_parts``' pieces, back through the codec's transforms. Pages alone or one tail
        piece alone come back without a copy (a 16k-token load is ~130 MB of f32)."""
        if pages is not None:
            blocks, n, skip, _ = pages
            paged = [
                np.asarray(self.backend.to_numpy(x), np.float32)[skip:]
                for x in self.backend.load(self.pools, layer, blocks, n)
            ]
            rows = [(0, paged[0], paged[1]), *rows]
        if len(rows) == 1 and len(rows[0][1]) == shape[0]:
            _, k, v = rows[0]
        else:
            k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            for r0, rk, rv in rows:  # pages first, the f16 sink and tail rows over and after them
                k[r0 : r0 + len(rk)], v[r0 : r0 + len(rv)] = rk, rv
        if self.spec.transformed and len(k):
            k, v = self.codec.backward("k", layer, k), self.codec.backward("v", layer, v)
        return k, v

    def attention(
        self,
        layer: int,
        q: Any,
        seqs: Sequence[int],
        q_lens: Sequence[int] | None = None,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        observe: bool = False,
    ) -> Any:
        """Attention of ``q [sum(q_lens), n_heads, head_dim]`` over each sequence's cached K/V at ``layer``.

        The queries of a sequence are its last ``q_len`` stored tokens (store before attending).
        ``observe=True`` also accumulates the attention mass each key receives (for ``H2O``; the
        last ``observe_window`` queries' mass is kept apart for ``SnapKV``).
        """
        spec = self.spec
        layer = validate.layer(layer, spec.n_layers)
        seq_objs = [self.seq_table.get(x) for x in validate.seq_ids(seqs)]
        if not seq_objs:
            raise ShapeError("attention needs at least one sequence in seqs")
        q = self.backend.asarray(q, "q")
        qls = validate.queries(q, spec.head_dim, spec.n_kv_heads, len(seq_objs), q_lens)
        lens = [s.lens[layer] - s.base for s in seq_objs]  # resident tokens
        for i, (n_q, n) in enumerate(zip(qls, lens)):
            if n_q > n:
                base = seq_objs[i].base
                why = (
                    f"only its last {n} are resident (the first {base} are offloaded): queries must be resident "
                    "tokens; offload with a larger keep_tokens"
                    if base
                    else "store the new tokens' K/V before attending"
                )
                raise PositionError(
                    f"sequence {seqs[i]} has {n + base} tokens at layer {layer} but {n_q} queries; {why}"
                )
        scale, window = validate.attention_options(scale, causal, window, observe, spec.head_dim)
        if observe and len({id(x) for x in seq_objs}) < len(seq_objs):  # whose queries would its mass be?
            raise ShapeError("attention(observe=True) takes each sequence once per call; attend it in separate calls")
        causal = bool(causal)
        offloaded = any(s.base for s in seq_objs)
        if offloaded and (window is not None or observe):
            raise UnsupportedError(
                "attention over an offloaded sequence takes neither window nor observe; pass window=None, "
                "observe=False (or keep the sequence resident)"
            )
        bs = spec.block_size
        n_pages = [0 if spec.uses_tail else -(-n // bs) for n in lens]  # the tail path builds its own tables
        table = self.seq_table.batch_table(seq_objs, n_pages)
        holes = None
        if any(s.holes for s in seq_objs):  # a per-head eviction's masked rows (only masks_heads backends have them)
            holes = np.zeros((len(seq_objs), spec.n_kv_heads, 2), np.int32)
            for i, s in enumerate(seq_objs):
                if s.holes:
                    holes[i] = s.holes[layer]
        batch = AttentionBatch(table, np.array(lens, np.int32), np.array(qls, np.int32), scale, causal, window, holes)
        check_shape(self.backend, spec, batch, int(q.shape[1]))  # a backend's per-call limits, where it has any
        if spec.transformed:
            q = self.codec.query(self.backend, layer, q)
        # a kltq K format: pages score q in coefficient space (an f16 tail scores q itself)
        pages_q = self.codec.coefficient_query(self.backend, layer, q) if spec.k_codec else None
        if spec.uses_tail:
            # a kltq V format: the pages' output (over V's decoded coefficients) back to values before it is merged
            # with the f16 rows'
            pages_v = (lambda o: self.codec.coefficient_output(layer, o)) if spec.v_codec else None
            out, lse = self.tail.attention(layer, q, seq_objs, qls, scale, causal, window, pages_q, pages_v)
            if observe:
                self.evictor.observe_tail(seq_objs, layer, q, batch, lse, pages_q)
            out = self.backend.asarray(out, "out")
            return self.codec.output(self.backend, layer, out) if spec.transformed and not spec.v_codec else out
        if pages_q is not None:
            q = pages_q[0]
        if offloaded:
            out = self.streamer.attention(layer, q, seq_objs, qls, scale, causal)
        elif observe:
            out = self.evictor.observe(seq_objs, layer, q, batch)
        else:
            out = self.backend.attention(q, self.pools, layer, batch)
        if spec.transformed or spec.v_codec:  # (a kltq V format: over its coefficients, mapped back once)
            return self.codec.output(self.backend, layer, out)
        return self.backend.asarray(out, "out") if offloaded else out

    # -- block streaming -----------------------------------------------------------------------------

    def offload(self, seq: int, keep_tokens: int = 0) -> int:
        """Move ``seq``'s leading whole blocks to host memory, keeping at least its last ``keep_tokens``
        (and every block not yet stored at all layers) in the pools; returns the tokens moved. The
        sequence keeps growing with ``store``; ``attention`` streams the host part through the arena
        (``stream_arena_tokens``; in place where the pools are host memory) and merges the pieces by
        log-sum-exp. Other calls on it raise."""
        s = self.seq_table.get(seq)
        if s.holes:
            self.seq_table.resident(seq, "offload")  # says why
        return self.streamer.offload(s, validate.count(keep_tokens, "keep_tokens", error=PositionError))

    # -- eviction ------------------------------------------------------------------------------------

    def evict(self, seq: int, policy: Policy, keep_tokens: int) -> EvictionResult:
        """Shrink ``seq`` to at most ``keep_tokens`` positions chosen by ``policy``; the kept rows are
        moved byte for byte to positions 0.. (no re-quantization; with an f16 tail they are laid out as a store
        of them would be, see ``TailStore.keep_rows``), whole blocks are freed, and blocks the kept prefix still
        shares stay shared. Returns what was kept and dropped."""
        s = self.seq_table.resident(seq, "evict")
        if not isinstance(policy, Policy):
            raise SpecError(f"policy must be a kvhal.eviction policy (SinkWindow, H2O, SnapKV, AdaKV), got {policy!r}")
        keep_tokens = validate.count(keep_tokens, "keep_tokens", error=PositionError)
        return self.evictor.evict(int(seq), s, policy, keep_tokens)

    # -- snapshots -----------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], seqs: list[int] | None = None) -> None:
        """Write ``seqs`` (default: every sequence) to a crash-safe snapshot file (see ``kvhal.snapshot``)."""
        from . import snapshot

        snapshot.save(self, path, seqs)

    def restore(self, path: str | os.PathLike[str]) -> list[int]:
        """Add the snapshot's sequences to this cache and return their new ids. Everything is checked
        first; a ``SnapshotError`` or ``CapacityError`` leaves the cache exactly as it was."""
        from . import snapshot

        return snapshot.restore(self, path)

    @classmethod
    def from_snapshot(
        cls,
        path: str | os.PathLike[str],
        backend: str | Backend = "auto",
        *,
        capacity_tokens: int | None = None,
        **options: Any,
    ) -> tuple[KVCache, list[int]]:
        """A new cache of the snapshot's own spec and fingerprint holding its sequences, and their ids.

        ``capacity_tokens``: at least the snapshot's blocks (the default: exactly those). ``options`` go to
        ``KVCache`` (``allow_fallback``, ``backend_options``, ``tiers``...). Fails with a ``SnapshotError``
        as ``restore`` does."""
        import inspect

        from . import snapshot

        takes = [  # KVCache's keywords but the fingerprint, which is the snapshot's
            n for n, p in inspect.signature(cls).parameters.items() if p.kind is p.KEYWORD_ONLY and n != "fingerprint"
        ]
        if unknown := sorted(set(options) - set(takes)):
            raise SpecError(f"from_snapshot: no option {', '.join(unknown)}; KVCache's options are {', '.join(takes)}")
        spec, fingerprint, n_blocks = snapshot.header(path)
        if capacity_tokens is None:
            capacity_tokens = max(1, n_blocks) * spec.block_size
        capacity_tokens = validate.count(capacity_tokens, "capacity_tokens", 1)
        if capacity_tokens < n_blocks * spec.block_size:
            raise CapacityError(
                f"capacity_tokens={capacity_tokens} is less than the snapshot's {n_blocks} blocks of "
                f"{spec.block_size} tokens; pass at least {n_blocks * spec.block_size}"
            )
        cache = cls(spec, capacity_tokens, backend, fingerprint=fingerprint, **options)
        return cache, cache.restore(path)

    def stats(self) -> CacheStats:
        return collect(self.backend, self.pools, self.seq_table, self.prefix, self.evictor, self.streamer)
