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

from .backend import AttentionBatch
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
                parts.append(self.backend.attention_lse(rows, self.segments[i], layer, batch))
            else:
                assert self.raw is not None
                self.backend.write_blocks(pools, arena[:m].astype(np.int64), self.raw[c0 : c0 + m])
                batch = AttentionBatch(arena[None, :m], lens, ql, scale, causal=False)
                parts.append(self.backend.attention_lse(rows, pools, layer, batch))
        return parts
