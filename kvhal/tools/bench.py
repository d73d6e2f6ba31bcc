"""kvhal bench: store, load, decode and prefill attention per backend and format, against bandwidth and SDPA.

Every figure is a median of ``repeats`` timed runs after a warm-up, measured in one process so the
ratios (fraction of read bandwidth, speed-up over PyTorch SDPA) compare like with like on a noisy
machine. GB/s counts the bytes of K and V a call must read in the cache's format (store: the f32
input). The bandwidth is measured in the same run where the cache lives: host memory with the same
thread count for host backends, device memory (HBM) through cupy for cuda/rocm.

SDPA runs on the same K/V values and queries, f32 and bf16 dense, on the torch device that matches
the backend (CPU for host backends, torch's CUDA device for cuda/rocm when torch has one).
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import formats
from ..cache import KVCache
from ..errors import SpecError
from ..progress import progress
from ..spec import CacheSpec

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
STORE_CHUNK = 512  # tokens per store call while filling (and the store-512 figure)
PREFILL_QUERIES = 512
DEVICE_BACKENDS = {"cuda", "rocm"}  # their pools live in device memory, reached through cupy


@dataclass
class Row:
    backend: str
    format: str  # KV format, or the SDPA dtype for baseline rows
    op: str  # store-1 | store-512 | load | load-out | load-bf16 | decode | prefill
    context: int
    median_ms: float
    gbps: float  # bytes moved per second / 1e9 (see module doc)
    frac_bw: float  # gbps / the read bandwidth measured where the data lives
    # loads: (bytes read + output bytes written) per second / the read bandwidth: how much of the memory system the
    # call uses, where frac_bw counts only the format's bytes (an output of dense K/V outweighs those several times)
    frac_moved: float | None = None
    tokens_per_s: float | None = None
    gflops: float | None = None  # attention FLOP/s / 1e9 (prefill)
    speedup_vs_sdpa_f32: float | None = None
    speedup_vs_sdpa_bf16: float | None = None
    threads: int | None = None  # host threads the figure ran with; None: not a host-threaded run
    # decode at the largest context only: the median of calls taken in turn with the other formats of the
    # same backend and threads (round-robin, one call each), so their ratios share the machine's moments
    alternating_ms: float | None = None
    # the kernels an attention figure ran, where the backend says (``attention_path``: the cpu backend's
    # amx-bf16, avx512-vnni, avx512-fma, avx2-gemm, avx2, neon, scalar); SDPA rows: torch-<dtype>
    path: str | None = None


WARMUP_S = 0.02  # steady state, as in a decode loop: pools awake, clocks up, caches warm


def median_time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    # one warm-up call left the first timed calls of a figure ~25% slow on a VM (a thread pool that
    # slept through the previous figure, clocks ramping): warm up for 3 calls and WARMUP_S, or for
    # 1 s when calls are that long (prefill at 16k)
    start, calls = time.perf_counter(), 0
    while (calls < 3 and time.perf_counter() - start < 1.0) or time.perf_counter() - start < WARMUP_S:
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


def alternating_times(fns: Sequence[Callable[[], Any]], sync: Callable[[], None], rounds: int) -> list[float]:
    """Median time of each of ``fns`` over ``rounds`` rounds, each round calling every one once in turn
    (after three warm-up rounds): load that comes and goes on the machine falls on all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds + 3):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            sync()
            if r >= 3:
                ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


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
    """Host read bandwidth in bytes/s: numpy sums over disjoint chunks, one thread each (reductions drop the GIL)."""
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


_READ_KERNEL = r"""
extern "C" __global__ void kvhal_bench_read(const float4* __restrict__ x, long long n, float* __restrict__ out) {
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    float acc = 0.f;
    long long i = tid;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight per thread
        float4 a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
        acc += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w) + (c.x + c.y + c.z + c.w) + (d.x + d.y + d.z + d.w);
    }
    for (; i < n; i += stride) { float4 a = x[i]; acc += a.x + a.y + a.z + a.w; }
    out[tid] = acc;  // one store per thread keeps the loads live
}
"""


def device_read_bandwidth(device: int = 0, nbytes: int = 1 << 30, repeats: int = 9) -> tuple[float, str]:
    """(bytes/s, device name): a streaming read of ``nbytes`` on a CUDA/ROCm device, timed with device events."""
    import cupy  # the SDK, imported only when a device backend is benchmarked

    with cupy.cuda.Device(device) as dev:
        props = cupy.cuda.runtime.getDeviceProperties(device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        free = cupy.cuda.runtime.memGetInfo()[0]
        nbytes = min(nbytes, free // 4) // 16 * 16
        x = cupy.ones(nbytes // 4, cupy.float32)
        threads, blocks = 256, 8 * int(props["multiProcessorCount"])
        out = cupy.empty(threads * blocks, cupy.float32)
        kernel = cupy.RawKernel(_READ_KERNEL, "kvhal_bench_read")
        args = (x, np.int64(nbytes // 16), out)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for i in range(repeats + 2):  # two warm-up launches
            start.record()
            kernel((blocks,), (threads,), args)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        dev.synchronize()
    return nbytes / statistics.median(times), f"{'cuda' if not cupy.cuda.runtime.is_hip else 'rocm'}:{device} {name}"


@dataclass
class Workload:
    """The K/V the caches hold and the queries, shared by every backend and by SDPA."""

    k: np.ndarray  # [STORE_CHUNK, n_kv_heads, head_dim]; a context of n tokens repeats it
    v: np.ndarray
    q_decode: np.ndarray  # [1, n_heads, head_dim]
    q_prefill: np.ndarray  # [prefill_queries, n_heads, head_dim]

    @classmethod
    def make(cls, prefill_queries: int, seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        k, v = (rng.standard_normal((STORE_CHUNK, N_KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2))
        q1 = rng.standard_normal((1, N_HEADS, HEAD_DIM), dtype=np.float32)
        qp = rng.standard_normal((prefill_queries, N_HEADS, HEAD_DIM), dtype=np.float32)
        return cls(k, v, q1, qp)

    def kv(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` tokens' K and V, as the cache stores them."""
        reps = -(-n // STORE_CHUNK)
        return np.tile(self.k, (reps, 1, 1))[:n], np.tile(self.v, (reps, 1, 1))[:n]

    def fill(self, cache: KVCache, seq: int, n: int) -> None:
        while cache.seq_len(seq) < n:
            m = min(STORE_CHUNK, n - cache.seq_len(seq))
            cache.store(seq, 0, self.k[:m], self.v[:m])


def prefill_flops(context: int, n_q: int) -> float:
    """FLOPs of causal attention of the last ``n_q`` positions over ``context`` tokens (QK and PV, 2 per MAC)."""
    visible = n_q * (context - n_q) + n_q * (n_q + 1) // 2
    return 4.0 * N_HEADS * HEAD_DIM * visible


def sdpa_call(torch: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: Any, device: str) -> Callable[[], Any]:
    """PyTorch SDPA of ``q [n_q, H, D]`` over ``k, v [n, H_kv, D]`` with kvhal's causal rule; returns the call.

    Query i sits at position ``n - n_q + i`` (bottom-right causal): SDPA's ``is_causal`` aligns top-left
    when n_q < n, so the mask is explicit.
    """
    import torch.nn.functional as F

    def t(x: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None].to(device=device, dtype=dtype)

    qt, kt, vt = t(q), t(k), t(v)
    n_q, n = q.shape[0], k.shape[0]
    mask = None
    if n_q > 1:
        rows = torch.arange(n_q, device=device)[:, None] + (n - n_q)
        mask = torch.arange(n, device=device)[None, :] <= rows

    def step() -> Any:
        with torch.inference_mode():
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)

    return step


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _sdpa_rows(
    torch: Any,
    device: str,
    work: Workload,
    decode: Sequence[int],
    prefill: Sequence[int],
    repeats: int,
    bw: float,
    threads: int | None,
) -> tuple[list[Row], dict[tuple[str, str, int], float]]:
    """SDPA figures on ``device`` and the times ratios are taken against, keyed (dtype, op, context)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    label = "torch-sdpa" if device == "cpu" else f"torch-sdpa-{device}"
    rows, times = [], {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    ran = torch.get_num_threads() if device == "cpu" else None
    try:
        for dt_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            for op, contexts, q in (("decode", decode, work.q_decode), ("prefill", prefill, work.q_prefill)):
                for n in contexts:
                    k, v = work.kv(n)
                    t = median_time(sdpa_call(torch, q, k, v, dtype, device), sync, repeats)
                    times[(dt_name, op, n)] = t
                    kv_bytes = 2 * n * N_KV_HEADS * HEAD_DIM * (4 if dt_name == "f32" else 2)
                    r = Row(label, dt_name, op, n, t * 1e3, kv_bytes / t / 1e9, kv_bytes / t / bw, threads=ran)
                    r.path = f"torch-{dt_name}"
                    if op == "prefill":
                        r.tokens_per_s = q.shape[0] / t
                        r.gflops = prefill_flops(n, q.shape[0]) / t / 1e9
                    rows.append(r)
    finally:
        torch.set_num_threads(previous)
    return rows, times


def _takes_threads(backend: str) -> bool:
    """Whether ``backend`` has a ``threads`` option (the cpu backend); a one-block cache asks it."""
    spec = CacheSpec(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, k_format="f32", v_format="f32")
    return hasattr(KVCache(spec, 1, backend=backend).backend, "threads")


def job_format(backend: str, fmt: str) -> str:
    """``fmt`` as a bench job on ``backend``: itself (one format, or a ``K/V`` pair), or ``f16/fmt`` where the
    backend runs a per-channel K format's per-token rows only (as V), so its V path is what is measured."""
    if "/" not in fmt and formats.get(fmt).side_data:  # a K format only (kltq): V in q8_0
        return f"{fmt}/q8_0"
    if "/" in fmt or formats.get(fmt).k_page is None:
        return fmt
    from ..registry import instance

    spec = CacheSpec(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, k_format=fmt, v_format=fmt)
    return fmt if instance(backend).supports(spec, "attention") is None else f"f16/{fmt}"


def _positive_ints(name: str, values: Any) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise SpecError(f"{name} must be a list of positive ints, got {values!r}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise SpecError(f"{name} must hold positive ints, got {x!r} in {list(values)!r}")
    return list(dict.fromkeys(values))  # in order, once each


def run(
    jobs: Sequence[tuple[str, str]],
    contexts: Sequence[int],
    repeats: int = 5,
    show_progress: bool = True,
    sdpa: bool = True,
    *,
    prefill_contexts: Sequence[int] = (4096, 16384),
    prefill_queries: int = PREFILL_QUERIES,
    threads: Sequence[int] | None = None,
    bandwidth_bytes: int = 1 << 29,
) -> dict[str, Any]:
    """Benchmark each ``(backend, format)`` job; returns the JSON-able result ``table()`` prints.

    ``contexts``: decode context lengths; ``prefill_contexts``: contexts the last ``prefill_queries``
    positions attend over (causal); ``threads``: re-run every figure at each host thread count (backends
    that take a ``threads`` option, and torch); None runs once with each backend's default.
    """
    if isinstance(jobs, (str, bytes)) or not all(
        isinstance(j, tuple) and len(j) == 2 and all(isinstance(x, str) for x in j) for j in jobs
    ):
        raise SpecError(f"jobs must be a list of (backend, format) name pairs, got {jobs!r}")
    decode = sorted(_positive_ints("contexts", contexts))
    prefill = sorted(_positive_ints("prefill_contexts", prefill_contexts))
    (prefill_queries,) = _positive_ints("prefill_queries", [prefill_queries])
    (repeats,) = _positive_ints("repeats", [repeats])
    sweep: list[int | None] = [*_positive_ints("threads", threads)] if threads is not None else [None]
    if not sweep:
        raise SpecError("threads must name at least one thread count (or be None for each backend's default)")
    if prefill and min(prefill) < prefill_queries:
        raise SpecError(
            f"prefill contexts must be >= the {prefill_queries} prefill queries, got {min(prefill)}; "
            "lower prefill_queries or raise the context"
        )
    import platform

    work = Workload.make(prefill_queries)
    torch = _torch() if sdpa else None
    notes: list[str] = []
    if sdpa and torch is None:
        notes.append("sdpa: torch is not installed, no SDPA baseline (pip install torch)")
    bandwidth: list[dict[str, Any]] = []
    host_bw: dict[int, float] = {}
    device_bw: dict[str, tuple[float, str]] = {}
    rows: list[Row] = []
    baselines: dict[tuple[str, int | None], dict[tuple[str, str, int], float]] = {}
    backends = list(dict.fromkeys(b for b, _ in jobs))
    threaded = {b for b in backends if threads is not None and _takes_threads(b)}
    for b in backends:
        if threads is not None and b not in threaded:
            notes.append(f"threads: {b} takes no threads option; it ran once, with its own default")
    # a backend without a threads option runs in the first pass only, at its default
    steps = [
        (t if b in threaded else None, (b, f)) for i, t in enumerate(sweep) for b, f in jobs if i == 0 or b in threaded
    ]
    # per backend and thread count: each format's decode at the largest context, timed in turn at the end
    turns: dict[tuple[str, int | None], list[tuple[Row, Callable[[], Any], Callable[[], None]]]] = {}
    for n_threads, (backend, fmt) in progress(steps, len(steps), "kvhal bench", show_progress):
        on_device = backend in DEVICE_BACKENDS
        if on_device:
            if backend not in device_bw:
                device_bw[backend] = device_read_bandwidth()
                gbps, where = device_bw[backend][0] / 1e9, device_bw[backend][1]
                bandwidth.append({"where": where, "threads": None, "read_gbps": gbps})
            bw = device_bw[backend][0]
        else:
            count = n_threads or os.cpu_count() or 1
            if count not in host_bw:
                host_bw[count] = read_bandwidth(bandwidth_bytes, threads=count)
                bandwidth.append({"where": "host", "threads": count, "read_gbps": host_bw[count] / 1e9})
            bw = host_bw[count]
        base = None
        if torch is not None:
            device = "cpu" if not on_device else ("cuda" if torch.cuda.is_available() else "")
            key = (device, None if on_device else n_threads)
            if not device:
                note = f"sdpa: torch has no CUDA device here; the {backend} rows have no SDPA ratio"
                notes += [note] if note not in notes else []
            elif key not in baselines:
                sdpa_rows, baselines[key] = _sdpa_rows(torch, device, work, decode, prefill, repeats, bw, key[1])
                rows.extend(sdpa_rows)
            base = baselines.get(key)
        one, last_decode = _bench_one(backend, fmt, work, decode, prefill, repeats, bw, base, n_threads)
        rows.extend(one)
        if last_decode is not None:
            turns.setdefault((backend, n_threads), []).append(last_decode)
    for group in turns.values():
        if len(group) > 1:
            for (row, _, _), t in zip(group, alternating_times([fn for _, fn, _ in group], group[0][2], 3 * repeats)):
                row.alternating_ms = t * 1e3
    turns.clear()  # the caches

    return {
        "machine": {
            "cpu": cpu_model(),
            "arch": platform.machine(),
            "cores": os.cpu_count(),
            "read_bandwidth_gbps": max((b["read_gbps"] for b in bandwidth if b["where"] == "host"), default=None),
            "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None),
        },
        "bandwidth": bandwidth,
        "shape": {
            "n_heads": N_HEADS,
            "n_kv_heads": N_KV_HEADS,
            "head_dim": HEAD_DIM,
            "prefill_queries": prefill_queries,
        },
        "repeats": repeats,
        "threads": None if threads is None else sweep,
        "notes": notes,
        "rows": [asdict(r) for r in rows],
    }


def _bench_one(
    backend: str,
    fmt: str,
    work: Workload,
    decode: list[int],
    prefill: list[int],
    repeats: int,
    bw: float,
    base: dict[tuple[str, str, int], float] | None,
    n_threads: int | None,
) -> tuple[list[Row], tuple[Row, Callable[[], Any], Callable[[], None]] | None]:
    """Rows of one backend and format (or ``K/V`` pair); ``n_threads``: the backend's threads option (None:
    its default). Also the decode row at the largest context with its call and sync, where the sequence
    still holds exactly that context at the end (for ``alternating_times``), else None."""
    k_format, _, v_format = fmt.partition("/")
    v_format = v_format or k_format
    sides: dict[str, Any] = {}
    for w, f, x in (("k", k_format, work.k), ("v", v_format, work.v)):
        if formats.get(f).side_data:  # kltq: side data calibrated on the workload's rows (store-1 needs it)
            from ..formats import kltq

            sides[f"{w}_side"] = kltq.calibrate([x], kltq.parse_name(f))
    spec = CacheSpec(
        n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, k_format=k_format, v_format=v_format, **sides
    )
    capacity = max([*decode, *prefill]) + STORE_CHUNK + 16
    cache = KVCache(
        spec, capacity, backend=backend, backend_options={} if n_threads is None else {"threads": n_threads}
    )
    name, sync = cache.backend.name, cache.backend.synchronize
    path_of = getattr(cache.backend, "attention_path", None)  # which kernels a call shape runs (cpu)
    ran_threads = getattr(cache.backend, "threads", None)
    row_bytes = (spec.k_row_bytes + spec.v_row_bytes) * N_KV_HEADS  # K+V bytes per token
    f32_bytes = N_KV_HEADS * HEAD_DIM * 4 * 2
    out = []

    def row(op: str, n: int, t: float, nbytes: float, tokens: float | None = None) -> Row:
        r = Row(name, fmt, op, n, t * 1e3, nbytes / t / 1e9, nbytes / t / bw, threads=ran_threads)
        r.tokens_per_s = tokens / t if tokens else None
        if base and (("f32", op, n) in base):
            r.speedup_vs_sdpa_f32 = base[("f32", op, n)] / t
            r.speedup_vs_sdpa_bf16 = base[("bf16", op, n)] / t
        out.append(r)
        return r

    one = (work.k[:1].copy(), work.v[:1].copy())
    for label, (k, v) in (("store-1", one), ("store-512", (work.k, work.v))):

        def store(k: np.ndarray = k, v: np.ndarray = v) -> None:
            s = cache.new_seq()  # a fresh sequence each time: seq_rm cannot undo a per-channel K page
            cache.store(s, 0, k, v)
            cache.free_seq(s)

        n = k.shape[0]
        row(label, n, median_time(store, sync, repeats), n * f32_bytes, n)
    s = cache.new_seq()
    q1 = cache.backend.asarray(work.q_decode, "q")  # on the device once: the figures time the call, not the upload
    qp = cache.backend.asarray(work.q_prefill, "q")
    n_q = int(work.q_prefill.shape[0])
    last_decode = None

    def decode_call() -> Any:
        return cache.attention(0, q1, [s], [1])

    for n in sorted({*decode, *prefill}):
        work.fill(cache, s, n)
        if n in decode:
            r = row("load", n, median_time(lambda: cache.load(s, 0), sync, repeats), n * row_bytes, n)
            r.frac_moved = r.frac_bw * (row_bytes + f32_bytes) / row_bytes  # f32 written to new arrays
            # into reused host buffers (load's out=): f32, then bf16 (what a dense kernel takes)
            for op, out_bytes, make in (("load-out", f32_bytes, _f32_out), ("load-bf16", f32_bytes // 2, _bf16_out)):
                buf = make((n, N_KV_HEADS, HEAD_DIM))
                if buf is not None:
                    r = row(
                        op,
                        n,
                        median_time(functools.partial(cache.load, s, 0, out=buf), sync, repeats),
                        n * row_bytes,
                        n,
                    )
                    r.frac_moved = r.frac_bw * (row_bytes + out_bytes) / row_bytes
                del buf
            r = row("decode", n, median_time(decode_call, sync, repeats), n * row_bytes)
            r.path = path_of(spec, N_HEADS, 1) if path_of else None
            last_decode = (r, decode_call, sync) if n == decode[-1] else None
        if n in prefill:
            t = median_time(lambda: cache.attention(0, qp, [s], [n_q]), sync, repeats)
            r = row("prefill", n, t, n * row_bytes, n_q)
            r.gflops = prefill_flops(n, n_q) / t / 1e9
            r.path = path_of(spec, N_HEADS, n_q) if path_of else None
        if decode and n > decode[-1]:  # the sequence grew past the largest decode context
            last_decode = None
    return out, last_decode


def _f32_out(shape: tuple[int, ...]) -> tuple[Any, Any]:
    return np.empty(shape, np.float32), np.empty(shape, np.float32)


def _bf16_out(shape: tuple[int, ...]) -> tuple[Any, Any] | None:
    """Two bfloat16 host buffers: ml_dtypes arrays, else torch CPU tensors; None with neither installed."""
    try:
        import ml_dtypes

        return np.empty(shape, ml_dtypes.bfloat16), np.empty(shape, ml_dtypes.bfloat16)
    except ImportError:
        torch = _torch()
        return (
            None
            if torch is None
            else (torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16))
        )


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    where = "; ".join(
        f"{b['where']}"
        + (f" {b['threads']} thread{'s' if b['threads'] > 1 else ''}" if b["threads"] else "")
        + f" {b['read_gbps']:.1f} GB/s"
        for b in result["bandwidth"]
    )
    sh = result["shape"]
    fw = max([6, *(len(r["format"]) for r in result["rows"])])  # format column: "f16/kivi4" is 9 wide
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores; measured read bandwidth: {where}",
        f"shape: {sh['n_heads']} q heads / {sh['n_kv_heads']} kv heads / head_dim {sh['head_dim']}; "
        f"prefill: the last {sh['prefill_queries']} positions, causal; median of {result['repeats']}; alt ms: "
        f"decode at the largest context, the formats called in turn (median of {3 * result['repeats']} rounds); "
        "moved: a load's bytes read and written per second over the read bandwidth (load-out / load-bf16: into "
        "reused f32 / bf16 buffers)",
        f"{'backend':<11} {'format':<{fw}} {'op':<9} {'ctx':>6} {'thr':>3} {'ms':>9} {'GB/s':>7} {'of bw':>6} {'moved':>6} "
        f"{'tok/s':>9} {'GFLOP/s':>8} {'x sdpa f32':>10} {'x sdpa bf16':>11} {'alt ms':>8} path",
    ]

    def opt(x: float | None, fmt: str) -> str:
        return format(x, fmt) if x is not None else "-"

    for r in result["rows"]:
        lines.append(
            f"{r['backend']:<11} {r['format']:<{fw}} {r['op']:<9} {r['context']:>6} {opt(r['threads'], 'd'):>3} "
            f"{r['median_ms']:>9.3f} {r['gbps']:>7.2f} {r['frac_bw']:>6.2f} "
            f"{opt(r.get('frac_moved'), '.2f'):>6} {opt(r['tokens_per_s'], '.3g'):>9} "
            f"{opt(r['gflops'], '.1f'):>8} {opt(r['speedup_vs_sdpa_f32'], '.2f'):>10} "
            f"{opt(r['speedup_vs_sdpa_bf16'], '.2f'):>11} {opt(r.get('alternating_ms'), '.3f'):>8} "
            f"{r.get('path') or '-'}"
        )
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
