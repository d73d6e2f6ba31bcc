"""The ascend backend beyond the contract suite: probe reasons, torch/DLPack input, device-side value
checks, codec edge cases and the chunked attention paths, all against the numpy reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import kvhal_ascend
import numpy as np
import pytest
import torch
from kvhal_ascend import AscendBackend, ggml_torch

import kvhal
from kvhal import formats
from kvhal.reference import ReferenceBackend

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # tests.oracle lives in the core's tests/
from tests.oracle import attention_f64  # noqa: E402

ALL = sorted(AscendBackend.formats)  # what its torch codecs implement


# ---- probe ---------------------------------------------------------------------------------------


@pytest.fixture()
def probe_env(monkeypatch):
    """A clean probe: no device override, no cached torch_npu import (before and after)."""
    monkeypatch.delenv(kvhal_ascend.ENV_DEVICE, raising=False)
    kvhal_ascend._import_torch_npu.cache_clear()
    yield monkeypatch
    kvhal_ascend._import_torch_npu.cache_clear()
    sys.modules.pop("torch_npu", None)


def hide(monkeypatch, *names: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def fake_torch_npu(monkeypatch, tmp_path: Path, body: str) -> None:
    """A torch_npu package on sys.path whose import runs ``body`` (find_spec finds it for real)."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("torch_npu", None)


def state() -> tuple[kvhal.Probe | None, str]:
    """The probe when the backend is usable (else None) and its reason either way."""
    p = AscendBackend.probe()
    return (p if p.available else None), p.reason


@pytest.mark.parametrize("device", [None, "cpu", "npu"])
def test_probe_torch_missing(probe_env, device):
    if device:
        probe_env.setenv(kvhal_ascend.ENV_DEVICE, device)
    hide(probe_env, "torch")
    probe, reason = state()
    assert probe is None
    assert reason.startswith("torch is not installed")


def test_probe_torch_npu_missing(probe_env):
    hide(probe_env, "torch_npu")
    probe, reason = state()
    assert probe is None
    assert reason.startswith("torch_npu is not installed")
    assert "kvhal-ascend[npu]" in reason and "KVHAL_ASCEND_DEVICE=cpu" in reason


def test_probe_cann_missing_reports_the_import_error(probe_env, tmp_path):
    # the words real torch-npu 2.13.0 raises on a machine without CANN
    fake_torch_npu(
        probe_env,
        tmp_path,
        """
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    """,
    )
    probe, reason = state()
    assert probe is None
    assert "CANN" in reason and "set_env.sh" in reason
    assert "ImportError: libhccl.so: cannot open shared object file" in reason


def test_probe_torch_npu_mismatch(probe_env, tmp_path):
    fake_torch_npu(
        probe_env,
        tmp_path,
        """
        raise RuntimeError("torch_npu 2.13.0 was built for torch 2.13, found 2.12")
    """,
    )
    probe, reason = state()
    assert probe is None
    assert "does not import (RuntimeError: torch_npu 2.13.0 was built" in reason and "must match torch" in reason


NPU_FAKE = """
    import types
    __version__ = "2.13.0"
    npu = types.SimpleNamespace(device_count=lambda: {n}, get_device_name=lambda i: "Ascend910B3")
"""


def test_probe_no_npu_visible(probe_env, tmp_path):
    fake_torch_npu(probe_env, tmp_path, NPU_FAKE.format(n=0))
    probe, reason = state()
    assert probe is None
    assert reason.startswith("torch_npu imports but sees no NPU") and "npu-smi" in reason


def test_probe_npu_visible(probe_env, tmp_path):
    fake_torch_npu(probe_env, tmp_path, NPU_FAKE.format(n=2))
    probe_env.setenv(kvhal_ascend.ENV_DEVICE, "npu:1")
    probe, _ = state()
    assert probe is not None and probe.device == "npu:1" and probe.score == kvhal_ascend.NPU_SCORE
    assert "Ascend910B3" in probe.reason and "2.13.0" in probe.reason
    probe_env.setenv(kvhal_ascend.ENV_DEVICE, "npu:2")
    probe, reason = state()
    assert probe is None and "sees 2 NPU(s)" in reason


def test_probe_cpu_and_bad_value(probe_env):
    probe_env.setenv(kvhal_ascend.ENV_DEVICE, "cpu")
    probe, _ = state()
    assert probe is not None and probe.device == "cpu" and probe.score < kvhal_ascend.NPU_SCORE
    probe_env.setenv(kvhal_ascend.ENV_DEVICE, "gpu")
    probe, reason = state()
    assert probe is None and "'gpu'" in reason and kvhal_ascend.ENV_DEVICE in reason
    with pytest.raises(kvhal.SpecError, match="gpu"):
        AscendBackend()
    with pytest.raises(kvhal.BackendUnavailableError, match="gpu"):  # by name: the probe's reason
        make("ascend")
    with pytest.raises(kvhal.SpecError, match="gpu"):
        AscendBackend(device="gpu")
    assert AscendBackend(device="cpu").device.type == "cpu"  # the option beats the environment


@pytest.mark.parametrize(
    "options",
    [
        {"attention_batch_bytes": "big"},
        {"attention_batch_bytes": 0},
        {"attention_batch_bytes": True},
        {"attention_batch_bytes": 1.5e6},
        {"device": 0},
        {"device": ""},
        {"no_such_option": 1},
    ],
)
def test_bad_options_are_spec_errors(options):
    with pytest.raises(kvhal.SpecError, match="backend 'ascend'"):
        AscendBackend(**options)


def test_codecs_cover_every_claimed_format():
    assert set(ggml_torch.CODECS) == set(AscendBackend.formats) == set(formats.GGML_CLASSIC)


def test_probe_cuda_check_path(probe_env):
    """cuda is a device-agnosticism check only: it never outranks a real backend."""
    probe_env.setenv(kvhal_ascend.ENV_DEVICE, "cuda")
    probe_env.setattr(torch.cuda, "device_count", lambda: 0)
    probe, reason = state()
    assert probe is None and "sees 0 CUDA device(s)" in reason
    probe_env.setattr(torch.cuda, "device_count", lambda: 1)
    probe, _ = state()
    assert probe is not None and probe.device == "cuda:0" and probe.score == kvhal_ascend.HOST_SCORE


def test_npu_requested_without_torch_npu_is_an_error(probe_env):
    hide(probe_env, "torch_npu")
    with pytest.raises(kvhal.BackendUnavailableError, match="torch_npu is not installed"):
        AscendBackend(device="npu")


@pytest.mark.parametrize("device", ["", "cpu"])
def test_import_and_probe_import_no_torch(device):
    code = (
        "import sys, kvhal, kvhal_ascend; kvhal.backends(); "
        "assert 'torch' not in sys.modules and 'torch_npu' not in sys.modules, 'probe imported torch'"
    )
    env = {**os.environ, kvhal_ascend.ENV_DEVICE: device}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# ---- input conversion ----------------------------------------------------------------------------


def make(backend, fmt="q8_0", heads=2, dim=64, cap=128) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=fmt, block_size=16)
    return kvhal.KVCache(spec, cap, backend=backend)


def pools_np(cache: kvhal.KVCache) -> list[np.ndarray]:
    p = cache.pools
    return [np.asarray(cache.backend.to_numpy(x)) for x in (p.k[0], p.v[0])]


@pytest.fixture()
def cpu() -> AscendBackend:
    return AscendBackend(device="cpu")


class DLPackOnly:
    """An array that offers only the DLPack protocol (as cupy or jax arrays do)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __dlpack__(self, **kwargs):
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


@pytest.mark.parametrize("kind", ["torch-f32", "torch-f16", "torch-bf16", "torch-strided", "dlpack", "numpy-readonly"])
def test_inputs_store_like_numpy(cpu, kind):
    rng = np.random.default_rng(7)
    k = rng.standard_normal((20, 2, 64), dtype=np.float32)
    v = rng.standard_normal((20, 2, 64), dtype=np.float32)
    if kind in ("torch-f16", "torch-bf16"):  # the numpy equivalent is the exact f32 widening
        dt = torch.float16 if kind == "torch-f16" else torch.bfloat16
        tk, tv = torch.from_numpy(k).to(dt), torch.from_numpy(v).to(dt)
        k, v = tk.float().numpy(), tv.float().numpy()
    elif kind == "torch-strided":
        tk = torch.from_numpy(np.ascontiguousarray(k.transpose(1, 0, 2))).transpose(0, 1).requires_grad_()
        tv = torch.from_numpy(v)[:, :, :]
        assert not tk.is_contiguous()
    elif kind == "dlpack":
        tk, tv = DLPackOnly(torch.from_numpy(k)), DLPackOnly(torch.from_numpy(v))
    elif kind == "numpy-readonly":
        tk, tv = k.copy(), v.copy()
        tk.flags.writeable = tv.flags.writeable = False
    else:
        tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    got, want = make(cpu), make("reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got.store(got.new_seq(), 0, tk, tv)
    want.store(want.new_seq(), 0, k, v)
    for a, b in zip(pools_np(got), pools_np(want), strict=True):
        np.testing.assert_array_equal(a, b)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    out_t = got.attention(0, torch.from_numpy(q), [0], [3])
    assert isinstance(out_t, torch.Tensor) and out_t.device == cpu.device and out_t.dtype == torch.float32
    np.testing.assert_array_equal(out_t.numpy(), kvhal.to_numpy(got.attention(0, q, [0], [3])))


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros((2, 2, 64), dtype=torch.float64),
        torch.zeros((2, 2, 64), dtype=torch.int32),
        np.zeros((2, 2, 64), np.float64),
        DLPackOnly(torch.zeros((2, 2, 64), dtype=torch.int8)),
    ],
)
def test_other_dtypes_are_rejected(cpu, bad):
    cache = make(cpu)
    with pytest.raises(kvhal.DTypeError, match="float32, float16 or bfloat16"):
        cache.store(cache.new_seq(), 0, bad, np.zeros((2, 2, 64), np.float32))


# ---- values are checked on the device ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["f16", "q4_0", "bf16", "f32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_values_on_device_matches_format(cpu, monkeypatch, fmt, dtype):
    f = formats.get(fmt)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((9, 2, 64), dtype=np.float32)).to(dtype)
    big = torch.finfo(dtype).max if dtype == torch.float16 else 1e30
    variants = {"ok": lambda t: t}
    variants["nan"] = lambda t: t.index_put_(
        (torch.tensor([4]), torch.tensor([1]), torch.tensor([7])), torch.tensor(float("nan"), dtype=dtype)
    )
    variants["inf"] = lambda t: t.index_put_(
        (torch.tensor([0, 8]), torch.tensor([0, 1]), torch.tensor([3, 2])), torch.tensor(-float("inf"), dtype=dtype)
    )
    variants["big"] = lambda t: t.index_put_(
        (torch.tensor([2]), torch.tensor([0]), torch.tensor([0])), torch.tensor(big, dtype=dtype)
    )
    for name, change in variants.items():
        t = change(x.clone())
        want = None
        try:
            f.check_values(t.numpy())
        except kvhal.NonFiniteError as e:
            want = str(e)

        def host_copy(*a, **k):
            raise AssertionError("check_values copied the tensor to the host")

        if want is None:
            with monkeypatch.context() as m:  # valid input: no whole-tensor trip through numpy or the host
                m.setattr(torch.Tensor, "numpy", host_copy)
                m.setattr(torch.Tensor, "cpu", host_copy)
                m.setattr(cpu, "to_numpy", host_copy)
                cpu.check_values(f, t)
            continue
        with pytest.raises(kvhal.NonFiniteError) as err:  # the format's own words, not a copy of them
            cpu.check_values(f, t)
        assert str(err.value) == want, name


# ---- codecs: edge cases the contract suite's normal data does not reach ----------------------------


def edge_rows() -> np.ndarray:
    rng = np.random.default_rng(11)
    rows = [
        np.zeros(32),
        np.full(32, -0.0),
        np.r_[-0.0, 0.0, rng.uniform(0.1, 1, 30)],  # zero signs: the first of equal min/max candidates
        np.r_[0.0, -0.0, rng.uniform(-1, -0.1, 30)],
        np.full(32, 1e-40),
        np.full(32, -3.0),
        np.r_[7.0, -7.0, np.zeros(30)],
        np.r_[-7.0, 7.0, np.zeros(30)],  # signed-absmax ties: first wins
        rng.integers(-4, 4, 32).astype(float),
        rng.integers(-254, 255, 32) / 2,  # q8_0 half-way points when the block max is 127
        np.r_[127.0, rng.integers(-254, 255, 31) / 2],
        np.full(32, 65504.0),
        np.linspace(-65504, 65504, 32),
        rng.standard_normal(32) * 1e-38,
        rng.standard_normal(32) * 1e-5,
        rng.uniform(-6e4, 6e4, 32),
    ]
    bits = rng.integers(0, 2**32, 8192, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits) & (np.abs(bits) <= 65504)][: 32 * 64]
    # exact ties of the bf16 and f16 roundings (round to nearest even must pick the even neighbour)
    hi = rng.integers(0x0001, 0x4700, 64, dtype=np.uint32) | rng.integers(0, 2, 64, dtype=np.uint32) << 15
    bf16_ties = ((hi << 16) | 0x8000).view(np.float32)
    h = rng.integers(0, 0x7BFF, 64, dtype=np.uint16) | rng.integers(0, 2, 64, dtype=np.uint16) << 15
    f16_ties = (h.view(np.float16).astype(np.float32) + (h + 1).view(np.float16).astype(np.float32)) / 2
    return np.concatenate([np.asarray(rows, np.float32).ravel(), bits, bf16_ties, f16_ties]).reshape(-1, 1, 32)


@pytest.mark.parametrize("fmt", ALL)
def test_codec_edge_cases_are_bit_exact(fmt):
    f = formats.get(fmt)
    x = edge_rows()
    want = f.quantize(x)
    got = ggml_torch.quantize(fmt, torch.from_numpy(x))
    np.testing.assert_array_equal(got.numpy(), want)
    back = ggml_torch.dequantize(fmt, torch.from_numpy(want)).numpy()
    np.testing.assert_array_equal(back.view(np.uint32), f.dequantize(want).view(np.uint32))


# ---- attention in chunks, copy_slots with overlap -----------------------------------------------------


@pytest.mark.parametrize("budget", [1 << 10, 64 << 10, 256 << 20])
@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None), (False, 9)])
def test_attention_chunked_matches_float64(budget, causal, window):
    """A tiny working-set budget forces one sequence per group and one query per chunk."""
    rng = np.random.default_rng(5)
    fmt = "q5_1"
    f = formats.get(fmt)
    cache = make(AscendBackend(device="cpu", attention_batch_bytes=budget), fmt, heads=2, dim=64, cap=256)
    lens, q_lens = [45, 3, 30, 17], [12, 1, 30, 2]
    ks, vs = [], []
    for n in lens:
        k, v = rng.standard_normal((2, n, 2, 64), dtype=np.float32)
        cache.store(cache.new_seq(), 0, k, v)
        ks.append(f.dequantize(f.quantize(k)))
        vs.append(f.dequantize(f.quantize(v)))
    q = rng.standard_normal((sum(q_lens), 8, 64), dtype=np.float32)
    out = kvhal.to_numpy(cache.attention(0, q, [0, 1, 2, 3], q_lens, scale=0.2, causal=causal, window=window))
    want = attention_f64(q, ks, vs, q_lens, scale=0.2, causal=causal, window=window)
    assert float(np.abs(out - want).max()) <= AscendBackend.attention_tolerance


def test_copy_slots_overlapping_gathers_then_scatters(cpu):
    rng = np.random.default_rng(9)
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format="q4_1", v_format="bf16", block_size=8)
    ref = ReferenceBackend()
    ours, theirs = cpu.allocate(spec, 4), ref.allocate(spec, 4)
    k, v = rng.standard_normal((2, 32, 2, 64), dtype=np.float32)
    slots = np.arange(32)
    cpu.store(ours, 0, cpu.asarray(k, "k"), cpu.asarray(v, "v"), slots)
    ref.store(theirs, 0, k, v, slots)
    src, dst = np.arange(3, 20), np.arange(7, 24)  # overlapping, forward
    cpu.copy_slots(ours, 0, src, dst)
    ref.copy_slots(theirs, 0, src, dst)
    np.testing.assert_array_equal(cpu.to_numpy(ours.k[0]), theirs.k[0])
    np.testing.assert_array_equal(cpu.to_numpy(ours.v[0]), theirs.v[0])


def test_block_io_of_no_blocks_and_repeated_writes(cpu):
    rng = np.random.default_rng(2)
    spec = kvhal.CacheSpec(n_layers=3, n_kv_heads=2, head_dim=64, k_format="q5_0", v_format="f16", block_size=4)
    ours, theirs = cpu.allocate(spec, 6), ReferenceBackend().allocate(spec, 6)
    none = np.zeros(0, np.int64)
    assert cpu.read_blocks(ours, none).shape == (0, spec.block_nbytes)
    cpu.write_blocks(ours, none, np.zeros((0, spec.block_nbytes), np.uint8))
    data = rng.integers(0, 256, (3, spec.block_nbytes), dtype=np.uint8)
    data.flags.writeable = False  # a read-only source is fine (and not written)
    for backend, pools in ((cpu, ours), (ReferenceBackend(), theirs)):
        backend.write_blocks(pools, np.array([5, 1, 2]), data)
    all_ids = np.arange(6)
    np.testing.assert_array_equal(cpu.read_blocks(ours, all_ids), ReferenceBackend().read_blocks(theirs, all_ids))
    for layer in range(3):
        np.testing.assert_array_equal(cpu.to_numpy(ours.k[layer]), theirs.k[layer])
    with pytest.raises(kvhal.ShapeError):
        cpu.write_blocks(ours, all_ids[:1], data[:1].astype(np.int8))
