"""``kvhal bench --streaming``: decode attention over a sequence far longer than the pools, its host part
streamed through a fixed arena, against the same sequence all resident, in one run.

The streamed cache has ``resident`` tokens of pools plus an ``arena``-token streaming arena; the sequence
is stored as it comes and moved out with ``offload(keep_tokens=resident)``, so its last ``resident``
tokens (whole blocks) stay in the pools and the rest sits in host memory: each decode step copies it
through the arena chunk by chunk (``write_blocks``) and merges the partial results by log-sum-exp, or, on a
backend whose pools are host memory (cpu, reference), attends over it in place, arena-sized piece by piece
(``kvhal.streaming``). The
all-resident cache holds the whole sequence. Both hold the same K/V (``bench.Workload``) and take the same
query; medians of ``repeats`` steps after a warm-up. ``copy`` times the arena copies alone (none in place),
next to the host read bandwidth measured in the same run (a copy reads every byte once and writes it once).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..cache import KVCache
from ..errors import SpecError
from ..progress import progress
from ..spec import CacheSpec
from .bench import HEAD_DIM, N_HEADS, N_KV_HEADS, STORE_CHUNK, Workload, cpu_model, median_time, read_bandwidth


def _positive(name: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise SpecError(f"{name} must be a positive int, got {x!r}")
    return x


def run(
    backend: str = "auto",
    fmt: str = "q4_0",
    tokens: int = 262144,
    arena: int = 16384,
    resident: int = 16384,
    repeats: int = 5,
    show_progress: bool = True,
) -> dict[str, Any]:
    for name, x in (("tokens", tokens), ("arena", arena), ("resident", resident), ("repeats", repeats)):
        _positive(name, x)
    if tokens <= resident:
        raise SpecError(f"tokens ({tokens}) must exceed resident ({resident}): nothing would be streamed")
    spec = CacheSpec(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, k_format=fmt, v_format=fmt)
    work = Workload.make(1)
    # room for one more store chunk before each offload
    small = KVCache(spec, resident + STORE_CHUNK + spec.block_size, backend=backend, stream_arena_tokens=arena)
    big = KVCache(spec, tokens, backend=small.backend)
    s, r = small.new_seq(), big.new_seq()
    steps = range(0, tokens, STORE_CHUNK)
    for start in progress(steps, len(steps), "kvhal bench --streaming: store", show_progress):
        m = min(STORE_CHUNK, tokens - start)
        for cache, seq in ((small, s), (big, r)):
            cache.store(seq, 0, work.k[:m], work.v[:m])
        small.offload(s, keep_tokens=resident)
    st = small.stats()
    q = small.backend.asarray(work.q_decode, "q")
    sync = small.backend.synchronize
    resident_s = median_time(lambda: big.attention(0, q, [r], [1]), sync, repeats)
    streamed_s = median_time(lambda: small.attention(0, q, [s], [1]), sync, repeats)

    # the arena copies alone: what the streamed step adds in data movement (none where the blocks are attended in place)
    host = small.streamer.host_blocks(s)
    assert host is not None
    arena_ids = np.asarray(small.streamer.arena, np.int64)
    raw = host.raw

    def copy() -> None:
        assert raw is not None
        for c0 in range(0, host.n, len(arena_ids)):
            n = min(len(arena_ids), host.n - c0)
            small.backend.write_blocks(small.pools, arena_ids[:n], raw[c0 : c0 + n])

    copy_s = None if host.in_place else median_time(copy, sync, repeats)
    bw = read_bandwidth(threads=getattr(small.backend, "threads", None))
    err = float(np.abs(small.attention(0, q, [s], [1]) - big.attention(0, q, [r], [1])).max())
    return {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "backend": small.backend.name,
        "threads": getattr(small.backend, "threads", None),
        "format": fmt,
        "tokens": tokens,
        "arena_tokens": st.stream_arena_blocks * spec.block_size,
        "resident_tokens": tokens - st.offloaded_tokens,
        "offloaded_tokens": st.offloaded_tokens,
        "arena_passes": -(-st.offloaded_tokens // (st.stream_arena_blocks * spec.block_size)),
        "shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM},
        "kv_bytes": tokens * spec.bytes_per_token,
        "device_bytes": small.pools.nbytes,
        "repeats": repeats,
        "resident_ms": resident_s * 1e3,
        "streamed_ms": streamed_s * 1e3,
        "ratio": streamed_s / resident_s,
        "in_place": host.in_place,
        "copy_ms": None if copy_s is None else copy_s * 1e3,
        "copy_gbps": None if copy_s is None else host.n * spec.block_nbytes / copy_s / 1e9,
        "read_bandwidth_gbps": bw / 1e9,
        "max_abs_diff": err,
    }


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    return "\n".join(
        [
            f"streaming: {r['backend']} {r['format']}, decode over {r['tokens']} tokens ({r['kv_bytes'] / 1e6:.0f} MB "
            f"of K/V; {r['shape']['n_heads']} q heads / {r['shape']['n_kv_heads']} kv heads / head_dim "
            f"{r['shape']['head_dim']}); {m['cpu']}, {m['cores']} cores, {r['threads']} threads, load average "
            + " ".join(f"{x:.2f}" for x in m["load_avg"]),
            f"  streamed: {r['resident_tokens']} tokens resident, {r['offloaded_tokens']} in host memory "
            + (
                f"attended in place in {r['arena_passes']} pieces of the {r['arena_tokens']}-token arena's size; "
                if r["in_place"]
                else f"through a {r['arena_tokens']}-token arena ({r['arena_passes']} passes); "
            )
            + f"pools {r['device_bytes'] / 1e6:.0f} MB; "
            f"median of {r['repeats']}",
            f"  all resident      {r['resident_ms']:9.2f} ms",
            f"  streamed          {r['streamed_ms']:9.2f} ms   {r['ratio']:.2f}x all resident",
            f"  of which copies   {r['copy_ms']:9.2f} ms   {r['copy_gbps']:.1f} GB/s into the arena (host read bandwidth "
            f"{r['read_bandwidth_gbps']:.1f} GB/s)"
            if r["copy_ms"] is not None
            else f"  no copies: the pools are host memory, the host blocks are attended in place (host read bandwidth "
            f"{r['read_bandwidth_gbps']:.1f} GB/s)",
            f"  max |streamed - all resident| {r['max_abs_diff']:.2e}",
        ]
    )
