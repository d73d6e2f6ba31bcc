"""Sequences over the block allocator: page lists, slots, copy-on-write, fork, trim and compaction.

Pages ("blocks") of ``block_size`` tokens are shared by all layers: a sequence has one page list, and
layer ``l`` of block ``b`` lives in ``pools[l]``. Each layer keeps its own token count, since an engine
stores layer by layer. Blocks are refcounted: ``fork`` shares them and the next write into a shared block
copies it first (copy-on-write, byte for byte through ``Backend.copy_slots``).

Every method that changes blocks reserves every block it needs before it changes anything, so a call
that raises leaves the table as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backend import Backend, Pools
from .backend_util import blocks_to_pages
from .blocks import BlockAllocator
from .errors import SequenceError, UnsupportedError
from .spec import CacheSpec
from .validate import is_int


@dataclass
class Seq:
    """One sequence's state. Each component owns its fields: the table the page list and lengths, the
    prefix index ``tokens``/``hashes``/``sealable``, streaming ``base``/``host``, eviction the observed mass,
    the tail ``paged``/``tail_k``/``tail_v``."""

    blocks: list[int]
    lens: list[int]  # tokens stored per layer
    tokens: list[int] = field(default_factory=list)  # token ids of positions 0.. (append_tokens)
    hashes: list[bytes] = field(default_factory=list)  # chain of the leading full, fully stored blocks
    extra: bytes = bytes(32)  # digest of the sequence's extra keys (tenant, LoRA)
    # blocks at or past this index hold rows moved from other positions (a middle seq_rm, a copy
    # from an offset): they are not what a prefill of their tokens stores, so they never get a hash
    sealable: int | None = None
    # block streaming: the first ``base`` positions (whole blocks) live in host memory (streaming.py)
    base: int = 0
    host: Any = field(default=None, repr=False)  # a streaming.HostBlocks once offloaded
    # attention mass per layer (observe=True): [n_kv_heads, positions] float64, all queries / last window
    mass: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    window_mass: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # spec.uses_tail: per layer, tokens in the quantized pages (whole blocks); the rest sit in the f16 tail
    paged: list[int] | None = None
    tail_k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # layer -> f16 [t, H, D], stored form
    tail_v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # spec.sinks: per layer, the f16 rows of the first spec.sink_tokens positions (stored form), as stored
    sink_k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    sink_v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # per-head eviction: per layer, int64 ``[n_kv_heads, 2]``: KV head ``h`` does not attend ``[lo, hi)`` (the rows
    # it dropped, past its kept ones; the kernels mask them). Empty: every head attends every row.
    holes: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _table: np.ndarray | None = field(default=None, repr=False)

    def pages(self) -> list[int]:
        """Tokens per layer held in the pools (all of them unless the cache keeps an f16 tail)."""
        return self.lens if self.paged is None else self.paged

    def keep_mass(self, columns: np.ndarray) -> None:
        """Positions moved (removed, compacted): the observed mass follows its keys (ascending old positions)."""
        for d in (self.mass, self.window_mass):
            for layer, m in d.items():
                d[layer] = m[:, columns[columns < m.shape[1]]]

    def keep_mass_heads(self, kept: list[list[np.ndarray]], length: int) -> None:
        """A per-head compaction: each head's mass follows its own kept keys (zeros in the holes)."""
        for d in (self.mass, self.window_mass):
            for layer, m in d.items():
                new = np.zeros((m.shape[0], length))
                for h, cols in enumerate(kept[layer]):
                    cols = cols[cols < m.shape[1]]
                    new[h, : len(cols)] = m[h, cols]
                d[layer] = new

    def slice_mass(self, lo: int, hi: int) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Copies of the observed mass of positions ``[lo, hi)`` (a fork's own)."""
        return (
            {layer: m[:, lo:hi].copy() for layer, m in self.mass.items()},
            {layer: m[:, lo:hi].copy() for layer, m in self.window_mass.items()},
        )

    def table(self) -> np.ndarray:
        """``blocks`` as int32, kept between changes: a decode step would otherwise convert the whole
        list (~25 us at 2,048 pages, a tenth of a 4k-token step on the cpu backend)."""
        if self._table is None:
            self._table = np.asarray(self.blocks, np.int32)
        return self._table

    def changed(self) -> None:
        self._table = None


class SeqTable:
    """The live sequences and their page lists over one ``BlockAllocator`` and one backend's pools."""

    def __init__(self, spec: CacheSpec, backend: Backend, pools: Pools, allocator: BlockAllocator) -> None:
        self.spec, self.backend, self.pools, self.allocator = spec, backend, pools, allocator
        self.ref = allocator.ref
        self._seqs: dict[int, Seq] = {}
        self._next_id = 0

    # -- the registry --------------------------------------------------------------------------------

    def new(self, lens: list[int] | None = None, **fields: Any) -> Seq:
        """A sequence record (not yet added); a cache with an f16 tail tracks its paged lengths."""
        s = Seq(fields.pop("blocks", []), list(lens) if lens is not None else [0] * self.spec.n_layers, **fields)
        if self.spec.uses_tail and s.paged is None:
            s.paged = list(s.lens)
        return s

    def add(self, s: Seq) -> int:
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = s
        return sid

    def get(self, seq: Any) -> Seq:
        s = self._seqs.get(int(seq)) if is_int(seq) else None
        if s is None:
            what = f"{type(seq).__name__} {seq!r}" if not is_int(seq) else repr(seq)
            raise SequenceError(
                f"no sequence {what} in this cache (live: {sorted(self._seqs)}); ids are the ints new_seq() returns"
            )
        return s

    def resident(self, seq: Any, what: str) -> Seq:
        """``get``, refused for a sequence part of which is offloaded to host memory (``what`` names the call)."""
        s = self.get(seq)
        if s.base:
            raise UnsupportedError(
                f"{what} on sequence {seq}, whose first {s.base} tokens are offloaded to host memory: offloaded "
                "sequences take store, append_tokens, attention, seq_len and free_seq"
            )
        if s.holes:
            raise UnsupportedError(
                f"{what} on sequence {seq}, which a per-head eviction (AdaKV) compacted: its heads hold different "
                "positions, so it takes store, append_tokens, attention(observe too), seq_len and free_seq"
            )
        return s

    def remove(self, seq: int) -> None:
        s = self.get(seq)
        self.release(s.blocks[::-1])  # tail first: a chain's tail is evicted before its head
        del self._seqs[int(seq)]

    @property
    def ids(self) -> list[int]:
        return list(self._seqs)

    def items(self) -> Iterator[tuple[int, Seq]]:
        return iter(list(self._seqs.items()))

    def values(self) -> list[Seq]:
        return list(self._seqs.values())

    def __len__(self) -> int:
        return len(self._seqs)

    # -- slots and blocks ----------------------------------------------------------------------------

    def slots(self, s: Seq, p0: int, p1: int) -> np.ndarray:
        """The slots of resident positions ``[p0, p1)``."""
        return self.slots_at(s, np.arange(p0, p1, dtype=np.int64))

    def slots_at(self, s: Seq, pos: np.ndarray) -> np.ndarray:
        bs = self.spec.block_size
        return s.table()[pos // bs].astype(np.int64) * bs + pos % bs

    def reserve(self, n: int | np.integer) -> None:
        self.allocator.reserve(n)

    def release(self, blocks: list[int]) -> None:
        self.allocator.release(blocks)

    def shared(self, s: Seq, indices: list[int]) -> int:
        """How many of ``s``'s pages at ``indices`` are shared (each costs a block to write: copy-on-write)."""
        return sum(int(self.ref[s.blocks[i]] > 1) for i in indices)

    def own(self, s: Seq, indices: list[int]) -> None:
        """Make the pages at ``indices`` writable by ``s``: a shared block is copied first (blocks reserved),
        a block ``s`` holds alone loses its hash (its bytes are about to change)."""
        bs = self.spec.block_size
        for i in indices:
            old = s.blocks[i]
            if self.ref[old] <= 1:
                self.allocator.unhash(old)
                continue
            [new] = self.allocator.alloc(1)
            src = np.arange(old * bs, old * bs + bs, dtype=np.int64)
            dst = np.arange(new * bs, new * bs + bs, dtype=np.int64)
            for layer in range(self.spec.n_layers):
                self.backend.copy_slots(self.pools, layer, src, dst)
            self.allocator.release([old])
            s.blocks[i] = new
            s.changed()

    # -- writes --------------------------------------------------------------------------------------

    def write(
        self,
        s: Seq,
        layer: int,
        k: Any,
        v: Any,
        p0: int,
        make_room: Callable[[Seq, int, int], bool] | None = None,
        raw: bool = False,
    ) -> int:
        """Store rows ``k``/``v`` at resident positions ``p0..``: reserve (``make_room(s, layer, n)`` may first free
        blocks, all it needs or none, and compact this sequence too: the position is then read again), own,
        allocate, write; a failure gives the blocks back. Returns the resident end position. ``raw``: ``k``/``v``
        are stored rows already (host uint8 ``[n, n_kv_heads, row_bytes]``), written byte for byte."""
        bs, n = self.spec.block_size, len(k)
        if make_room is not None and self.blocks_needed(s.blocks, p0, p0 + n) > self.allocator.n_usable:
            if make_room(s, layer, n):
                p0 = s.lens[layer] - s.base
        p1 = p0 + n
        touched = list(range(p0 // bs, min(len(s.blocks), math.ceil(p1 / bs))))
        n_new = max(0, math.ceil(p1 / bs) - len(s.blocks))
        self.reserve(n_new + self.shared(s, touched))
        self.own(s, touched)
        added = self.allocator.alloc(n_new)
        if added:
            s.blocks.extend(added)
            s.changed()
        try:
            if raw:
                self.write_rows(layer, k, v, self.slots(s, p0, p1))
            else:
                self.backend.store(self.pools, layer, k, v, self.slots(s, p0, p1))
        except BaseException:
            self.release(added)
            if added:
                del s.blocks[len(s.blocks) - len(added) :]
                s.changed()
            raise
        return p1

    def write_rows(self, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        """Write stored rows byte for byte into ``slots`` at ``layer``, through raw block I/O (every backend
        has it): the touched blocks are read, patched at this layer and written back."""
        from .backend_util import blocks_to_pages

        bs = self.spec.block_size
        ids = np.unique(slots // bs)
        data = np.array(self.backend.read_blocks(self.pools, ids), np.uint8, copy=True)
        kp, vp = blocks_to_pages(self.spec, data)[layer]
        at = np.searchsorted(ids, slots // bs)
        kp[at, :, slots % bs, :] = k
        vp[at, :, slots % bs, :] = v
        self.backend.write_blocks(self.pools, ids, data)

    def read_rows(self, s: Seq, layer: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows of resident positions ``[p0, p1)`` at ``layer``: host uint8 ``[n, n_kv_heads,
        row_bytes]`` for K and V, read through raw block I/O."""
        from .backend_util import blocks_to_pages

        bs, n = self.spec.block_size, p1 - p0
        shape = (0, self.spec.n_kv_heads)
        if n <= 0:
            return (
                np.zeros((*shape, self.spec.k_row_bytes), np.uint8),
                np.zeros((*shape, self.spec.v_row_bytes), np.uint8),
            )
        first = p0 // bs
        ids = np.asarray(s.blocks[first : math.ceil(p1 / bs)], np.int64)
        kp, vp = blocks_to_pages(self.spec, self.backend.read_blocks(self.pools, ids))[layer]
        skip = p0 - first * bs
        k = kp.transpose(0, 2, 1, 3).reshape(-1, self.spec.n_kv_heads, self.spec.k_row_bytes)[skip : skip + n]
        v = vp.transpose(0, 2, 1, 3).reshape(-1, self.spec.n_kv_heads, self.spec.v_row_bytes)[skip : skip + n]
        return np.ascontiguousarray(k), np.ascontiguousarray(v)

    def blocks_needed(self, blocks: list[int], p0: int, p1: int, ref: Callable[[int], int] | None = None) -> int:
        """Free blocks a write of positions ``[p0, p1)`` into pages ``blocks`` takes: new pages plus a copy of each
        shared page it touches (``ref``: refcounts to read instead of the allocator's, for a plan)."""
        bs = self.spec.block_size
        count = ref if ref is not None else (lambda b: int(self.ref[b]))
        touched = range(p0 // bs, min(len(blocks), math.ceil(p1 / bs)))
        return max(0, math.ceil(p1 / bs) - len(blocks)) + sum(count(blocks[i]) > 1 for i in touched)

    def fork(self, s: Seq, lo: int, hi: int) -> Seq:
        """A new record of positions ``[lo, hi)`` of ``s``: whole pages shared when ``lo`` is page-aligned,
        rows copied otherwise (they move to other offsets). Token ids and observed mass come along; hashes
        only for a fork from position 0."""
        bs = self.spec.block_size
        lens = [max(0, min(hi, L) - min(lo, L)) for L in s.lens]
        n_blocks = math.ceil(max(lens, default=0) / bs)
        tokens = s.tokens[lo:hi]
        if lo % bs == 0:  # page-aligned: share
            blocks = s.blocks[lo // bs : lo // bs + n_blocks]
            for b in blocks:
                self.allocator.acquire(b)
            hashes = s.hashes[: min(len(tokens), min(lens)) // bs] if lo == 0 else []
            t = Seq(list(blocks), lens, tokens=tokens, hashes=hashes, extra=s.extra)
        else:
            t = Seq(self.allocator.alloc(n_blocks), lens, tokens=tokens, extra=s.extra)
            for layer, n in enumerate(lens):
                if n:
                    src = self.slots(s, lo, lo + n)
                    self.backend.copy_slots(self.pools, layer, src, self.slots(t, 0, n))
        t.sealable = s.sealable if lo == 0 else 0  # rows from an offset sit at other positions now
        t.mass, t.window_mass = s.slice_mass(lo, hi)
        return t

    def share_all(self, s: Seq) -> Seq:
        """A new record holding every page of ``s`` (shared), its lengths, tokens, hashes and mass; the f16
        tail arrays are shared too (tails are replaced, never written in place)."""
        for b in s.blocks:
            self.allocator.acquire(b)
        t = Seq(list(s.blocks), list(s.lens), tokens=list(s.tokens), hashes=list(s.hashes), extra=s.extra)
        t.paged = None if s.paged is None else list(s.paged)
        t.sealable = s.sealable
        t.tail_k, t.tail_v = dict(s.tail_k), dict(s.tail_v)
        t.sink_k, t.sink_v = dict(s.sink_k), dict(s.sink_v)
        t.mass, t.window_mass = s.slice_mass(0, 2**62)
        return t

    def remove_range(self, s: Seq, lo: int, hi: int) -> None:
        """Remove resident positions ``[lo, hi)``; later rows shift down byte for byte (llama.cpp's
        ``seq_rm`` then ``seq_add``). Hashes from the first touched block on are dropped."""
        bs = self.spec.block_size
        old_n = max(s.lens, default=0)
        new_lens = [L - max(0, min(hi, L) - min(lo, L)) for L in s.lens]
        moves = [(min(lo, L), min(hi, L), L) for L in s.lens]  # per layer: tokens [b, L) move to a
        shifting = [a < b < L for a, b, L in moves]
        # blocks written by a shift must be owned; count copies before touching anything
        n_keep = math.ceil(max(new_lens, default=0) / bs)
        first = min((a // bs for (a, b, L), sh in zip(moves, shifting) if sh), default=n_keep)
        touched = list(range(first, n_keep))
        self.reserve(self.shared(s, touched))
        self.own(s, touched)
        for layer, ((a, b, L), sh) in enumerate(zip(moves, shifting)):
            if sh:
                self.backend.copy_slots(self.pools, layer, self.slots(s, b, L), self.slots(s, a, a + L - b))
        s.lens = new_lens
        self.release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        del s.tokens[lo:hi]
        s.keep_mass(np.r_[np.arange(min(lo, old_n)), np.arange(min(hi, old_n), old_n)])
        del s.hashes[lo // bs :]
        if any(shifting):
            s.sealable = min(s.sealable if s.sealable is not None else lo // bs, lo // bs)

    def keep_rows(self, s: Seq, kept: np.ndarray) -> int:
        """Keep only positions ``kept`` (ascending) of ``s``, moved byte for byte to positions 0.. (no
        re-quantization); whole blocks past the end are freed, blocks the kept prefix shares stay shared.
        Returns the blocks freed."""
        bs = self.spec.block_size
        n = max(s.lens, default=0)
        moved = np.flatnonzero(kept != np.arange(len(kept)))
        first = int(moved[0]) if moved.size else len(kept)  # rows before this stay where they are
        new_lens = [int(np.searchsorted(kept, L)) for L in s.lens]
        n_keep = math.ceil(max(new_lens, default=0) / bs)
        touched = list(range(first // bs, n_keep)) if moved.size else []
        self.reserve(self.shared(s, touched))
        free_before = self.allocator.n_free
        self.own(s, touched)
        for layer, L in enumerate(new_lens):
            if L > first:
                src = self.slots_at(s, kept[first:L])
                self.backend.copy_slots(self.pools, layer, src, self.slots(s, first, L))
        self.release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        s.lens = new_lens
        self.relabel(s, kept, n, first)
        return self.allocator.n_free - free_before

    def relabel(self, s: Seq, kept: np.ndarray, n: int, first: int) -> None:
        """After a compaction that kept positions ``kept`` of ``n`` (rows moved from position ``first`` on): token ids
        and observed mass follow their rows, hashes from the first moved block on are dropped."""
        bs = self.spec.block_size
        # token ids follow their rows; ids appended past the stored rows keep their order after them
        s.tokens = [s.tokens[p] for p in kept.tolist() if p < len(s.tokens)] + s.tokens[n:]
        del s.hashes[first // bs :]
        if first < len(kept):
            s.sealable = min(s.sealable if s.sealable is not None else first // bs, first // bs)
        s.keep_mass(kept)

    def keep_heads(self, s: Seq, kept: list[list[np.ndarray]]) -> int:
        """Per-head compaction: KV head ``h`` of layer ``l`` keeps positions ``kept[l][h]`` (ascending), moved byte
        for byte to its positions 0.. inside the sequence's shared pages (through raw block I/O, every backend
        has it). Every layer's length becomes the longest kept set, ``K``; a head that kept fewer leaves a hole
        ``[len(kept[l][h]), K)`` that attention masks (``Seq.holes``). Pages past ``K`` are freed, pages before the
        first moved row stay shared. Every layer must hold the same rows (a whole prefill). Returns blocks freed."""
        bs, H = self.spec.block_size, self.spec.n_kv_heads
        n = max(s.lens, default=0)
        length = max(len(k) for heads in kept for k in heads)
        moved = [np.flatnonzero(k != np.arange(len(k))) for heads in kept for k in heads]
        first = min((int(m[0]) for m in moved if m.size), default=length)  # rows before this stay where they are
        n_keep = math.ceil(length / bs)
        touched = list(range(first // bs, n_keep))
        self.reserve(self.shared(s, touched))
        free_before = self.allocator.n_free
        self.own(s, touched)
        if touched:
            ids = np.asarray(s.blocks[first // bs : math.ceil(n / bs)], np.int64)
            old = self.backend.read_blocks(self.pools, ids)
            new = np.array(old[: len(touched)], np.uint8, copy=True)
            off = (first // bs) * bs
            for (ko, vo), (kn, vn), heads in zip(
                blocks_to_pages(self.spec, old), blocks_to_pages(self.spec, new), kept
            ):
                for src, dst in ((ko, kn), (vo, vn)):
                    rows = src.transpose(1, 0, 2, 3).reshape(H, -1, src.shape[-1])  # [H, positions from off, row]
                    out = dst.transpose(1, 0, 2, 3).reshape(H, -1, dst.shape[-1]).copy()
                    for h, k in enumerate(heads):  # new position i (>= off) takes old position k[i]
                        if len(k) > off:
                            out[h, : len(k) - off] = rows[h, k[off:] - off]
                    dst[...] = out.reshape(H, len(touched), bs, -1).transpose(1, 0, 2, 3)
            self.backend.write_blocks(self.pools, ids[: len(touched)], new)
        self.release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        s.lens = [length] * len(s.lens)
        self.relabel_heads(s, kept, n, length)
        return self.allocator.n_free - free_before

    @staticmethod
    def relabel_heads(s: Seq, kept: list[list[np.ndarray]], n: int, length: int) -> None:
        """After a per-head compaction of ``n`` positions to ``length`` (``kept[l][h]``: head ``h``'s old positions):
        each head's hole past its kept rows, its observed mass; no token ids or hashes (heads differ)."""
        s.holes = {layer: np.array([[len(k), length] for k in heads], np.int64) for layer, heads in enumerate(kept)}
        s.tokens = s.tokens[n:]  # the heads hold different positions: no one token id per position any more
        s.hashes.clear()
        s.sealable = 0
        s.keep_mass_heads(kept, length)

    def batch_table(self, seqs: list[Seq], n_pages: list[int]) -> np.ndarray:
        """The ``[n_seqs, max_pages]`` int32 block table (-1 padded) of the first ``n_pages`` of each."""
        if len(seqs) == 1:  # a view of the cached page list, no copy
            return seqs[0].table()[None, : n_pages[0]]
        table = np.full((len(seqs), max(n_pages)), -1, np.int32)
        for i, (s, nb) in enumerate(zip(seqs, n_pages)):
            table[i, :nb] = s.table()[:nb]
        return table
