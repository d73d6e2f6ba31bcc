"""``KVCache.stats()``: one frozen record of the cache's blocks, bytes, prefix cache, tiers and evictions,
read from the components that own each figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .backend import Backend, Pools
from .eviction import Evictor
from .prefix import PrefixIndex
from .seqs import SeqTable
from .streaming import Streamer


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
    bytes_held: int = 0  # what the sequences hold in the cache: blocks in use (all layers, arena not counted) + tails

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect(
    backend: Backend, pools: Pools, table: SeqTable, prefix: PrefixIndex, evictor: Evictor, streamer: Streamer
) -> CacheStats:
    spec, alloc, seqs = pools.spec, table.allocator, table.values()
    n_blocks, arena = pools.n_blocks, len(streamer.arena)
    per_block = spec.n_layers * spec.n_kv_heads * spec.block_size
    c, tiers, ev = alloc.counters, prefix.tier_counts, evictor.counts
    used = int((alloc.ref > 0).sum())
    tail_bytes = sum(a.nbytes for s in seqs for d in (s.tail_k, s.tail_v, s.sink_k, s.sink_v) for a in d.values())
    return CacheStats(
        backend=backend.name,
        n_blocks=n_blocks,
        block_size=spec.block_size,
        blocks_used=used,
        blocks_free=alloc.n_free,
        blocks_shared=int((alloc.ref > 1).sum()),
        capacity_tokens=(n_blocks - arena) * spec.block_size,
        n_seqs=len(seqs),
        tokens=sum(max(s.lens) for s in seqs),
        k_format=spec.k_format,
        v_format=spec.v_format,
        k_bytes=per_block * spec.k_row_bytes * n_blocks,
        v_bytes=per_block * spec.v_row_bytes * n_blocks,
        bytes_allocated=pools.nbytes,
        bytes_per_token=spec.bytes_per_token,
        stream_arena_blocks=arena,
        offloaded_tokens=sum(s.base for s in seqs),
        blocks_cached=len(alloc.hash_of),
        blocks_cached_free=alloc.n_cached_free,
        prefix_queries=c.queries,
        prefix_query_tokens=c.query_tokens,
        prefix_hit_tokens=c.hit_tokens,
        prefix_hit_blocks=c.hit_blocks,
        prefix_miss_blocks=c.miss_blocks,
        prefix_recomputed_tokens=c.recomputed_tokens,
        prefix_evicted_blocks=c.evicted_blocks,
        prefix_invalidated_blocks=c.invalidated_blocks,
        tier_hit_blocks=tiers["hit"],
        tier_written_blocks=tiers["written"],
        tier_unwritten_blocks=tiers["unwritten"],
        evictions=ev["n"],
        evicted_tokens_called=ev["evict"],
        evicted_tokens_on_full=ev["on_full"],
        tail_tokens=sum(max(L - p for L, p in zip(s.lens, s.pages())) for s in seqs),
        tail_bytes=tail_bytes,
        bytes_held=(used - arena) * spec.block_nbytes + tail_bytes,
    )
