"""probe(): cheap, specific reasons, refusals for unsupported stacks; the prebuilt-kernel choice."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
from kvhal_cuda import CudaBackend, RocmBackend, runtime

import kvhal


@pytest.fixture(autouse=True)
def fresh_probe():
    runtime.probe.cache_clear()
    yield
    runtime.probe.cache_clear()


def info(**kw) -> runtime.DeviceInfo:
    base = dict(index=0, name="NVIDIA H100", is_hip=False, cc=90, gcn_arch="", n_sm=132, runtime=13000, driver=13000)
    return runtime.DeviceInfo(**{**base, **kw})


def test_import_does_not_import_cupy():
    assert "cupy" not in sys.modules or pytest.skip("cupy already imported by another test")
    CudaBackend.probe()
    RocmBackend.probe()


def test_no_cupy_reason(monkeypatch):
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: None)
    p = CudaBackend.probe()
    assert p.score is None and not p.available
    assert "cupy is not installed" in p.reason and "kvhal-cuda13" in p.reason
    assert "ROCm" in RocmBackend.probe().reason


def test_kvhal_lists_both_with_reasons():
    infos = {i.name: i for i in kvhal.backends()}
    for name in ("cuda", "rocm"):
        assert name in infos, "kvhal-cuda's entry points are not registered (pip install -e backends/cuda)"
        if not infos[name].available:
            assert infos[name].reason and "probe failed" not in infos[name].reason


def fake_stack(monkeypatch, dev: runtime.DeviceInfo, dists: dict[str, str]):
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(runtime, "installed_cupy", lambda: dists)
    monkeypatch.setattr(runtime, "query_device", lambda index=0: dev)


def test_probe_reports_versions_and_kernels(monkeypatch):
    fake_stack(monkeypatch, info(runtime=12090, driver=13000), {"cupy-cuda12x": "14.2.0"})
    p = CudaBackend.probe()
    assert p.score is not None and p.score > 0 and p.device == "cuda:0 NVIDIA H100"
    for part in ("sm_90", "CUDA runtime 12.9", "driver 13.0", "cupy-cuda12x 14.2.0", "kernels:"):
        assert part in p.reason
    r = RocmBackend.probe()
    assert r.score is None and "CUDA build" in r.reason


def test_device_option_from_env(monkeypatch):
    asked = []
    fake_stack(monkeypatch, info(), {"cupy-cuda13x": "14.2.0"})
    monkeypatch.setattr(runtime, "query_device", lambda index=0: asked.append(index) or info(index=index))
    monkeypatch.setenv("KVHAL_CUDA_DEVICE", "1")
    assert CudaBackend.probe().device == "cuda:1 NVIDIA H100" and asked == [1]
    monkeypatch.setenv("KVHAL_CUDA_DEVICE", "one")
    p = CudaBackend.probe()
    assert p.score is None and "KVHAL_CUDA_DEVICE" in p.reason and "not an integer" in p.reason
    monkeypatch.setenv("KVHAL_CUDA_DEVICE", "-1")
    assert "must be >= 0" in CudaBackend.probe().reason
    for bad in ({"device": "0"}, {"device": True}, {"device": -1}, {"devices": 0}):
        with pytest.raises(kvhal.SpecError):
            CudaBackend(**bad)  # refused before any device is touched


def test_both_cupy_warns(monkeypatch):
    fake_stack(monkeypatch, info(), {"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"})
    with pytest.warns(RuntimeWarning, match="both cupy-cuda12x and cupy-cuda13x"):
        CudaBackend.probe()


@pytest.mark.parametrize(
    "dev,match",
    [
        (info(cc=70, name="Tesla V100"), "not supported by CUDA 13"),
        (info(runtime=13000, driver=12080), "driver supports CUDA 12.8"),
        (info(cc=61, runtime=12090, driver=12090), "older than sm_70"),
        (info(is_hip=True, cc=0, gcn_arch="gfx90a"), "ROCm build"),
    ],
)
def test_refusals(monkeypatch, dev, match):
    fake_stack(monkeypatch, dev, {"cupy-cuda13x": "14.2.0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = CudaBackend.probe()
    assert p.score is None and match in p.reason


def test_cuda12_keeps_volta(monkeypatch):
    fake_stack(monkeypatch, info(cc=70, runtime=12090, driver=12090), {"cupy-cuda12x": "14.2.0"})
    assert CudaBackend.probe().available


def test_prebuilt_choice_and_stale_manifest(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "PREBUILT_DIR", tmp_path)
    (tmp_path / "cuda13").mkdir()
    manifest = {"source_sha256": runtime.source_sha256(),
                "artifacts": [{"kind": "cubin", "arch": "sm_90", "file": "kvhal.sm_90.cubin"}]}  # fmt: skip
    (tmp_path / "cuda13" / "manifest.json").write_text(json.dumps(manifest))
    assert runtime.choose_binary("cuda13", 90).kind == "cubin"
    assert runtime.choose_binary("cuda13", 89).kind == "compile"
    assert runtime.choose_binary("cuda12", 90).note == "no prebuilt kernel for sm_90"
    manifest["source_sha256"] = "0" * 64
    (tmp_path / "cuda13" / "manifest.json").write_text(json.dumps(manifest))
    assert "another kvhal.cu" in runtime.choose_binary("cuda13", 90).note


def test_kernel_source_is_self_contained():
    src = runtime.kernel_source()
    assert '#include "platform.h"' not in src and "kv_shfl_xor" in src


def test_a_prebuilt_binary_the_driver_cannot_load_is_unavailable(monkeypatch):
    """cupy loads a module at its first get_function: a PTX newer than the driver failed there with cupy's raw
    CUDADriverError out of CudaBackend() (and KVCache(backend="auto")); it is a BackendUnavailableError."""
    import contextlib
    import types

    class CUDADriverError(RuntimeError):
        pass

    class RawModule:
        def __init__(self, **kw):
            pass

        def get_function(self, name):
            raise CUDADriverError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with an "
                                  "unsupported toolchain.")  # fmt: skip

    cupy = types.ModuleType("cupy")
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(runtime, "query_device", lambda index=0: info(cc=121))
    ptx = runtime.plan.KernelChoice("ptx", "compute_120", "kvhal.compute_120.ptx", "prebuilt PTX compute_120")
    monkeypatch.setattr(runtime, "choose_binary", lambda flavor, arch: ptx)
    with pytest.raises(kvhal.BackendUnavailableError, match=r"could not load.*UNSUPPORTED_PTX_VERSION.*driver"):
        CudaBackend()
