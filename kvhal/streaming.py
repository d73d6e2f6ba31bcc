"""Where an offloaded sequence's blocks live in host memory, and how attention reaches them.

Two layouts, chosen per cache from where its pools live:

- pools in device memory (torch on a GPU, CuPy, ...): the raw block layout (``read_blocks``) in one growing host
  array; each attention call writes it into the cache's streaming arena one arena-full at a time and attends
  over each chunk.
- pools in host memory already (numpy arrays: the cpu and reference backends): the blocks are kept as host pools
  of the arena's size, allocated by the backend itself, and attention runs over each of them in place. There the
  arena copy would move every byte from one host buffer to another before reading it: on the cpu backend it was
  as long as the attention (a 256k-token q4_0 decode: 21 of 49 ms). Same passes, same merge, same memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import AttentionBatch, Backend, Pools
from .backend_util import merge_lse
from .errors import CapacityError, SpecError, UnsupportedError
from .seqs import Seq, SeqTable
from .spec import CacheSpec


def pools_in_host_memory(pools: Any) -> bool:
    """Whether every K and V pool of ``pools`` is a numpy array (the backend keeps the cache in host memory)."""
    return all(isinstance(a, np.ndarray) for a in list(pools.k) + list(pools.v))


class HostBlocks:
    """The offloaded blocks of one sequence, in order: ``n`` blocks (whole blocks, every layer)."""

    def __init__(self, backend: Any, spec: CacheSpec, arena_blocks: int, in_place: bool) -> None:
        self.backend, self.spec, self.arena_blocks, self.in_place = backend, spec, arena_blocks, in_place
        self.n = 0
        self.raw: np.ndarray | None = None  # copy layout: rows [0, n) hold blocks, room to grow
        self.segments: list[Any] = []  # in-place layout: backend pools of arena_blocks blocks each

    @classmethod
    def for_pools(cls, backend: Any, pools: Any, arena_blocks: int) -> HostBlocks:
        """The layout ``pools`` call for: in place where they are host memory, else through the arena."""
        return cls(backend, pools.spec, arena_blocks, pools_in_host_memory(pools))

    def append(self, data: np.ndarray) -> None:
        """Add blocks (raw block layout, as ``read_blocks`` returns them) after those held."""
        n_new = len(data)
        if not self.in_place:
            if self.raw is None or self.n + n_new > len(self.raw):  # grow by doubling: appends stay linear
                grown = np.empty((max(2 * self.n, self.n + n_new), self.spec.block_nbytes), np.uint8)
                if self.raw is not None:
                    grown[: self.n] = self.raw[: self.n]
                self.raw = grown
            self.raw[self.n : self.n + n_new] = data
            self.n += n_new
            return
        n0, held = self.n, len(self.segments)
        try:
            done = 0
            while done < n_new:
                at = self.n % self.arena_blocks
                if at == 0:
                    self.segments.append(self.backend.allocate(self.spec, self.arena_blocks))
                m = min(self.arena_blocks - at, n_new - done)
                ids = np.arange(at, at + m, dtype=np.int64)
                self.backend.write_blocks(self.segments[-1], ids, data[done : done + m])
                done += m
                self.n += m
        except BaseException:  # all or nothing: a later offload must not find some of these blocks held
            self.n = n0
            del self.segments[held:]
            raise

    def attention_parts(
        self, pools: Any, arena: np.ndarray, rows: Any, layer: int, n_q: int, scale: float
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``attention_lse`` of ``rows`` over every held block, one part per arena-full (no mask: every held key
        precedes every query), through the cache's ``arena`` blocks of ``pools`` or in place."""
        bs, parts = self.spec.block_size, []
        ql = np.array([n_q], np.int32)
        for i, c0 in enumerate(range(0, self.n, self.arena_blocks)):
            m = min(self.arena_blocks, self.n - c0)
            lens = np.array([m * bs], np.int32)
            if self.in_place:
                batch = AttentionBatch(np.arange(m, dtype=np.int32)[None], lens, ql, scale, causal=False)
                segment = self.segments[i]
                segment.side, segment.v_side = pools.side, pools.v_side  # a kltq format's side data: the cache's
                parts.append(self.backend.attention_lse(rows, segment, layer, batch))
            else:
                assert self.raw is not None
                self.backend.write_blocks(pools, arena[:m].astype(np.int64), self.raw[c0 : c0 + m])
                batch = AttentionBatch(arena[None, :m], lens, ql, scale, causal=False)
                parts.append(self.backend.attention_lse(rows, pools, layer, batch))
        return parts


class Streamer:
    """Block streaming for one cache: ``offload`` moves a sequence's leading whole blocks to host memory, and
    attention over it merges the resident part (the backend's kernel) with each arena-full of host blocks."""

    def __init__(self, spec: CacheSpec, backend: Backend, pools: Pools, table: SeqTable, arena: list[int]) -> None:
        self.spec, self.backend, self.pools, self.table = spec, backend, pools, table
        self.arena = arena  # device blocks set aside for the host part, never released

    def host_blocks(self, seq: int) -> HostBlocks | None:
        """The host-resident blocks of sequence ``seq`` (None while none were offloaded)."""
        return self.table.get(seq).host

    def offload(self, s: Seq, keep_tokens: int) -> int:
        """Move ``s``'s leading whole blocks to host memory, keeping at least its last ``keep_tokens`` (and every
        block not yet stored at all layers) in the pools; returns the tokens moved."""
        if self.spec.uses_tail:
            raise UnsupportedError("offload with an f16 tail (tail > 0 or a per-channel K format) is not supported yet")
        if not self.arena:
            raise SpecError("offload needs a streaming arena: create the cache with stream_arena_tokens > 0")
        bs = self.spec.block_size
        n_move = max(0, min(s.lens) - s.base - keep_tokens) // bs
        if n_move == 0:
            return 0
        moved = s.blocks[:n_move]
        data = self.backend.read_blocks(self.pools, np.asarray(moved, np.int64))
        host = s.host if s.host is not None else HostBlocks.for_pools(self.backend, self.pools, len(self.arena))
        try:
            host.append(data)
        except MemoryError as e:
            raise CapacityError(
                f"offload of {n_move} blocks ({n_move * self.spec.block_nbytes} bytes) found no host memory for them "
                f"({e}); free sequences or offload with a larger keep_tokens"
            ) from None
        s.host = host
        del s.blocks[:n_move]
        s.changed()
        s.base += n_move * bs
        self.table.release(moved[::-1])
        return n_move * bs

    def attention(
        self, layer: int, q: Any, seqs: list[Seq], q_lens: list[int], scale: float, causal: bool
    ) -> np.ndarray:
        bs, arena = self.spec.block_size, np.asarray(self.arena, np.int32)
        qh = self.backend.to_numpy(q)
        out = np.empty(qh.shape, np.float32)
        start = 0
        for s, n_q in zip(seqs, q_lens):
            rows = qh[start : start + n_q]
            tail = s.lens[layer] - s.base
            parts = []
            if tail:
                lens, ql = np.array([tail], np.int32), np.array([n_q], np.int32)
                # a resident sequence a per-head eviction compacted, batched with an offloaded one: its masked rows
                holes = s.holes[layer][None].astype(np.int32) if s.holes else None
                batch = AttentionBatch(s.table()[None, : -(-tail // bs)], lens, ql, scale, causal, holes=holes)
                parts.append(self.backend.attention_lse(rows, self.pools, layer, batch))
            if s.host is not None:
                parts += s.host.attention_parts(self.pools, arena, rows, layer, n_q, scale)
            out[start : start + n_q] = merge_lse(parts)[0]
            start += n_q
        return out
