"""The cuda/rocm prefill route through torch SDPA (kvhal_cuda.sdpa), on torch's CPU device, against float64.

``attend`` alone in float64 (its masks, GQA and windows must then match exactly), and the whole route on the CPU
emulator: kvhal_load_bf16 over the pages, SDPA in bf16, decode rows of the same call through the decode kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvhal_cuda import CudaBackend, sdpa

import kvhal
from kvhal import formats
from tests.oracle import attention_f64

torch = pytest.importorskip("torch")


CASES = [(True, None), (False, None), (True, 7), (False, 7)]  # (causal, window)


@pytest.mark.parametrize(("causal", "window"), CASES)
@pytest.mark.parametrize(("q_len", "seq_len"), [(5, 40), (40, 40), (1, 40)])
def test_attend_in_float64_is_float64_attention(causal, window, q_len, seq_len):
    rng = np.random.default_rng([q_len, seq_len, int(causal), window or 0])
    q = rng.standard_normal((q_len, 8, 16))
    k, v = rng.standard_normal((seq_len, 2, 16)), rng.standard_normal((seq_len, 2, 16))  # GQA 4
    lo, hi = sdpa.visible_span(seq_len, q_len, causal, window)
    assert hi == seq_len and (lo == 0 if window is None else lo == max(0, seq_len - q_len - window + 1))
    t = [torch.from_numpy(x) for x in (q, k[lo:], v[lo:])]
    got = sdpa.attend(torch, *t, kv_start=lo, seq_len=seq_len, scale=0.3, causal=causal, window=window).numpy()
    want = attention_f64(q, [k], [v], [q_len], scale=0.3, causal=causal, window=window)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def emulated(fmt_k: str, fmt_v: str, **options):
    cuda_emulator = pytest.importorskip("cuda_emulator")
    if cuda_emulator.compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt_k, v_format=fmt_v, block_size=16)
    backend = cuda_emulator.EmulatedCudaBackend(**options)
    return kvhal.KVCache(spec, 256, backend=backend), kvhal.KVCache(spec, 256, backend="reference")


ROUTE_FMTS = ["q8_0", "q4_0", "q5_1", "f16", "bf16", "fp8_e4m3", "mxfp4", "kivi4"]


@pytest.mark.parametrize("fmt", ROUTE_FMTS)
def test_sdpa_route_matches_float64_on_the_emulator(fmt):
    """A call of two prefill sequences (one windowed call too) and a decode one: within sdpa.TOLERANCE of float64
    attention over the reference's dequantized K/V; the prefill pages went through kvhal_load_bf16 only."""
    fk, fv = ("f16", fmt) if formats.get(fmt).k_page is not None else (fmt, fmt)
    got, ref = emulated(fk, fv, prefill="sdpa")
    assert got.backend.tolerance(2) == sdpa.TOLERANCE and got.backend.tolerance(1) == CudaBackend.attention_tolerance
    lens = (70, 33, 50)
    for c in (got, ref):
        for i, n in enumerate(lens):
            k, v = (np.random.default_rng([i, w]).standard_normal((n, 2, 64)).astype(np.float32) for w in range(2))
            k[:, :, 3] *= 8  # an outlier channel, as real keys have
            c.store(c.new_seq(), 0, k, v)
    ks, vs = zip(*[(kvhal.to_numpy(a).copy(), kvhal.to_numpy(b).copy()) for a, b in (ref.load(s, 0) for s in range(3))])
    q_lens = [20, 1, 33]
    q = np.random.default_rng(9).standard_normal((sum(q_lens), 8, 64)).astype(np.float32)
    for window in (None, 12):
        launches = got.backend._rt.launches
        launches.clear()
        out = kvhal.to_numpy(got.attention(0, q, [0, 1, 2], q_lens, window=window))
        want = attention_f64(q, list(ks), list(vs), q_lens, window=window)
        err = float(np.abs(out - want).max())
        assert err <= sdpa.TOLERANCE, f"window {window}: max error {err:.3g} > {sdpa.TOLERANCE}"
        decode = float(np.abs(out[20] - want[20]).max())  # the one-query sequence: the f32 decode kernel's bound
        assert decode <= got.backend.tolerance(1), f"window {window}: decode row error {decode:.3g}"
        names = [name for name, *_ in launches]
        assert names.count("kvhal_load_bf16") == 4 and "kvhal_attn_prefill" not in names
        assert "kvhal_attn_decode" in names  # the one-query sequence
    assert [got.backend.attention_path(got.spec, 8, n) for n in (1, 512)] == ["kvhal-decode", "sdpa-bf16"]


def assert_prefill_refused_decode_runs(match: str) -> None:
    """An sdpa-route cache whose torch cannot run: prefill is refused (``match``), decode still runs."""
    got, _ = emulated("q8_0", "q8_0", prefill="sdpa")
    s = got.new_seq()
    x = np.random.default_rng(0).standard_normal((20, 2, 64)).astype(np.float32)
    got.store(s, 0, x, x)
    q = np.ones((4, 4, 64), np.float32)
    with pytest.raises(kvhal.UnsupportedError, match=match):
        got.attention(0, q, [s], [4])
    assert kvhal.to_numpy(got.attention(0, q[:1], [s], [1])).shape == (1, 4, 64)


def test_prefill_without_torch_is_refused_with_the_extra_to_install(monkeypatch):
    monkeypatch.setattr(sdpa, "torch_missing", lambda: "prefill runs through torch SDPA and torch is not installed")
    assert_prefill_refused_decode_runs(r"prefill.*'kernel'")


def test_the_missing_torch_names_the_extra(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install 'kvhal-cuda[torch]'" in (sdpa.torch_missing() or "")
    with pytest.raises(kvhal.UnsupportedError, match=r"kvhal-cuda\[torch\].*'prefill': 'kernel'"):
        sdpa.import_torch()


def test_a_torch_older_than_enable_gqa_is_refused_as_a_missing_one(monkeypatch):
    """torch < 2.5 has no enable_gqa: every prefill call raised a raw TypeError from SDPA; supports now refuses it
    with the version and the extra to install, decode still runs."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.4.1+cu121" if name == "torch" else real(name))
    assert "torch >= 2.5" in (sdpa.torch_missing() or "") and "2.4.1+cu121" in (sdpa.torch_missing() or "")
    assert_prefill_refused_decode_runs(r"torch >= 2.5.*kvhal-cuda\[torch\].*'prefill': 'kernel'")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.5.0" if name == "torch" else real(name))
    assert sdpa.torch_missing() is None


def test_a_torch_without_the_gpu_platform_is_an_unsupported_error(monkeypatch):
    """A CPU-only torch (what pip installs on Windows) handed a CUDA array raises a raw AssertionError ("Torch not
    compiled with CUDA enabled") from from_dlpack: every prefill call did; it is now an UnsupportedError."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("needs a CPU-only torch")

    class OnCuda:  # the emulator's arrays, announced on a CUDA device as cupy's are
        def __init__(self, x):
            self.x = x

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            return self.x.__dlpack__()

    got, _ = emulated("q8_0", "q8_0", prefill="sdpa")
    s = got.new_seq()
    x = np.random.default_rng(0).standard_normal((20, 2, 64)).astype(np.float32)
    got.store(s, 0, x, x)
    real = torch.from_dlpack
    monkeypatch.setattr(torch, "from_dlpack", lambda a: real(OnCuda(a)))
    with pytest.raises(kvhal.UnsupportedError, match=r"cannot take this GPU's arrays.*'prefill': 'kernel'"):
        got.attention(0, np.ones((4, 4, 64), np.float32), [s], [4])


def test_prefill_option_is_checked():
    with pytest.raises(kvhal.SpecError, match="prefill"):
        emulated("q8_0", "q8_0", prefill="flash")


@pytest.mark.parametrize("extra", [{"k_format": "kivi4", "v_format": "kivi4"}, {"tail": 16}, {"sinks": 4}])
def test_a_spec_with_a_tail_prefills_on_the_kernel_and_says_so(monkeypatch, extra):
    """Such a spec attends through attention_lse, which stays on kvhal_attn_prefill: attention_path names that
    kernel, and without torch its prefill still runs (it was refused, and reported as sdpa-bf16)."""
    monkeypatch.setattr(sdpa, "torch_missing", lambda: "prefill runs through torch SDPA and torch is not installed")
    cuda_emulator = pytest.importorskip("cuda_emulator")
    if cuda_emulator.compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    spec = kvhal.CacheSpec(**{"n_layers": 1, "n_kv_heads": 2, "head_dim": 64, "k_format": "q8_0", **extra})
    cache = kvhal.KVCache(spec, 256, backend=cuda_emulator.EmulatedCudaBackend(prefill="sdpa"))
    s = cache.new_seq()
    x = np.random.default_rng(0).standard_normal((64, 2, 64)).astype(np.float32)
    cache.store(s, 0, x, x)
    launches = cache.backend._rt.launches
    launches.clear()
    assert kvhal.to_numpy(cache.attention(0, np.ones((8, 4, 64), np.float32), [s], [8])).shape == (8, 4, 64)
    assert "kvhal_attn_prefill" in [name for name, *_ in launches]
    assert cache.backend.attention_path(spec, 4, 8) == "kvhal-prefill"
