"""``kvhal bench --lifecycle``: snapshot save/restore GB/s and the cost of a prefix hit against storing again.

One sequence of a Llama-8B-shaped cache (32 layers, 8 KV heads, head_dim 128) is prefilled, saved,
restored into a second cache (from the page cache: the file was just written) and matched by
``match_prefix``; medians of ``repeats`` runs after one warm-up run each.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import KVCache
from ..fingerprint import Fingerprint
from ..spec import CacheSpec

CHUNK = 512


def _median(fn: Any, repeats: int, reset: Any = None) -> float:
    times = []
    for i in range(repeats + 1):
        if reset is not None:
            reset()
        t = time.perf_counter()
        fn()
        if i:  # the first run warms up
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def run(
    backend: str = "auto",
    fmt: str = "q8_0",
    tokens: int = 16384,
    layers: int = 32,
    heads: int = 8,
    dim: int = 128,
    repeats: int = 3,
    directory: str | None = None,
) -> dict[str, Any]:
    spec = CacheSpec(n_layers=layers, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=fmt, block_size=16)
    fp = Fingerprint("kvhal-bench")
    src = KVCache(spec, tokens + CHUNK, backend=backend, fingerprint=fp)
    dst = KVCache(spec, tokens + CHUNK, backend=src.backend, fingerprint=fp)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32000, tokens).tolist()
    chunks = [rng.standard_normal((CHUNK, heads, dim), dtype=np.float32) for _ in range(4)]

    def prefill(cache: KVCache) -> int:
        s = cache.new_seq()
        cache.append_tokens(s, ids)
        for start in range(0, tokens, CHUNK):
            n = min(CHUNK, tokens - start)
            x = chunks[(start // CHUNK) % len(chunks)][:n]
            for layer in range(layers):
                cache.store(s, layer, x, x)
        cache.backend.synchronize()
        return s

    seqs: list[int] = []

    def reset_src() -> None:
        for s in list(src.seqs):
            src.free_seq(s)

    store_s = _median(lambda: seqs.append(prefill(src)), repeats, reset_src)
    s = src.seqs[0]
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "bench.kvs"
        save_s = _median(lambda: src.save(path, seqs=[s]), repeats)
        file_bytes = path.stat().st_size

        def reset_dst() -> None:
            for t in list(dst.seqs):
                dst.free_seq(t)

        restore_s = _median(lambda: dst.restore(path), repeats, reset_dst)
    kv_bytes = tokens * spec.bytes_per_token
    hits: list[int] = []

    def reset_hits() -> None:
        for t in [x for x in src.seqs if x != s]:
            src.free_seq(t)

    match_s = _median(lambda: hits.append(src.match_prefix([*ids, 1])[1]), max(repeats, 5), reset_hits)
    return {
        "backend": src.backend.name,
        "format": fmt,
        "tokens": tokens,
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": dim},
        "kv_bytes": kv_bytes,
        "file_bytes": file_bytes,
        "store_s": store_s,
        "save_s": save_s,
        "restore_s": restore_s,
        "save_gbps": file_bytes / save_s / 1e9,
        "restore_gbps": file_bytes / restore_s / 1e9,
        "prefix_hit_tokens": hits[-1],
        "prefix_hit_s": match_s,
        "prefix_hit_vs_store": match_s / store_s,
    }


def table(r: dict[str, Any]) -> str:
    sh = r["shape"]
    return "\n".join(
        [
            f"lifecycle: {r['backend']} {r['format']}, {r['tokens']} tokens of {sh['layers']} layers x "
            f"{sh['kv_heads']} KV heads x {sh['head_dim']} ({r['kv_bytes'] / 1e9:.2f} GB of K/V, file "
            f"{r['file_bytes'] / 1e9:.2f} GB); medians",
            f"  store (prefill all layers)   {r['store_s'] * 1e3:9.1f} ms",
            f"  save (fsynced)               {r['save_s'] * 1e3:9.1f} ms   {r['save_gbps']:.2f} GB/s",
            f"  restore (from page cache)    {r['restore_s'] * 1e3:9.1f} ms   {r['restore_gbps']:.2f} GB/s",
            f"  prefix hit ({r['prefix_hit_tokens']} tokens)      {r['prefix_hit_s'] * 1e3:9.3f} ms   "
            f"{r['prefix_hit_vs_store']:.2%} of storing them again",
        ]
    )
