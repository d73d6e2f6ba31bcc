"""KVCache: the paged block manager (backend-independent) in front of one backend.

Pages ("blocks") of ``block_size`` tokens are shared by all layers: a sequence has one block table,
and layer ``l`` of block ``b`` lives in ``pools[l]``. Each layer keeps its own token count, since an
engine stores layer by layer. Blocks are refcounted: ``seq_cp`` shares them and the next write into
a shared block copies it first (copy-on-write, byte for byte through ``Backend.copy_slots``).

Every public method validates everything and reserves every block it needs before it changes
anything, so a call that raises leaves the cache as it was.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import formats, registry, transforms
from .backend import AttentionBatch, Backend
from .backend_util import check_shape
from .blocks import BlockAllocator
from .errors import PositionError, SequenceError, ShapeError, SpecError, UnsupportedError
from .eviction import EvictionResult, EvictOnFull, OnEvict, Policy, Scores
from .fingerprint import Fingerprint, block_hash, extra_digest, hash_chain
from .formats.ggml import round_f16
from .spec import CacheSpec
from .streaming import HostBlocks

# a "calibrate" scale of a per-value format (fp8) is searched over this many fractions of a power of two,
# on at most this many values per head of the layer's first store (strided tokens)
CALIBRATION_STEPS = 16
CALIBRATION_VALUES = 16384


def _is_int(x: Any) -> bool:
    """A real integer: int or numpy integer, never a bool (True is not layer 1) nor an integral float."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class CacheStats:
    backend: str
    n_blocks: int
    block_size: int
    blocks_used: int
    blocks_free: int
    blocks_shared: int  # blocks referenced by more than one sequence
    capacity_tokens: int  # n_blocks * block_size: what the pools really hold per sequence-free cache
    n_seqs: int
    tokens: int  # sum over sequences of their longest layer
    k_format: str
    v_format: str
    k_bytes: int  # allocated, all layers
    v_bytes: int
    bytes_allocated: int  # what the backend reports for its pools
    bytes_per_token: int  # K+V over all layers and heads
    stream_arena_blocks: int = 0  # blocks set aside for streaming offloaded sequences (counted as used)
    offloaded_tokens: int = 0  # tokens of offloaded sequences held in host memory
    blocks_cached: int = 0  # blocks carrying a prefix hash (held or free)
    blocks_cached_free: int = 0  # free blocks still matchable (counted in blocks_free too)
    prefix_queries: int = 0  # match_prefix calls
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_blocks: int = 0
    prefix_miss_blocks: int = 0
    prefix_recomputed_tokens: int = 0  # tokens of those queries the caller had to store again
    prefix_evicted_blocks: int = 0  # cached blocks whose space was reused
    prefix_invalidated_blocks: int = 0  # hashed blocks rewritten in place by their only holder
    tier_hit_blocks: int = 0  # blocks match_prefix pulled back from the tiers
    tier_written_blocks: int = 0  # cached blocks written down to a tier (on eviction or write-through)
    tier_unwritten_blocks: int = 0  # evicted cached blocks no tier took (their content is recomputed later)
    evictions: int = 0  # evict() calls and full-cache evictions that dropped tokens
    evicted_tokens_called: int = 0  # tokens dropped by evict()
    evicted_tokens_on_full: int = 0  # tokens dropped because a store found no free block
    tail_tokens: int = 0  # tokens held in the f16 tails (host memory, every layer), longest layer per sequence
    tail_bytes: int = 0  # host bytes of those tails, K and V, all layers

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Seq:
    blocks: list[int]
    lens: list[int]  # tokens stored per layer
    tokens: list[int] = field(default_factory=list)  # token ids of positions 0.. (append_tokens)
    hashes: list[bytes] = field(default_factory=list)  # chain of the leading full, fully stored blocks
    extra: bytes = bytes(32)  # digest of the sequence's extra keys (tenant, LoRA)
    # blocks at or past this index hold rows moved from other positions (a middle seq_rm, a copy
    # from an offset): they are not what a prefill of their tokens stores, so they never get a hash
    sealable: int | None = None
    # attention mass per layer (observe=True): [n_kv_heads, positions] float64, all queries / last window
    # block streaming: the first ``base`` positions (whole blocks) live in host memory (streaming.py)
    base: int = 0
    host: HostBlocks | None = field(default=None, repr=False)
    mass: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    window_mass: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # spec.uses_tail: per layer, tokens in the quantized pages (whole blocks); the rest sit in the f16 tail
    paged: list[int] | None = None
    tail_k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # layer -> f16 [t, H, D], stored form
    tail_v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def pages(self) -> list[int]:
        """Tokens per layer held in the pools (all of them unless the cache keeps an f16 tail)."""
        return self.lens if self.paged is None else self.paged

    def keep_mass(self, columns: np.ndarray) -> None:
        """Positions moved (removed, compacted): the observed mass follows its keys (ascending old positions)."""
        for d in (self.mass, self.window_mass):
            for layer, m in d.items():
                d[layer] = m[:, columns[columns < m.shape[1]]]

    _table: np.ndarray | None = field(default=None, repr=False)

    def table(self) -> np.ndarray:
        """``blocks`` as int32, kept between changes: a decode step would otherwise convert the whole
        list (~25 us at 2,048 pages, a tenth of a 4k-token step on the cpu backend)."""
        if self._table is None:
            self._table = np.asarray(self.blocks, np.int32)
        return self._table

    def changed(self) -> None:
        self._table = None


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
        if not _is_int(capacity_tokens) or capacity_tokens <= 0:
            raise SpecError(f"capacity_tokens must be a positive int, got {capacity_tokens!r}")
        if not isinstance(allow_fallback, bool):
            raise SpecError(f"allow_fallback must be a bool, got {allow_fallback!r}")
        if fingerprint is not None and not isinstance(fingerprint, Fingerprint):
            raise SpecError(f"fingerprint must be a kvhal.Fingerprint, got {type(fingerprint).__name__}")
        self.spec = spec
        self.fingerprint = fingerprint if fingerprint is not None else Fingerprint(model="")
        self.root_hash = self.fingerprint.digest(spec)  # parent of every chain's first block
        # per layer, per-head scales; None while "calibrate" waits for that layer's first store
        self._scales: dict[str, list[np.ndarray | None]] = {
            w: _resolve_scale(getattr(spec, f"{w}_scale"), spec) for w in "kv"
        }
        if spec.uses_tail and isinstance(on_full, EvictOnFull):
            raise UnsupportedError(
                "on_full=EvictOnFull with an f16 tail (tail > 0 or a per-channel K format) is not supported yet: "
                "eviction moves rows between pages and the tail; use on_full='prefix_lru' or 'raise'"
            )
        self.backend = registry.resolve(backend, spec, allow_fallback, backend_options)
        if not _is_int(stream_arena_tokens) or stream_arena_tokens < 0:
            raise SpecError(f"stream_arena_tokens must be an int >= 0, got {stream_arena_tokens!r}")
        arena = math.ceil(int(stream_arena_tokens) / spec.block_size)
        self.n_blocks = math.ceil(int(capacity_tokens) / spec.block_size) + arena
        if not (on_full in ("prefix_lru", "raise") or isinstance(on_full, EvictOnFull)):
            raise SpecError(f"on_full must be 'prefix_lru', 'raise' or a kvhal.eviction.EvictOnFull, got {on_full!r}")
        if on_evict is not None and not callable(on_evict):
            raise SpecError(f"on_evict must be callable or None, got {type(on_evict).__name__}")
        if not _is_int(observe_window) or observe_window < 1:
            raise SpecError(f"observe_window must be a positive int, got {observe_window!r}")
        self.on_full, self.on_evict, self.observe_window = on_full, on_evict, int(observe_window)
        self.tiers = self._check_tiers(tiers)
        if not isinstance(write_through, bool):
            raise SpecError(f"write_through must be a bool, got {write_through!r}")
        if write_through and not self.tiers:
            raise SpecError("write_through=True needs tiers=[...] to write to")
        self.write_through = write_through
        self._tier_counts = {"hit": 0, "written": 0, "unwritten": 0}
        self._evicted = {"evict": 0, "on_full": 0, "n": 0}
        self.pools = self.backend.allocate(spec, self.n_blocks)
        self._blocks = BlockAllocator(self.n_blocks, spec.block_size, reuse_cached=on_full != "raise")
        self._arena = self._blocks.alloc(arena)  # never released: the streaming window
        if self.tiers:
            self._blocks.on_evict = self._write_down
        self._ref = self._blocks.ref
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # -- sequences -----------------------------------------------------------------------------------

    def new_seq(self, extra: dict[str, Any] | None = None) -> int:
        """A new empty sequence. ``extra`` keys (LoRA id, cache salt) enter its block hashes, so
        sequences with different extra keys never share cached blocks."""
        return self._add_seq(self._new(_Seq([], [0] * self.spec.n_layers, extra=extra_digest(extra))))

    def _new(self, s: _Seq) -> _Seq:
        if self.spec.uses_tail and s.paged is None:
            s.paged = list(s.lens)
        return s

    # -- transforms (scales, rotation) ---------------------------------------------------------------

    @property
    def resolved_spec(self) -> CacheSpec:
        """The spec with calibrated scales filled in (once the first store fixed them): what names this
        cache's bytes in fingerprints, block hashes and snapshots."""
        import dataclasses

        spec, out = self.spec, dict[str, Any]()
        for w in "kv":
            per_layer = self._scales[w]
            if getattr(spec, f"{w}_scale") == "calibrate" and all(sc is not None for sc in per_layer):
                out[f"{w}_scale"] = tuple(tuple(float(x) for x in sc) for sc in per_layer if sc is not None)
        return dataclasses.replace(spec, **out) if out else spec

    def calibrating(self) -> bool:
        """True while a "calibrate" scale is fixed for some layers but not yet for all of them."""
        return any(
            any(sc is None for sc in per_layer) and any(sc is not None for sc in per_layer)
            for per_layer in self._scales.values()
        )

    def scales(self) -> dict[str, tuple[tuple[float, ...] | None, ...]]:
        """The ``k``/``v`` scales in use: per layer, one per KV head (None: a "calibrate" layer before its
        first store)."""
        return {
            w: tuple(None if sc is None else tuple(float(y) for y in sc) for sc in per_layer)
            for w, per_layer in self._scales.items()
        }

    def _scale(self, which: str, layer: int) -> np.ndarray:
        """Layer ``layer``'s per-head scales (1.0 for a "calibrate" layer that holds nothing yet)."""
        sc = self._scales[which][layer]
        return np.ones(self.spec.n_kv_heads) if sc is None else sc

    def _calibrate(self, which: str, x: np.ndarray) -> np.ndarray:
        """Per-head scales from a layer's first store ``x [n, H, D]`` (rotated first where the spec rotates).

        The power of two that brings the largest ``|x|`` to at most the format's calibration_max; a
        per-value format (fp8) then multiplies it by whichever of CALIBRATION_STEPS fractions
        ``2**(i/steps)`` reads the store back with the least squared error. Dividing by a power of
        two is exact in a float format, so it only moves values out of saturation and subnormals;
        the fraction moves where every value falls between the format's steps (SmolLM2's keys in
        fp8_e4m3: 10% lower attention KL than scale 1; vLLM's ``amax / 448`` was 3% higher).
        """
        fmt = self.spec.k_fmt if which == "k" else self.spec.v_fmt
        if fmt.calibration_max is None:
            return np.ones(self.spec.n_kv_heads)
        if getattr(self.spec, f"{which}_rotation") is not None:
            x = transforms.rotate(x)
        x = np.asarray(x, np.float64)
        amax = np.abs(x).max(axis=(0, 2))
        ratio = np.where(amax > 0, amax, fmt.calibration_max) / fmt.calibration_max
        base = np.exp2(np.ceil(np.log2(ratio)))
        if fmt.round_values is None:
            return base
        n, n_heads, d = x.shape
        sample = x[:: max(1, n * d // CALIBRATION_VALUES)].transpose(1, 0, 2).reshape(n_heads, -1)
        scales = base[:, None] * np.exp2(np.arange(CALIBRATION_STEPS) / CALIBRATION_STEPS)[None, :]
        err = np.stack(
            [
                ((fmt.round_values((sample / sc[:, None]).astype(np.float32)) * sc[:, None] - sample) ** 2).sum(1)
                for sc in scales.T
            ],
            axis=1,
        )  # [H, steps]
        return scales[np.arange(n_heads), err.argmin(axis=1)]

    def _forward(self, which: str, x: np.ndarray, sc: np.ndarray) -> np.ndarray:
        """What is stored for values ``x [n, H, D]``: ``R (x / scale)``, f32."""
        y = np.asarray(x, np.float64) / sc[None, :, None]
        if getattr(self.spec, f"{which}_rotation") is not None:
            y = transforms.rotate(y)
        return y.astype(np.float32)

    def _backward(self, which: str, layer: int, y: np.ndarray) -> np.ndarray:
        """Values from stored form ``y [n, H, D]``: ``scale * R^T y``, f32."""
        sc = self._scale(which, layer)
        x = np.asarray(y, np.float64)
        if getattr(self.spec, f"{which}_rotation") is not None:
            x = transforms.unrotate(x)
        return (x * sc[None, :, None]).astype(np.float32)

    def _set_root(self) -> None:
        self.root_hash = self.fingerprint.digest(self.resolved_spec)

    def _add_seq(self, s: _Seq) -> int:
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = s
        return sid

    # -- token ids and the prefix cache --------------------------------------------------------------

    def append_tokens(self, seq: int, token_ids: Any) -> None:
        """Record the token ids of ``seq``'s next positions (before or after their layers are stored).

        A full block whose token ids are known and whose every layer is stored gets its hash and
        becomes matchable by ``match_prefix``."""
        s = self._seq(seq)
        ids = _token_ids(token_ids)
        s.tokens.extend(ids)
        self._seal(s)

    def tokens(self, seq: int) -> list[int]:
        """The token ids recorded for ``seq``."""
        return list(self._seq(seq).tokens)

    def match_prefix(self, token_ids: Any, extra: dict[str, Any] | None = None) -> tuple[int, int]:
        """A new sequence sharing the longest cached prefix of ``token_ids``, and its token count.

        Only whole blocks are shared, and at most ``len(token_ids) - 1`` tokens, so the caller always
        computes the last token (its logits are needed). The new sequence holds the matched tokens'
        ids; the caller appends and stores the rest."""
        ids = _token_ids(token_ids)
        ex = extra_digest(extra)
        bs = self.spec.block_size
        usable = max(len(ids) - 1, 0) // bs
        if self.spec.uses_tail:  # as a prefill of all of ids would: its last `tail` tokens stay f16
            usable = min(usable, max(len(ids) - self.spec.tail, 0) // bs)
        chain = hash_chain(self.root_hash, ids[: usable * bs], bs, ex)
        blocks = self._blocks.lookup(chain)
        for b in blocks:
            self._blocks.acquire(b)
        if self.tiers and len(blocks) < len(chain):
            blocks += self._pull(chain[len(blocks) :])
        n = len(blocks) * bs
        c = self._blocks.counters
        c.queries += 1
        c.query_tokens += len(ids)
        c.hit_tokens += n
        c.hit_blocks += len(blocks)
        c.miss_blocks += len(ids) // bs - len(blocks)
        c.recomputed_tokens += len(ids) - n
        t = _Seq(list(blocks), [n] * self.spec.n_layers, tokens=ids[:n], hashes=chain[: len(blocks)], extra=ex)
        return self._add_seq(self._new(t)), n

    # -- tiers ---------------------------------------------------------------------------------------

    @staticmethod
    def _check_tiers(tiers: Sequence[Any] | None) -> list[Any]:
        if tiers is None:
            return []
        from .tiers import Tier

        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence):
            raise SpecError(f"tiers must be a list of kvhal.tiers tiers, got {type(tiers).__name__}")
        for i, t in enumerate(tiers):
            if not isinstance(t, Tier):
                raise SpecError(f"tiers[{i}] is a {type(t).__name__}, not a kvhal.tiers.Tier (HostTier, DiskTier, ...)")
        return list(tiers)

    def _keys(self, hashes: list[bytes]) -> list[Any]:
        from .tiers import BlockKey

        return [BlockKey(self.root_hash, h) for h in hashes]

    def _put_down(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Write blocks to the first tier that takes each (tiers never raise for a store's failure)."""
        data = self.backend.read_blocks(self.pools, np.asarray(blocks, np.int64))
        keys = self._keys(hashes)
        todo = list(range(len(blocks)))
        for tier in self.tiers:
            flags = tier.put([keys[i] for i in todo], [memoryview(data[i]) for i in todo])
            todo = [i for i, ok in zip(todo, flags) if not ok]
            if not todo:
                break
        self._tier_counts["written"] += len(blocks) - len(todo)
        self._tier_counts["unwritten"] += len(todo)

    def _write_down(self, b: int, h: bytes) -> None:
        """A cached block's space is about to be reused: keep its bytes in a tier."""
        if not self.write_through:
            self._put_down([b], [h])

    def _pull(self, hashes: list[bytes]) -> list[int]:
        """Blocks for the leading ``hashes`` found in the tiers, written into free blocks (refcount 1,
        hashed). Stops at the first miss, a bad blob, or when no block is free."""
        out: list[int] = []
        for tier in self.tiers:
            if not hashes:
                break
            keys = self._keys(hashes)
            n = min(tier.contains(keys), self._blocks.n_usable)
            if n == 0:
                continue
            payloads = tier.get(keys[:n])
            good = 0
            while good < n and payloads[good] is not None and len(payloads[good]) == self.spec.block_nbytes:
                good += 1
            if good < n and payloads[good] is not None:  # a blob of the wrong size: never served, dropped
                tier.delete([keys[good]])
            if good == 0:
                continue
            n = min(good, self._blocks.n_usable)
            data = np.stack([np.frombuffer(p, np.uint8) for p in payloads[:n]])  # type: ignore[arg-type]
            ids = self._blocks.alloc(n)
            self.backend.write_blocks(self.pools, np.asarray(ids, np.int64), data)
            for b, h in zip(ids, hashes):
                self._blocks.register(b, h)
            out += ids
            hashes = hashes[n:]
            self._tier_counts["hit"] += n
        return out

    def _seal(self, s: _Seq) -> None:
        """Hash every newly complete block of ``s`` (token ids known, every layer stored)."""
        bs = self.spec.block_size
        n_full = min(len(s.tokens), min(s.pages())) // bs
        if s.sealable is not None:
            n_full = min(n_full, s.sealable)
        sealed: list[tuple[int, bytes]] = []
        for i in range(len(s.hashes), n_full):
            parent = s.hashes[-1] if s.hashes else self.root_hash
            h = block_hash(parent, s.tokens[i * bs : (i + 1) * bs], s.extra)
            s.hashes.append(h)
            if i < s.base // bs:  # offloaded before its tokens were known: in host memory, not matchable
                continue
            b = s.blocks[i - s.base // bs]
            self._blocks.register(b, h)
            sealed.append((b, h))
        if self.write_through and sealed:
            self._put_down([b for b, _ in sealed], [h for _, h in sealed])

    def seq_len(self, seq: int, layer: int | None = None) -> int:
        """Tokens stored for ``seq`` (at ``layer``; the longest layer when None)."""
        s = self._seq(seq)
        return max(s.lens) if layer is None else s.lens[self._layer(layer)]

    @property
    def seqs(self) -> list[int]:
        return list(self._seqs)

    def free_seq(self, seq: int) -> None:
        s = self._seq(seq)
        self._release(s.blocks[::-1])  # tail first: a chain's tail is evicted before its head
        del self._seqs[int(seq)]

    def seq_keep(self, seq: int) -> None:
        """Free every sequence but ``seq``."""
        self._seq(seq)
        for other in [o for o in self._seqs if o != seq]:
            self.free_seq(other)

    def seq_rm(self, seq: int, p0: int = -1, p1: int | None = -1) -> None:
        """Remove positions ``[p0, p1)`` (llama.cpp: p0 < 0 is the start, p1 < 0 the end).

        Sequences are dense: removing a middle range shifts the later tokens down by ``p1 - p0``
        (llama.cpp's ``seq_rm`` followed by ``seq_add``). K is stored as given (post-RoPE): an
        engine that needs re-rotated keys re-stores them.
        """
        s = self._resident(seq, "seq_rm")
        lo, hi = self._range(p0, p1)
        if self.spec.uses_tail:
            self._tail_rm(s, lo, hi)
            return
        bs = self.spec.block_size
        old_n = max(s.lens, default=0)
        new_lens = [L - max(0, min(hi, L) - min(lo, L)) for L in s.lens]
        moves = [(min(lo, L), min(hi, L), L) for L in s.lens]  # per layer: tokens [b, L) move to a
        shifting = [a < b < L for a, b, L in moves]
        # blocks written by a shift must be owned; count copies before touching anything
        n_keep = math.ceil(max(new_lens, default=0) / bs)
        first = min((a // bs for (a, b, L), sh in zip(moves, shifting) if sh), default=n_keep)
        touched = list(range(first, n_keep))
        self._reserve(sum(self._ref[s.blocks[i]] > 1 for i in touched))
        self._own(s, touched)
        for layer, ((a, b, L), sh) in enumerate(zip(moves, shifting)):
            if sh:
                src = self._slots(s, b, L)
                dst = self._slots(s, a, a + L - b)
                self.backend.copy_slots(self.pools, layer, src, dst)
        s.lens = new_lens
        self._release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        del s.tokens[lo:hi]
        s.keep_mass(np.r_[np.arange(min(lo, old_n)), np.arange(min(hi, old_n), old_n)])
        del s.hashes[lo // bs :]
        if any(shifting):
            s.sealable = min(s.sealable if s.sealable is not None else lo // bs, lo // bs)
        self._seal(s)

    def seq_cp(self, seq: int, p0: int = -1, p1: int | None = -1) -> int:
        """A new sequence holding positions ``[p0, p1)`` of ``seq``; whole pages are shared, not copied."""
        s = self._resident(seq, "seq_cp")
        lo, hi = self._range(p0, p1)
        if self.spec.uses_tail:
            return self._tail_cp(s, lo, hi)
        bs = self.spec.block_size
        lens = [max(0, min(hi, L) - min(lo, L)) for L in s.lens]
        n_blocks = math.ceil(max(lens, default=0) / bs)
        tokens = s.tokens[lo:hi]
        if lo % bs == 0:  # page-aligned: share
            blocks = s.blocks[lo // bs : lo // bs + n_blocks]
            for b in blocks:
                self._blocks.acquire(b)
            hashes = s.hashes[: min(len(tokens), min(lens)) // bs] if lo == 0 else []
            t = _Seq(list(blocks), lens, tokens=tokens, hashes=hashes, extra=s.extra)
        else:  # unaligned start: the rows move to other offsets, so copy them
            t = _Seq(self._blocks.alloc(n_blocks), lens, tokens=tokens, extra=s.extra)
            for layer, n in enumerate(lens):
                if n:
                    src = self._slots(s, lo, lo + n)
                    self.backend.copy_slots(self.pools, layer, src, self._slots(t, 0, n))
        t.sealable = s.sealable if lo == 0 else 0  # rows from an offset sit at other positions now
        t.mass = {layer: m[:, lo:hi].copy() for layer, m in s.mass.items()}
        t.window_mass = {layer: m[:, lo:hi].copy() for layer, m in s.window_mass.items()}
        self._seal(t)
        return self._add_seq(t)

    def _tail_rm(self, s: _Seq, lo: int, hi: int) -> None:
        """seq_rm with an f16 tail: a suffix that lies in the tail only (its rows are dropped there)."""
        paged = max(s.pages(), default=0)
        n = max(s.lens, default=0)
        if lo >= n:
            return
        if hi < n or lo < paged:
            raise UnsupportedError(
                f"seq_rm [{lo}, {hi}) with an f16 tail: only a suffix within the tail (positions >= {paged}, to the "
                f"end {n}) can be removed yet, since quantized blocks do not go back to f16; free the sequence and "
                "store it again instead"
            )
        for layer, L in enumerate(s.lens):
            if L > lo:
                keep = lo - s.pages()[layer]
                s.tail_k[layer], s.tail_v[layer] = s.tail_k[layer][:keep], s.tail_v[layer][:keep]
                s.lens[layer] = lo
        del s.tokens[lo:]
        s.keep_mass(np.arange(lo))

    def _tail_cp(self, s: _Seq, lo: int, hi: int) -> int:
        """seq_cp with an f16 tail: a whole sequence (its quantized blocks shared, its tail copied)."""
        n = max(s.lens, default=0)
        if lo != 0 or hi < n:
            raise UnsupportedError(
                f"seq_cp [{lo}, {hi}) with an f16 tail: only a copy of the whole sequence (p0=0, p1=-1) is supported "
                "yet; a part would need quantized blocks back in f16"
            )
        for b in s.blocks:
            self._blocks.acquire(b)
        t = _Seq(list(s.blocks), list(s.lens), tokens=list(s.tokens), hashes=list(s.hashes), extra=s.extra)
        t.paged, t.sealable = list(s.pages()), s.sealable
        t.tail_k, t.tail_v = dict(s.tail_k), dict(s.tail_v)  # tails are replaced, never written in place
        t.mass = {layer: m.copy() for layer, m in s.mass.items()}
        t.window_mass = {layer: m.copy() for layer, m in s.window_mass.items()}
        return self._add_seq(t)

    # -- data ----------------------------------------------------------------------------------------

    def store(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Append ``k``, ``v`` ``[n_new, n_kv_heads, head_dim]`` to ``seq`` at ``layer``."""
        s = self._seq(seq)
        layer = self._layer(layer)
        k = self.backend.asarray(k, "k")
        v = self.backend.asarray(v, "v")
        expect = (self.spec.n_kv_heads, self.spec.head_dim)
        for name, x in (("k", k), ("v", v)):
            if len(x.shape) != 3 or tuple(x.shape[1:]) != expect:
                raise ShapeError(
                    f"{name} has shape {tuple(x.shape)}; expected [n_new, {expect[0]}, {expect[1]}] "
                    "(tokens, n_kv_heads, head_dim)"
                )
        if k.shape[0] != v.shape[0]:
            raise ShapeError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}; store both for the same tokens")
        n = int(k.shape[0])
        if n == 0:
            return
        spec = self.spec
        pending: dict[tuple[str, int], np.ndarray] = {}  # scales calibrated by this store, kept if it succeeds
        if spec.transformed or spec.uses_tail:
            f32 = formats.get("f32")
            xs = {}
            for w, x in (("k", k), ("v", v)):
                x = np.asarray(self.backend.to_numpy(x), np.float32)
                f32.check_values(x)  # NaN/inf never reach a calibration
                sc = self._scales[w][layer]
                if sc is None:
                    sc = pending[(w, layer)] = self._calibrate(w, x)
                xs[w] = self._forward(w, x, sc) if spec.transformed else x
            if spec.uses_tail:
                self._store_tail(s, layer, xs["k"], xs["v"], pending)
                return
            k, v = self.backend.asarray(xs["k"], "k"), self.backend.asarray(xs["v"], "v")
        self.backend.check_values(spec.k_fmt, k)
        self.backend.check_values(spec.v_fmt, v)
        p0 = s.lens[layer] - s.base  # positions in the resident pages
        p1 = self._write(s, layer, k, v, p0, p0 + n)
        self._commit_scales(pending)
        s.lens[layer] = p1 + s.base
        if len(s.tokens) > len(s.hashes) * self.spec.block_size:
            self._seal(s)

    def _commit_scales(self, pending: dict[tuple[str, int], np.ndarray]) -> None:
        if pending:
            for (w, layer), sc in pending.items():
                self._scales[w][layer] = sc
            self._set_root()

    def _write(self, s: _Seq, layer: int, k: Any, v: Any, p0: int, p1: int) -> int:
        """Store rows for resident positions ``[p0, p1)``: reserve (evicting with EvictOnFull), own, allocate,
        write; a failure gives the blocks back."""
        bs = self.spec.block_size
        while True:  # with on_full=EvictOnFull, evict and retry until it fits or nothing more can go
            touched = list(range(p0 // bs, min(len(s.blocks), math.ceil(p1 / bs))))
            n_new = max(0, math.ceil(p1 / bs) - len(s.blocks))
            needed = n_new + sum(self._ref[s.blocks[i]] > 1 for i in touched)
            if needed <= self._blocks.n_usable or not self._make_room(needed, s):
                break
            p0 = s.lens[layer] - s.base  # eviction compacted this sequence: it may have moved
            p1 = p0 + len(k)
        self._reserve(needed)
        self._own(s, touched)
        added = self._blocks.alloc(n_new)
        if added:
            s.blocks.extend(added)
            s.changed()
        try:
            self.backend.store(self.pools, layer, k, v, self._slots(s, p0, p1))
        except BaseException:
            self._release(added)
            if added:
                del s.blocks[len(s.blocks) - len(added) :]
                s.changed()
            raise
        return p1

    def _store_tail(
        self, s: _Seq, layer: int, k: np.ndarray, v: np.ndarray, pending: dict[tuple[str, int], np.ndarray]
    ) -> None:
        """Append stored-form rows to the f16 tail; whole blocks that leave it (all but the last ``tail``
        tokens, a block at a time) are quantized into the pages from their f16 values."""
        spec, bs = self.spec, self.spec.block_size
        f16 = formats.get("f16")
        for fmt, x in ((spec.k_fmt, k), (spec.v_fmt, v)):  # finite already (store): one pass for the range
            amax = float(np.abs(x).max()) if x.size else 0.0
            for f in (f16, fmt):
                if amax > f.max_abs and not f.saturates:
                    f.check_values(x)  # raises, with its message
        assert s.paged is not None
        # in f32 holding f16 values (round_f16: numpy's float16 cast is a scalar loop); f16 again in the tail
        ck, cv = round_f16(k), round_f16(v)
        if layer in s.tail_k and len(s.tail_k[layer]):
            ck = np.concatenate([s.tail_k[layer].astype(np.float32), ck])
            cv = np.concatenate([s.tail_v[layer].astype(np.float32), cv])
        total = s.lens[layer] + len(k)
        p0 = s.paged[layer]
        flush = max(0, total - spec.tail - p0) // bs * bs
        if flush:
            kq, vq = self.backend.asarray(ck[:flush], "k"), self.backend.asarray(cv[:flush], "v")
            self._write(s, layer, kq, vq, p0, p0 + flush)
        self._commit_scales(pending)
        s.tail_k[layer], s.tail_v[layer] = ck[flush:].astype(np.float16), cv[flush:].astype(np.float16)
        s.paged[layer] = p0 + flush
        s.lens[layer] = total
        self._seal(s)

    def load(self, seq: int, layer: int, p0: int = 0, p1: int | None = None) -> tuple[Any, Any]:
        """Dequantized K, V of positions ``[p0, p1)`` (``p1`` None or < 0: the end), f32 on the backend's device."""
        s = self._resident(seq, "load")
        layer = self._layer(layer)
        L = s.lens[layer]
        p0 = self._position(p0, "p0", allow_none=False)
        p1 = self._position(p1, "p1")
        hi = L if p1 is None or p1 < 0 else p1
        if not (0 <= p0 <= hi <= L):
            raise PositionError(
                f"load range [{p0}, {hi}) is outside sequence {seq}, which has {L} tokens at layer {layer}"
            )
        bs = self.spec.block_size
        if not (self.spec.uses_tail or self.spec.transformed):
            first = p0 // bs
            blocks = np.asarray(s.blocks[first : math.ceil(hi / bs)], np.int64)
            k, v = self.backend.load(self.pools, layer, blocks, hi - first * bs)
            skip = p0 - first * bs
            return k[skip:], v[skip:]
        paged = s.pages()[layer]
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        if p0 < min(hi, paged):
            first, end = p0 // bs, min(hi, paged)
            blocks = np.asarray(s.blocks[first : math.ceil(end / bs)], np.int64)
            k, v = self.backend.load(self.pools, layer, blocks, end - first * bs)
            skip = p0 - first * bs
            ks.append(np.asarray(self.backend.to_numpy(k), np.float32)[skip:])
            vs.append(np.asarray(self.backend.to_numpy(v), np.float32)[skip:])
        if hi > paged:
            lo = max(p0, paged) - paged
            ks.append(s.tail_k[layer][lo : hi - paged].astype(np.float32))
            vs.append(s.tail_v[layer][lo : hi - paged].astype(np.float32))
        if len(ks) == 1:  # pages only or tail only: no copy (a 16k-token load is ~130 MB of f32)
            k, v = ks[0], vs[0]
        else:
            empty = np.zeros((0, self.spec.n_kv_heads, self.spec.head_dim), np.float32)
            k, v = np.concatenate([empty, *ks]), np.concatenate([empty, *vs])
        if self.spec.transformed and len(k):
            k, v = self._backward("k", layer, k), self._backward("v", layer, v)
        return self.backend.asarray(k, "k"), self.backend.asarray(v, "v")

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
        layer = self._layer(layer)
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise SequenceError(f"seqs must be a list of sequence ids, got {type(seqs).__name__}")
        seq_objs = [self._seq(x) for x in seqs]
        if not seq_objs:
            raise ShapeError("attention needs at least one sequence in seqs")
        q = self.backend.asarray(q, "q")
        if len(q.shape) != 3 or q.shape[2] != self.spec.head_dim:
            raise ShapeError(f"q has shape {tuple(q.shape)}; expected [sum(q_lens), n_heads, {self.spec.head_dim}]")
        n_heads = int(q.shape[1])
        if n_heads == 0 or n_heads % self.spec.n_kv_heads:
            raise ShapeError(
                f"q has {n_heads} heads, not a multiple of the cache's {self.spec.n_kv_heads} KV heads (GQA needs one)"
            )
        if q_lens is None:
            if len(seq_objs) != 1 and q.shape[0] != len(seq_objs):
                raise ShapeError("pass q_lens when attending over several sequences with more than one query each")
            q_lens = [int(q.shape[0])] if len(seq_objs) == 1 else [1] * len(seq_objs)
        if isinstance(q_lens, (str, bytes)) or not isinstance(q_lens, (Sequence, np.ndarray)):
            raise ShapeError(f"q_lens must be a list of ints, got {type(q_lens).__name__}")
        if not all(_is_int(n) for n in q_lens):
            raise ShapeError(f"q_lens must hold ints, got {list(q_lens)!r}")
        # plain ints: numpy calls on these few-element arrays cost more than the checks themselves
        qls = [int(n) for n in q_lens]
        if len(qls) != len(seq_objs) or min(qls) < 1:
            raise ShapeError(
                f"q_lens must hold one positive count per sequence; got {list(q_lens)} for {len(seq_objs)} seqs"
            )
        if sum(qls) != q.shape[0]:
            raise ShapeError(f"q has {q.shape[0]} rows but q_lens sums to {sum(qls)}")
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
        if window is not None and (not _is_int(window) or window < 1):
            raise ShapeError(f"window must be a positive int or None, got {window!r}")
        if not isinstance(causal, (bool, np.bool_)):
            raise ShapeError(f"causal must be a bool, got {causal!r}")
        if scale is None:
            scale = 1.0 / math.sqrt(self.spec.head_dim)
        elif (
            not isinstance(scale, (int, float, np.integer, np.floating))
            or isinstance(scale, (bool, np.bool_))
            or not math.isfinite(scale)
        ):
            raise ShapeError(f"scale must be a finite real number or None, got {scale!r}")
        bs = self.spec.block_size
        n_pages = [-(-n // bs) for n in lens]
        if self.spec.uses_tail:  # the tail path builds its own tables over the quantized pages
            n_pages = [0] * len(seq_objs)
        if len(seq_objs) == 1:  # a view of the cached page list, no copy
            table = seq_objs[0].table()[None, : n_pages[0]]
        else:
            table = np.full((len(seq_objs), max(n_pages)), -1, np.int32)
            for i, (s, nb) in enumerate(zip(seq_objs, n_pages)):
                table[i, :nb] = s.table()[:nb]
        lens_arr, ql = np.array(lens, np.int32), np.array(qls, np.int32)
        if not isinstance(observe, (bool, np.bool_)):
            raise ShapeError(f"observe must be a bool, got {observe!r}")
        win = None if window is None else int(window)
        batch = AttentionBatch(table, lens_arr, ql, float(scale), bool(causal), win)
        check_shape(self.backend, self.spec, batch, n_heads)  # a backend's per-call limits, where it declares any
        if self.spec.transformed or self.spec.uses_tail:
            if observe and self.spec.uses_tail:
                raise UnsupportedError(
                    "attention(observe=True) with an f16 tail (tail > 0 or a per-channel K format) is not supported "
                    "yet; pass observe=False"
                )
            tq = self._q_forward(layer, q) if self.spec.transformed else q
            if self.spec.uses_tail:
                res = self._tail_attention(layer, tq, seq_objs, qls, float(scale), bool(causal), win)
            elif any(s.base for s in seq_objs):
                if window is not None or observe:
                    raise UnsupportedError(
                        "attention over an offloaded sequence takes neither window nor observe; pass window=None, "
                        "observe=False (or keep the sequence resident)"
                    )
                res = self._streamed_attention(layer, tq, seq_objs, qls, float(scale), bool(causal))
            else:
                res = self.backend.attention(tq, self.pools, layer, batch)
                if observe:
                    self._observe(seq_objs, layer, tq, batch)
            return self._out_backward(layer, res) if self.spec.transformed else self.backend.asarray(res, "out")
        if any(s.base for s in seq_objs):
            if window is not None or observe:
                raise UnsupportedError(
                    "attention over an offloaded sequence takes neither window nor observe; pass window=None, "
                    "observe=False (or keep the sequence resident)"
                )
            return self._streamed_attention(layer, q, seq_objs, qls, float(scale), bool(causal))
        out = self.backend.attention(q, self.pools, layer, batch)
        if observe:
            self._observe(seq_objs, layer, q, batch)
        return out

    def _observe(self, seq_objs: list[_Seq], layer: int, q: Any, batch: AttentionBatch) -> None:
        mass = self.backend.attention_mass(q, self.pools, layer, batch, self.observe_window)
        for s, (total, tail) in zip(seq_objs, mass):
            old = s.mass.get(layer)
            if old is not None:
                total[:, : old.shape[1]] += old[:, : total.shape[1]]
            s.mass[layer], s.window_mass[layer] = total, tail

    def _kv_head_of(self, n_heads: int) -> np.ndarray:
        return np.arange(n_heads) // (n_heads // self.spec.n_kv_heads)

    def _q_forward(self, layer: int, q: Any) -> Any:
        """Queries against stored K ``R (k / s)``: ``s * R q`` per KV head, so scores are unchanged."""
        x = np.asarray(self.backend.to_numpy(q), np.float64)
        if self.spec.k_rotation is not None:
            x = transforms.rotate(x)
        sc = self._scale("k", layer)
        x = x * sc[self._kv_head_of(x.shape[1])][None, :, None]
        return self.backend.asarray(x.astype(np.float32), "q")

    def _out_backward(self, layer: int, out: Any) -> Any:
        """Attention over stored V ``R (v / s)`` back to values: ``s * R^T out`` per KV head (exact)."""
        x = np.asarray(self.backend.to_numpy(out), np.float64)
        if self.spec.v_rotation is not None:
            x = transforms.unrotate(x)
        sc = self._scale("v", layer)
        x = x * sc[self._kv_head_of(x.shape[1])][None, :, None]
        return self.backend.asarray(x.astype(np.float32), "out")

    def _tail_attention(
        self, layer: int, q: Any, seq_objs: list[_Seq], qls: list[int], scale: float, causal: bool, window: int | None
    ) -> np.ndarray:
        """Attention over the quantized pages (the backend's kernel) merged by log-sum-exp with attention
        over the f16 tail (float64 here): exact, since the two key sets are disjoint."""
        from .backend_util import _softmax, merge_lse

        bs, pools = self.spec.block_size, self.pools
        qh = np.asarray(self.backend.to_numpy(q), np.float32)
        group = qh.shape[1] // self.spec.n_kv_heads
        out = np.empty(qh.shape, np.float32)
        start = 0
        for s, n_q in zip(seq_objs, qls):
            rows = qh[start : start + n_q]
            L, P = s.lens[layer], s.pages()[layer]
            pos = np.arange(L - n_q, L)
            a = max(0, P - (L - n_q))  # queries that sit in the paged region
            parts = []
            if P:
                o = np.zeros(rows.shape, np.float32)
                lse = np.full(rows.shape[:2], -np.inf)
                table = s.table()[None, : P // bs]

                def run(
                    r: np.ndarray, causal_: bool, win: int | None, n_kv: int = P, table: np.ndarray = table
                ) -> tuple[np.ndarray, np.ndarray]:
                    lens, ql = np.array([n_kv], np.int32), np.array([len(r)], np.int32)
                    batch = AttentionBatch(table, lens, ql, scale, causal_, win)
                    return self.backend.attention_lse(r, pools, layer, batch)

                if a:  # the last `a` positions of the pages: the kernel's own masking
                    o[:a], lse[:a] = run(rows[:a], causal, window)
                if a < n_q and window is None:  # every page key precedes these queries
                    o[a:], lse[a:] = run(rows[a:], False, None)
                elif a < n_q:  # window: as the last query of the pages with a window shortened to match
                    assert window is not None
                    for i in range(a, n_q):
                        w = P - int(pos[i]) + window - 1
                        if w >= 1:
                            o[i : i + 1], lse[i : i + 1] = run(rows[i : i + 1], False, w)
                parts.append((o, lse))
            if L > P:
                kt = np.repeat(s.tail_k[layer].astype(np.float64), group, axis=1)  # [T, Hq, D]
                vt = np.repeat(s.tail_v[layer].astype(np.float64), group, axis=1)
                scores = np.einsum("qhd,khd->hqk", rows.astype(np.float64), kt) * scale
                j = np.arange(P, L)[None, :]
                lo = pos[:, None] - window + 1 if window is not None else np.full((n_q, 1), P)
                hi = pos[:, None] + 1 if causal else np.full((n_q, 1), L)
                scores = np.where(((j >= lo) & (j < hi))[None], scores, -np.inf)
                p, lse_t = _softmax(scores)
                parts.append((np.einsum("hqk,khd->qhd", p, vt).astype(np.float32), lse_t.T))
            out[start : start + n_q] = merge_lse(parts)
            start += n_q
        return out

    # -- block streaming -----------------------------------------------------------------------------

    def offload(self, seq: int, keep_tokens: int = 0) -> int:
        """Move ``seq``'s leading whole blocks to host memory, keeping at least its last ``keep_tokens``
        (and every block not yet stored at all layers) in the pools; returns the tokens moved. The
        sequence keeps growing with ``store``; ``attention`` streams the host part through the arena
        (``stream_arena_tokens``; in place where the pools are host memory) and merges the pieces by
        log-sum-exp. Other calls on it raise."""
        s = self._seq(seq)
        if self.spec.uses_tail:
            raise UnsupportedError("offload with an f16 tail (tail > 0 or a per-channel K format) is not supported yet")
        if not self._arena:
            raise SpecError("offload needs a streaming arena: create the cache with stream_arena_tokens > 0")
        if not _is_int(keep_tokens) or keep_tokens < 0:
            raise PositionError(f"keep_tokens must be an int >= 0, got {keep_tokens!r}")
        bs = self.spec.block_size
        n_move = max(0, min(s.lens) - s.base - int(keep_tokens)) // bs
        if n_move == 0:
            return 0
        moved = s.blocks[:n_move]
        data = self.backend.read_blocks(self.pools, np.asarray(moved, np.int64))
        if s.host is None:
            s.host = HostBlocks.for_pools(self.backend, self.pools, len(self._arena))
        s.host.append(data)
        del s.blocks[:n_move]
        s.changed()
        s.base += n_move * bs
        self._release(moved[::-1])
        return n_move * bs

    def _streamed_attention(
        self, layer: int, q: Any, seq_objs: list[_Seq], qls: list[int], scale: float, causal: bool
    ) -> np.ndarray:
        from .backend_util import merge_lse

        bs, arena = self.spec.block_size, np.asarray(self._arena, np.int32)
        qh = self.backend.to_numpy(q)
        out = np.empty(qh.shape, np.float32)
        start = 0
        for s, n_q in zip(seq_objs, qls):
            rows = qh[start : start + n_q]
            tail = s.lens[layer] - s.base
            parts = []
            if tail:
                table = s.table()[None, : -(-tail // bs)]
                batch = AttentionBatch(table, np.array([tail], np.int32), np.array([n_q], np.int32), scale, causal)
                parts.append(self.backend.attention_lse(rows, self.pools, layer, batch))
            if s.host is not None:
                parts += s.host.attention_parts(self.pools, arena, rows, layer, n_q, scale)
            out[start : start + n_q] = merge_lse(parts)
            start += n_q
        return out

    def _resident(self, seq: int, what: str) -> _Seq:
        s = self._seq(seq)
        if s.base:
            raise UnsupportedError(
                f"{what} on sequence {seq}, whose first {s.base} tokens are offloaded to host memory: offloaded "
                "sequences take store, append_tokens, attention, seq_len and free_seq"
            )
        return s

    # -- eviction ------------------------------------------------------------------------------------

    def evict(self, seq: int, policy: Policy, keep_tokens: int) -> EvictionResult:
        """Shrink ``seq`` to at most ``keep_tokens`` positions chosen by ``policy``; the kept rows are
        moved byte for byte to positions 0.. (no re-quantization), whole blocks are freed, and
        blocks the kept prefix still shares stay shared. Returns what was kept and dropped."""
        s = self._resident(seq, "evict")
        if self.spec.uses_tail:
            raise UnsupportedError(
                "evict with an f16 tail (tail > 0 or a per-channel K format) is not supported yet: it would move rows "
                "between quantized pages and the tail"
            )
        if not isinstance(policy, Policy):
            raise SpecError(f"policy must be a kvhal.eviction policy (SinkWindow, H2O, SnapKV), got {policy!r}")
        if not _is_int(keep_tokens) or keep_tokens < 0:
            raise PositionError(f"keep_tokens must be an int >= 0, got {keep_tokens!r}")
        n = max(s.lens, default=0)
        kept = np.arange(n) if n <= keep_tokens else policy.select(n, int(keep_tokens), self._scores(s, n))
        return self._compact(int(seq), s, kept, policy.name, "evict")

    def _scores(self, s: _Seq, n: int) -> Scores:
        def total(d: dict[int, np.ndarray]) -> np.ndarray:
            out = np.zeros(n)
            for m in d.values():
                w = min(n, m.shape[1])
                out[:w] += m[:, :w].sum(axis=0)
            return out

        return Scores(total(s.mass), total(s.window_mass), self.observe_window, bool(s.mass))

    def _compact(self, sid: int, s: _Seq, kept: np.ndarray, policy: str, cause: str) -> EvictionResult:
        bs = self.spec.block_size
        n = max(s.lens, default=0)
        kept = np.asarray(kept, np.int64)
        moved = np.flatnonzero(kept != np.arange(len(kept)))
        first = int(moved[0]) if moved.size else len(kept)  # rows before this stay where they are
        new_lens = [int(np.searchsorted(kept, L)) for L in s.lens]
        n_keep = math.ceil(max(new_lens, default=0) / bs)
        touched = list(range(first // bs, n_keep)) if moved.size else []
        self._reserve(sum(self._ref[s.blocks[i]] > 1 for i in touched))
        free_before = self._blocks.n_free
        self._own(s, touched)
        for layer, L in enumerate(new_lens):
            if L > first:
                src = self._slots_at(s, kept[first:L])
                self.backend.copy_slots(self.pools, layer, src, self._slots(s, first, L))
        self._release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        s.lens = new_lens
        # token ids follow their rows; ids appended past the stored rows keep their order after them
        s.tokens = [s.tokens[p] for p in kept.tolist() if p < len(s.tokens)] + s.tokens[n:]
        del s.hashes[first // bs :]
        if moved.size:
            s.sealable = min(s.sealable if s.sealable is not None else first // bs, first // bs)
        s.keep_mass(kept)
        dropped = np.setdiff1d(np.arange(n), kept)
        freed = self._blocks.n_free - free_before
        if dropped.size:
            self._evicted[cause] += int(dropped.size)
            self._evicted["n"] += 1
        result = EvictionResult(sid, policy, cause, kept, dropped, freed, freed * self.spec.block_nbytes)
        if self.on_evict is not None and dropped.size:
            self.on_evict(result)
        return result

    def _make_room(self, needed: int, storing: _Seq) -> bool:
        """on_full=EvictOnFull: evict the longest sequence once; True if that freed anything."""
        if not isinstance(self.on_full, EvictOnFull) or not self._seqs:
            return False
        candidates = [(sid, x) for sid, x in self._seqs.items() if not x.base]
        if not candidates:
            return False
        sid, victim = max(candidates, key=lambda kv: (max(kv[1].lens, default=0), -kv[0]))
        n = max(victim.lens, default=0)
        keep = self.on_full.keep_tokens
        if n <= keep:
            return False
        kept = self.on_full.policy.select(n, keep, self._scores(victim, n))
        before = self._blocks.n_usable
        self._compact(sid, victim, kept, self.on_full.policy.name, "on_full")
        return self._blocks.n_usable > before

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

    def stats(self) -> CacheStats:
        spec = self.spec
        per_block_k = spec.n_layers * spec.n_kv_heads * spec.block_size * spec.k_row_bytes
        per_block_v = spec.n_layers * spec.n_kv_heads * spec.block_size * spec.v_row_bytes
        used = int((self._ref > 0).sum())
        c = self._blocks.counters
        return CacheStats(
            backend=self.backend.name,
            n_blocks=self.n_blocks,
            block_size=spec.block_size,
            blocks_used=used,
            blocks_free=self._blocks.n_free,
            blocks_shared=int((self._ref > 1).sum()),
            capacity_tokens=(self.n_blocks - len(self._arena)) * spec.block_size,
            n_seqs=len(self._seqs),
            tokens=sum(max(s.lens) for s in self._seqs.values()),
            k_format=spec.k_format,
            v_format=spec.v_format,
            k_bytes=per_block_k * self.n_blocks,
            v_bytes=per_block_v * self.n_blocks,
            bytes_allocated=self.pools.nbytes,
            bytes_per_token=spec.bytes_per_token,
            stream_arena_blocks=len(self._arena),
            offloaded_tokens=sum(x.base for x in self._seqs.values()),
            blocks_cached=len(self._blocks.hash_of),
            blocks_cached_free=self._blocks.n_cached_free,
            prefix_queries=c.queries,
            prefix_query_tokens=c.query_tokens,
            prefix_hit_tokens=c.hit_tokens,
            prefix_hit_blocks=c.hit_blocks,
            prefix_miss_blocks=c.miss_blocks,
            prefix_recomputed_tokens=c.recomputed_tokens,
            prefix_evicted_blocks=c.evicted_blocks,
            prefix_invalidated_blocks=c.invalidated_blocks,
            tier_hit_blocks=self._tier_counts["hit"],
            tier_written_blocks=self._tier_counts["written"],
            tier_unwritten_blocks=self._tier_counts["unwritten"],
            evictions=self._evicted["n"],
            evicted_tokens_called=self._evicted["evict"],
            evicted_tokens_on_full=self._evicted["on_full"],
            tail_tokens=sum(max(L - p for L, p in zip(x.lens, x.pages())) for x in self._seqs.values()),
            tail_bytes=sum(a.nbytes for x in self._seqs.values() for d in (x.tail_k, x.tail_v) for a in d.values()),
        )

    # -- internals -----------------------------------------------------------------------------------

    def _seq(self, seq: int) -> _Seq:
        s = self._seqs.get(int(seq)) if _is_int(seq) else None
        if s is None:
            what = f"{type(seq).__name__} {seq!r}" if not _is_int(seq) else repr(seq)
            raise SequenceError(
                f"no sequence {what} in this cache (live: {sorted(self._seqs)}); ids are the ints new_seq() returns"
            )
        return s

    def _layer(self, layer: int) -> int:
        if not _is_int(layer):
            raise PositionError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < self.spec.n_layers:
            raise PositionError(f"layer {layer!r} is out of range; the cache has layers 0..{self.spec.n_layers - 1}")
        return int(layer)

    @staticmethod
    def _position(p: Any, what: str, allow_none: bool = True) -> Any:
        if p is None and allow_none:
            return None
        if not _is_int(p):
            extra = " or None" if allow_none else ""
            raise PositionError(f"{what} must be an int{extra}, got {type(p).__name__} {p!r}")
        return int(p)

    @classmethod
    def _range(cls, p0: int, p1: int | None) -> tuple[int, int]:
        p0 = cls._position(p0, "p0", allow_none=False)
        p1 = cls._position(p1, "p1")
        lo = 0 if p0 < 0 else p0
        hi = 2**62 if p1 is None or p1 < 0 else p1
        if hi < lo:
            raise PositionError(f"range [{p0}, {p1}) is empty backwards; need p0 <= p1 (or p1 < 0 for the end)")
        return lo, hi

    def _slots_at(self, s: _Seq, pos: np.ndarray) -> np.ndarray:
        bs = self.spec.block_size
        return s.table()[pos // bs].astype(np.int64) * bs + pos % bs

    def _slots(self, s: _Seq, p0: int, p1: int) -> np.ndarray:
        pos = np.arange(p0, p1, dtype=np.int64)
        bs = self.spec.block_size
        return s.table()[pos // bs].astype(np.int64) * bs + pos % bs

    def _reserve(self, n: int | np.integer) -> None:
        self._blocks.reserve(n)

    def _own(self, s: _Seq, indices: list[int]) -> None:
        """Make the blocks at ``indices`` writable by ``s``: a shared block is copied first (blocks
        reserved), a block ``s`` holds alone loses its hash (its bytes are about to change)."""
        bs = self.spec.block_size
        for i in indices:
            old = s.blocks[i]
            if self._ref[old] <= 1:
                self._blocks.unhash(old)
                continue
            [new] = self._blocks.alloc(1)
            src = np.arange(old * bs, old * bs + bs, dtype=np.int64)
            dst = np.arange(new * bs, new * bs + bs, dtype=np.int64)
            for layer in range(self.spec.n_layers):
                self.backend.copy_slots(self.pools, layer, src, dst)
            self._blocks.release([old])
            s.blocks[i] = new
            s.changed()

    def _release(self, blocks: list[int]) -> None:
        self._blocks.release(blocks)


def _resolve_scale(value: Any, spec: CacheSpec) -> list[np.ndarray | None]:
    """A spec scale as per-layer, per-head float64 scales; None for a "calibrate" layer (fixed by its first
    store)."""
    if value == "calibrate":
        return [None] * spec.n_layers
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return [np.asarray(x, np.float64) for x in value]
    if value is None:
        per_head = np.ones(spec.n_kv_heads)
    elif isinstance(value, tuple):
        per_head = np.asarray(value, np.float64)
    else:
        per_head = np.full(spec.n_kv_heads, float(value))
    return [per_head.copy() for _ in range(spec.n_layers)]


def _token_ids(token_ids: Any) -> list[int]:
    """Token ids as plain ints in [0, 2**31): a list/tuple of ints or a 1-d integer array."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise ShapeError(f"token_ids must be a 1-d integer array, got {token_ids.dtype} of shape {token_ids.shape}")
        ids = token_ids.tolist()
    elif hasattr(token_ids, "__dlpack__") or type(token_ids).__module__.startswith("torch"):
        from .interop import to_numpy

        return _token_ids(to_numpy(token_ids))
    elif isinstance(token_ids, (list, tuple)):
        # plain ints (the common case) pass on one cheap type test; a bool's type is bool, not int
        if all(type(t) is int for t in token_ids):
            ids = list(token_ids)
        elif all(_is_int(t) for t in token_ids):
            ids = [int(t) for t in token_ids]
        else:
            bad = next(t for t in token_ids if not _is_int(t))
            raise ShapeError(f"token_ids must hold ints, got {type(bad).__name__} {bad!r}")
    else:
        raise ShapeError(f"token_ids must be a list of ints or a 1-d integer array, got {type(token_ids).__name__}")
    if ids and (min(ids) < 0 or max(ids) >= 2**31):
        raise ShapeError(f"token ids must be in [0, 2**31); got min {min(ids)}, max {max(ids)}")
    return ids
