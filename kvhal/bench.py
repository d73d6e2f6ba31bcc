"""kvhal bench: store, load and decode attention per backend and format, against memory bandwidth and SDPA.

Every figure is a median of ``repeats`` timed runs after a warm-up, measured in one process so the
ratios (fraction of read bandwidth, speed-up over PyTorch SDPA) compare like with like on a noisy
machine. Attention GB/s counts the bytes of K and V the step must read in the cache's format.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import formats
from .cache import KVCache
from .progress import progress
from .spec import CacheSpec

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_CHUNK = 512


@dataclass
class Row:
    backend: str
    format: str  # KV format, or the SDPA dtype for baseline rows
    op: str  # store-1 | store-512 | load | attention
    context: int
    median_ms: float
    gbps: float  # bytes moved per second / 1e9 (see module doc)
    frac_bw: float  # gbps / measured read bandwidth
    tokens_per_s: float | None = None
    speedup_vs_sdpa_f32: float | None = None
    speedup_vs_sdpa_bf16: float | None = None


WARMUP_S = 0.02  # steady state, as in a decode loop: pools awake, clocks up, caches warm


def median_time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    # one warm-up call left the first timed calls of a figure ~25% slow on a VM (a thread pool that
    # slept through the previous figure, clocks ramping): warm up for at least 3 calls and WARMUP_S
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < WARMUP_S:
        fn()
        sync()
        calls += 1
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's marketing name (platform.processor() is only "x86_64" on Linux)."""
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 9, threads: int | None = None) -> float:
    """Host read bandwidth in bytes/s: numpy sums over disjoint chunks, one thread per core (reductions drop the GIL)."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(nbytes // 8, np.int64)
    chunks = np.array_split(data, threads)

    def run() -> None:
        workers = [threading.Thread(target=np.add.reduce, args=(c,)) for c in chunks]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    return data.nbytes / median_time(run, lambda: None, repeats)


def _sdpa(contexts: list[int], repeats: int, rng: np.random.Generator) -> dict[tuple[str, int], float] | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    out = {}
    for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for n in contexts:
            q = torch.from_numpy(rng.standard_normal((1, N_HEADS, 1, HEAD_DIM), dtype=np.float32)).to(dtype)
            k = torch.from_numpy(rng.standard_normal((1, N_KV_HEADS, n, HEAD_DIM), dtype=np.float32)).to(dtype)
            v = torch.from_numpy(rng.standard_normal((1, N_KV_HEADS, n, HEAD_DIM), dtype=np.float32)).to(dtype)

            def step(q: Any = q, k: Any = k, v: Any = v) -> None:
                with torch.inference_mode():
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            out[(dtype_name, n)] = median_time(step, lambda: None, repeats)
    return out


def run(
    jobs: list[tuple[str, str]],
    contexts: list[int],
    repeats: int = 5,
    show_progress: bool = True,
    sdpa: bool = True,
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    bw = read_bandwidth()
    rows: list[Row] = []
    base = _sdpa(contexts, repeats, rng) if sdpa else None
    if base:
        for (dt, n), t in base.items():
            kv_bytes = 2 * n * N_KV_HEADS * HEAD_DIM * (4 if dt == "f32" else 2)
            rows.append(Row("torch-sdpa", dt, "attention", n, t * 1e3, kv_bytes / t / 1e9, kv_bytes / t / bw))
    for backend, fmt in progress(jobs, len(jobs), "kvhal bench", show_progress):
        rows.extend(_bench_one(backend, fmt, contexts, repeats, rng, bw, base))
    import platform

    return {
        "machine": {
            "cpu": cpu_model(),
            "arch": platform.machine(),
            "cores": os.cpu_count(),
            "read_bandwidth_gbps": bw / 1e9,
            "python": platform.python_version(),
        },
        "shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "q_len": 1},
        "repeats": repeats,
        "rows": [asdict(r) for r in rows],
    }


def _bench_one(
    backend: str,
    fmt: str,
    contexts: list[int],
    repeats: int,
    rng: np.random.Generator,
    bw: float,
    base: dict[tuple[str, int], float] | None,
) -> list[Row]:
    spec = CacheSpec(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, k_format=fmt, v_format=fmt)
    top = max(contexts)
    cache = KVCache(spec, top + PREFILL_CHUNK + 16, backend=backend)
    name, sync = cache.backend.name, cache.backend.synchronize
    row_bytes = formats.get(fmt).row_bytes(HEAD_DIM) * N_KV_HEADS * 2  # K+V bytes per token
    f32_bytes = N_KV_HEADS * HEAD_DIM * 4 * 2
    out = []
    chunk = [rng.standard_normal((PREFILL_CHUNK, N_KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2)]
    one = [c[:1].copy() for c in chunk]
    for label, kv, n in (("store-1", one, 1), ("store-512", chunk, PREFILL_CHUNK)):
        scratch = cache.new_seq()

        def store(kv: list[np.ndarray] = kv, s: int = scratch) -> None:
            cache.store(s, 0, kv[0], kv[1])
            cache.seq_rm(s, 0, -1)

        t = median_time(store, sync, repeats)
        out.append(Row(name, fmt, label, n, t * 1e3, n * f32_bytes / t / 1e9, n * f32_bytes / t / bw, n / t))
        cache.free_seq(scratch)
    s = cache.new_seq()
    q = rng.standard_normal((1, N_HEADS, HEAD_DIM), dtype=np.float32)
    for n in sorted(contexts):
        while cache.seq_len(s) < n:
            m = min(PREFILL_CHUNK, n - cache.seq_len(s))
            cache.store(s, 0, chunk[0][:m], chunk[1][:m])
        t = median_time(lambda: cache.load(s, 0), sync, repeats)
        out.append(Row(name, fmt, "load", n, t * 1e3, n * row_bytes / t / 1e9, n * row_bytes / t / bw, n / t))
        t = median_time(lambda: cache.attention(0, q, [s], [1]), sync, repeats)
        r = Row(name, fmt, "attention", n, t * 1e3, n * row_bytes / t / 1e9, n * row_bytes / t / bw)
        if base:
            r.speedup_vs_sdpa_f32 = base[("f32", n)] / t
            r.speedup_vs_sdpa_bf16 = base[("bf16", n)] / t
        out.append(r)
    return out


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, measured read bandwidth {m['read_bandwidth_gbps']:.1f} GB/s; "
        f"shape: {N_HEADS} q heads / {N_KV_HEADS} kv heads / head_dim {HEAD_DIM}; median of {result['repeats']}",
        f"{'backend':<11} {'format':<6} {'op':<10} {'ctx':>6} {'ms':>9} {'GB/s':>7} {'of bw':>6} "
        f"{'tok/s':>10} {'x sdpa f32':>10} {'x sdpa bf16':>11}",
    ]
    for r in result["rows"]:

        def opt(x: float | None, fmt: str) -> str:
            return format(x, fmt) if x is not None else "-"

        lines.append(
            f"{r['backend']:<11} {r['format']:<6} {r['op']:<10} {r['context']:>6} {r['median_ms']:>9.3f} "
            f"{r['gbps']:>7.2f} {r['frac_bw']:>6.2f} {opt(r['tokens_per_s'], '.3g'):>10} "
            f"{opt(r['speedup_vs_sdpa_f32'], '.2f'):>10} {opt(r['speedup_vs_sdpa_bf16'], '.2f'):>11}"
        )
    return "\n".join(lines)
