"""The openvino backend's own tests: compile once per shape class, device selection, error text, exactness.

The contract suite (tests/contract) covers byte-identity and attention against float64; these check
what is particular to this backend. Every comparison is against the numpy reference or the float64
oracle, never stored numbers.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import kvhal
from kvhal import formats
from tests.oracle import attention_f64

pytest.importorskip("openvino")
kov = pytest.importorskip("kvhal_openvino")
from kvhal_openvino import graphs  # noqa: E402

FORMATS = sorted(kov.OpenVINOBackend.formats)


def cache(
    fmt: str = "q8_0",
    v_fmt: str | None = None,
    *,
    heads: int = 2,
    dim: int = 64,
    cap: int = 512,
    backend: str = "openvino",
    **options: object,
) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(
        n_layers=2, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=v_fmt or fmt, block_size=16
    )
    return kvhal.KVCache(spec, cap, backend=backend, backend_options=options or None)


def test_decode_steps_never_recompile():
    """Store + attention + load over many decode steps (page boundaries, a growing ragged batch): no compiles."""
    rng = np.random.default_rng(0)
    c = cache("q4_1", "q8_0", cap=1024)
    a, b = c.new_seq(), c.new_seq()
    for s, n in ((a, 37), (b, 5)):
        for layer in (0, 1):
            c.store(s, layer, *rng.standard_normal((2, n, 2, 64), dtype=np.float32))
    c.attention(0, rng.standard_normal((2, 4, 64), dtype=np.float32), [a, b], [1, 1])
    c.load(a, 0)
    warm = c.backend.compile_count
    for step in range(60):
        seqs = [a, b] if step % 3 else [a]
        for s in seqs:
            for layer in (0, 1):
                c.store(s, layer, *rng.standard_normal((2, 1, 2, 64), dtype=np.float32))
        q = rng.standard_normal((len(seqs), 4, 64), dtype=np.float32)
        c.attention(step % 2, q, seqs, [1] * len(seqs), window=None if step % 4 else 9)
        c.load(a, 1, step % 7)
    c.store(a, 0, *rng.standard_normal((2, 40, 2, 64), dtype=np.float32))  # a prefill chunk, same graphs
    c.attention(0, rng.standard_normal((40, 4, 64), dtype=np.float32), [a], [40])
    assert c.backend.compile_count == warm
    # a second cache of the same shape class reuses the compiled graphs; another format compiles its own
    d = cache("q4_1", "q8_0")
    d.store(d.new_seq(), 0, *rng.standard_normal((2, 3, 2, 64), dtype=np.float32))
    assert d.backend.compile_count == warm
    e = cache("q5_0", heads=3, dim=96)  # a shape class no other test uses
    e.store(e.new_seq(), 0, *rng.standard_normal((2, 3, 3, 96), dtype=np.float32))
    assert e.backend.compile_count == warm + 1


def test_device_from_env(monkeypatch):
    monkeypatch.setenv("KVHAL_OPENVINO_DEVICE", "CPU")
    assert cache().backend.device == "CPU"
    info = {i.name: i for i in kvhal.backends()}["openvino"]
    assert info.available and info.device == "openvino:CPU" and "on device CPU (KVHAL_OPENVINO_DEVICE)" in info.reason

    monkeypatch.setenv("KVHAL_OPENVINO_DEVICE", "NOSUCHDEV")
    # openvino is imported in this process, so the probe can (cheaply) see the device is absent
    info = {i.name: i for i in kvhal.backends()}["openvino"]
    assert not info.available
    assert info.reason.startswith("OpenVINO device 'NOSUCHDEV' is not on this machine; OpenVINO sees: CPU")
    assert "Set KVHAL_OPENVINO_DEVICE to one of them" in info.reason
    with pytest.raises(kvhal.BackendUnavailableError, match="'openvino' is unavailable: OpenVINO device 'NOSUCHDEV'"):
        cache()
    with pytest.raises(kvhal.BackendUnavailableError, match=r"'NOSUCHDEV' \(from backend_options\['device'\]\)"):
        kov.OpenVINOBackend(device="NOSUCHDEV")
    assert kov.OpenVINOBackend.probe().score is None
    # an explicit option wins over the environment
    monkeypatch.setenv("KVHAL_OPENVINO_DEVICE", "CPU")
    assert cache(device="AUTO:CPU").backend.device == "AUTO:CPU"


def test_env_device_without_openvino_imported():
    """In a fresh process the probe only finds the package; the device is checked at start, with the same text."""
    code = (
        "import sys, kvhal; i = {b.name: b for b in kvhal.backends()}['openvino']; "
        "assert i.available and 'checked when the backend starts' in i.reason, i.reason; "
        "assert 'openvino' not in sys.modules\n"
        "try:\n    kvhal.KVCache(kvhal.CacheSpec(1, 2, 64), 64, backend='openvino')\n"
        "except kvhal.BackendUnavailableError as e:\n    print(e)"
    )
    env = {**os.environ, "KVHAL_OPENVINO_DEVICE": "GPU.7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    assert "OpenVINO device 'GPU.7' (from KVHAL_OPENVINO_DEVICE) is not on this machine; OpenVINO sees:" in out


@pytest.mark.parametrize("device", ["CPU", "AUTO:CPU"])
def test_graphs_compile_with_f32_precision(device):
    """INFERENCE_PRECISION_HINT=f32 reaches the plugin (CPU defaults to bf16), virtual devices included."""
    rng = np.random.default_rng(4)
    c = cache("q8_0", device=device)
    k, v = rng.standard_normal((2, 30, 2, 64), dtype=np.float32)
    s = c.new_seq()
    c.store(s, 0, k, v)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    out = kvhal.to_numpy(c.attention(0, q, [s], [2]))
    f = formats.get("q8_0")
    want = attention_f64(q, [f.dequantize(f.quantize(k))], [f.dequantize(f.quantize(v))], [2])
    assert float(np.abs(out - want).max()) <= kov.OpenVINOBackend.attention_tolerance  # bf16 would be ~4e-3
    if device == "CPU":  # AUTO does not answer the query
        key = next(k for k in graphs._COMPILED if k[0] == device and k[1] == "attention")
        assert str(graphs._COMPILED[key].get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"


def test_unavailable_reason_when_openvino_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    probe = kov.OpenVINOBackend.probe()
    assert probe.score is None and not probe.available
    info = {i.name: i for i in kvhal.backends()}["openvino"]
    assert not info.available
    assert info.reason == (
        "the openvino Python package is not installed: pip install kvhal-openvino (or pip install openvino)"
    )
    assert probe.reason == info.reason
    with pytest.raises(kvhal.BackendUnavailableError, match="pip install kvhal-openvino"):
        kov.OpenVINOBackend()
    with pytest.raises(kvhal.BackendUnavailableError, match="backend 'openvino' is unavailable: the openvino"):
        cache()


def test_import_kvhal_does_not_import_openvino():
    code = (
        "import sys, kvhal, kvhal_openvino; kvhal.backends(); "
        "assert 'openvino' not in sys.modules, sorted(m for m in sys.modules if 'openvino' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def hard_rows(rng: np.random.Generator, max_abs: float, n: int = 400, dim: int = 64) -> np.ndarray:
    """Rows that hit the quantizers' division, rounding and tie rules, beyond the contract's adversarial set."""
    top = np.log10(max_abs) - 1
    grid = rng.integers(-64, 65, (n, 2, dim)) * np.float32(2.0) ** rng.integers(-8, 3, (n, 2, 1))
    ratios = rng.integers(-16, 17, (n, 2, dim)) / rng.integers(1, 40, (n, 2, 1)).astype(np.float32)
    wide = rng.standard_normal((n, 2, dim)) * 10.0 ** rng.uniform(-44, top, (n, 2, 1))
    sparse = rng.standard_normal((n, 2, dim)) * (rng.random((n, 2, dim)) < 0.3)
    bits = rng.integers(0, 2**32, (n, 2, dim), dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = np.where(np.isfinite(bits) & (np.abs(bits) < max_abs / 2), bits, np.float32(0))
    return np.concatenate([grid, ratios, wide, sparse, bits]).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_graph_is_the_reference(fmt):
    """The store graph reproduces kvhal/formats/ggml.py bit for bit (1/x, x/127 and x/15 included)."""
    x = hard_rows(np.random.default_rng(1), formats.get(fmt).max_abs)
    caches = [cache(fmt, cap=len(x)), cache(fmt, cap=len(x), backend="reference")]
    for c in caches:
        c.store(c.new_seq(), 0, x, x[::-1].copy())
    for got, want in zip((caches[0].pools.k[0], caches[0].pools.v[0]), (caches[1].pools.k[0], caches[1].pools.v[0])):
        bad = np.argwhere((got != want).any(-1))
        assert bad.size == 0, f"{len(bad)} rows differ, first [block, head, slot] {bad[:3].tolist()}"
    k, _ = caches[0].load(0, 0)
    np.testing.assert_array_equal(kvhal.to_numpy(k), formats.get(fmt).dequantize(formats.get(fmt).quantize(x)))


def test_long_prefill_runs_in_query_chunks(monkeypatch):
    """Past the score budget the same graph runs over query chunks; results match float64."""
    monkeypatch.setattr(kov, "SCORE_BUDGET_BYTES", 64 << 10)
    rng = np.random.default_rng(2)
    c = cache("q8_0")
    f = formats.get("q8_0")
    ks, vs, seqs = [], [], []
    for n in (70, 33):
        k, v = rng.standard_normal((2, n, 2, 64), dtype=np.float32)
        s = c.new_seq()
        c.store(s, 0, k, v)
        seqs.append(s)
        ks.append(f.dequantize(f.quantize(k)))
        vs.append(f.dequantize(f.quantize(v)))
    q = rng.standard_normal((70 + 5, 8, 64), dtype=np.float32)
    out = kvhal.to_numpy(c.attention(0, q, seqs, [70, 5], window=20))
    want = attention_f64(q, ks, vs, [70, 5], window=20)
    assert float(np.abs(out - want).max()) <= kov.OpenVINOBackend.attention_tolerance


def test_off_cpu_page_upload_path_matches():
    """Devices that cannot read host memory get only the used pages, renumbered: same results as in place."""
    rng = np.random.default_rng(3)
    c = cache("q5_1", "f16")
    seqs = []
    for n in (20, 45, 3):
        s = c.new_seq()
        c.store(s, 0, *rng.standard_normal((2, n, 2, 64), dtype=np.float32))
        seqs.append(s)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    in_place = kvhal.to_numpy(c.attention(0, q, seqs, [1, 1, 1]))
    loaded = kvhal.to_numpy(c.load(seqs[1], 0)[1])
    c.backend._in_place = False
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(0, q, seqs, [1, 1, 1])), in_place)
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(seqs[1], 0)[1]), loaded)


@pytest.mark.parametrize("fmt", FORMATS)
def test_which_pools_are_read_in_place(fmt):
    """Quantized and f32 pools go to the graph as views of the pool memory; f16/bf16 ones (which the CPU
    plugin converts whole) as the pages a call reads."""
    c = cache(fmt)
    p = c.pools.k[0]
    views = [np.asarray(v.data) if hasattr(v, "data") else v for v in c.backend._views(p, fmt)]
    assert all(np.shares_memory(v, p) for v in views)
    assert c.pools.state.page_subsets == (fmt in ("f16", "bf16"))


def test_a_graph_the_device_cannot_compile_is_refused_by_supports():
    """Off the CPU plugin, supports() compiles the op's graph: a device whose compiler fails (HETERO:NPU,
    no NPU compiler here) is refused before anything is allocated, and a fallback takes the spec."""
    spec = kvhal.CacheSpec(1, 2, 64, "q8_0", "q4_0", 16)
    ok = kov.OpenVINOBackend(device="HETERO:CPU")
    assert all(ok.supports(spec, op) is None for op in ("store", "load", "attention"))
    assert graphs.key("store", spec) in {k[1:] for k in graphs._COMPILED if k[0] == "HETERO:CPU"}
    npu = kov.OpenVINOBackend(device="HETERO:NPU")
    for op in ("store", "load", "attention"):
        why = npu.supports(spec, op)
        assert why is not None and why.startswith(f"OpenVINO cannot compile kvhal's {op} graph for device HETERO:NPU: ")
        assert "Exception from" not in why
    with pytest.raises(kvhal.UnsupportedError, match="cannot compile kvhal's store graph"):
        kvhal.KVCache(spec, 64, backend=npu)
    with pytest.warns(UserWarning, match="falling back"):
        assert kvhal.KVCache(spec, 64, backend=npu, allow_fallback=True).backend.name != "openvino"


@pytest.mark.parametrize(
    ("heads", "dim", "bs", "fmt"),
    [(1, 1, 1, "f32"), (3, 8, 3, "bf16"), (8, 32, 128, "q5_1"), (1, 4096, 16, "q8_0"), (2, 96, 1, "q4_0")],
)
def test_cpu_compiles_every_spec(heads, dim, bs, fmt):
    """The CPU plugin compiles and runs the graphs at the edges of the spec space, exactly (supports() does
    not compile on CPU because of this)."""
    rng = np.random.default_rng(dim + bs)
    spec = kvhal.CacheSpec(1, heads, dim, fmt, fmt, bs)
    c, r = kvhal.KVCache(spec, 3 * bs + 5, backend="openvino"), kvhal.KVCache(spec, 3 * bs + 5, backend="reference")
    k, v = rng.standard_normal((2, 2 * bs + 3, heads, dim), dtype=np.float32)
    for x in (c, r):
        x.store(x.new_seq(), 0, k, v)
    np.testing.assert_array_equal(c.pools.k[0], r.pools.k[0])
    np.testing.assert_array_equal(c.pools.v[0], r.pools.v[0])
    np.testing.assert_array_equal(c.load(0, 0)[1], r.load(0, 0)[1])
    q = rng.standard_normal((2, 2 * heads, dim), dtype=np.float32)
    err = np.abs(c.attention(0, q, [0], [2]) - r.attention(0, q, [0], [2])).max()
    assert err <= kov.OpenVINOBackend.attention_tolerance


def test_one_spec_on_four_threads():
    """Caches of one spec share compiled graphs but not infer requests: four threads at once stay exact."""
    import threading

    spec = kvhal.CacheSpec(2, 2, 64, "q5_0", "bf16", 8)
    rng = np.random.default_rng(12)
    data = [rng.standard_normal((2, 90, 2, 64), dtype=np.float32) for _ in range(4)]
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    backend = kov.OpenVINOBackend()
    caches = [kvhal.KVCache(spec, 128, backend=backend) for _ in range(4)]
    outs: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            c, (k, v) = caches[i], data[i]
            s = c.new_seq()
            for t in range(0, 90, 3):
                for layer in (0, 1):
                    c.store(s, layer, k[t : t + 3], v[t : t + 3])
                outs[i] = c.attention(1, q, [s], [3])
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i, c in enumerate(caches):
        r = kvhal.KVCache(spec, 128, backend="reference")
        s = r.new_seq()
        for layer in (0, 1):
            r.store(s, layer, *data[i])
        for layer in (0, 1):
            np.testing.assert_array_equal(c.pools.k[layer], r.pools.k[layer])
            np.testing.assert_array_equal(c.pools.v[layer], r.pools.v[layer])
        assert np.abs(outs[i] - r.attention(1, q, [s], [3])).max() <= kov.OpenVINOBackend.attention_tolerance


def test_options_are_typed():
    with pytest.raises(kvhal.SpecError, match="has no option threads; the options it takes: device"):
        kov.OpenVINOBackend(threads=2)
    with pytest.raises(kvhal.SpecError, match="option device must be str, got int"):
        kov.OpenVINOBackend(device=0)
    with pytest.raises(kvhal.SpecError, match="option device must be str"):
        cache(device=True)
