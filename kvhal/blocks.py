"""The block allocator behind ``KVCache``: refcounts, free lists and the content-addressed prefix cache.

A block is *free* when no sequence holds it. A free block that carries a hash is still *cached*: its
bytes stay matchable by ``match_prefix`` until its space is reused. Allocation takes never-hashed
blocks first, then evicts cached blocks in LRU order of their release; a sequence releases its blocks
tail first, so a chain's tail is evicted before its head (vLLM's order).

Only immutable blocks carry a hash: ``unhash`` is called before any write into a block a sequence
owns alone, and shared blocks are copied first (copy-on-write), so a hash always names the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

import numpy as np

from .errors import CapacityError


@dataclass
class PrefixCounters:
    queries: int = 0  # match_prefix calls
    query_tokens: int = 0  # tokens asked for
    hit_tokens: int = 0  # tokens served from cached blocks
    hit_blocks: int = 0
    miss_blocks: int = 0  # full blocks of a query that were not cached
    recomputed_tokens: int = 0  # tokens of a query the caller must store again
    evicted_blocks: int = 0  # cached blocks whose space was reused (their hash dropped)
    invalidated_blocks: int = 0  # hashed blocks written in place by their only holder (hash dropped)


class BlockAllocator:
    def __init__(self, n_blocks: int, block_size: int, reuse_cached: bool = True) -> None:
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.ref = np.zeros(n_blocks, np.int32)
        self._plain = list(range(n_blocks - 1, -1, -1))  # never-hashed free blocks; pop() hands out 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but hashed, oldest release first
        self.hash_of: dict[int, bytes] = {}
        # one hash may name several blocks (two sequences filled the same prefix apart): evicting one
        # must not break the chain for the others
        self.block_of: dict[bytes, dict[int, None]] = {}
        self.counters = PrefixCounters()
        self.on_evict: Callable[[int, bytes], None] | None = None  # before a cached block's space is reused
        self.reuse_cached = reuse_cached  # False: allocation never takes a cached block (they stay matchable)

    @property
    def n_free(self) -> int:
        return len(self._plain) + len(self._cached)

    @property
    def n_usable(self) -> int:
        return len(self._plain) + (len(self._cached) if self.reuse_cached else 0)

    def reserve(self, n: int | np.integer) -> None:
        if n > self.n_usable:
            held = (
                ""
                if self.reuse_cached
                else f" ({len(self._cached)} more hold cached prefixes, kept by on_full='raise')"
            )
            raise CapacityError(
                f"need {int(n)} free blocks of {self.block_size} tokens but {self.n_usable} of {self.n_blocks} "
                f"are free{held}; free sequences (free_seq/seq_rm/evict) or create the cache with a larger "
                "capacity_tokens"
            )

    def alloc(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1 (reserve first: this evicts cached blocks as needed)."""
        self.reserve(n)
        if self.on_evict is not None:  # every victim first: one that raises (a closed tier) leaves all as it was
            for b in list(islice(self._cached, max(0, n - len(self._plain)))):
                self.on_evict(b, self.hash_of[b])
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                self._drop_hash(b)
                self.counters.evicted_blocks += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def acquire(self, b: int) -> None:
        """One more holder of ``b`` (a cached free block leaves the free lists)."""
        if self.ref[b] == 0:
            del self._cached[b]
        self.ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self._cached[b] = None
                else:
                    self._plain.append(b)

    # -- hashes ----------------------------------------------------------------------------------------

    def register(self, b: int, h: bytes) -> None:
        """Name block ``b`` by hash ``h`` (unless it already has a name: a block has one hash)."""
        if b not in self.hash_of:
            self.hash_of[b] = h
            self.block_of.setdefault(h, {})[b] = None

    def unhash(self, b: int) -> None:
        """``b`` is about to be written by its only holder: its bytes no longer match its hash."""
        if b in self.hash_of:
            self._drop_hash(b)
            self.counters.invalidated_blocks += 1

    def _drop_hash(self, b: int) -> None:
        h = self.hash_of.pop(b)
        named = self.block_of[h]
        del named[b]
        if not named:
            del self.block_of[h]

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Blocks of the longest run of ``hashes`` from the first that are cached."""
        out = []
        for h in hashes:
            named = self.block_of.get(h)
            if not named:
                break
            held = [b for b in named if self.ref[b] > 0]  # prefer a block in use: no cached block leaves the LRU
            out.append(held[0] if held else next(iter(named)))
        return out

    @property
    def n_cached_free(self) -> int:
        return len(self._cached)

    def cached_free_lru(self) -> list[int]:
        """Cached free blocks, next to be evicted first."""
        return list(self._cached)
