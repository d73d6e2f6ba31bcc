"""cupy glue: probing the CUDA/ROCm stack, loading the kernel binary that fits the device, launching.

Nothing here imports cupy at module import time. ``probe()`` looks for cupy with ``find_spec`` and only
then imports it to read the device count, compute capability and runtime/driver versions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvhal import Probe
from kvhal.errors import BackendUnavailableError

from . import plan
from .source import kernel_names, kernel_source, source_sha256

PREBUILT_DIR = Path(__file__).parent / "prebuilt"
# distributions that provide the `cupy` module; they overwrite each other's files when several are installed
CUPY_DISTS = {"cuda12": "cupy-cuda12x", "cuda13": "cupy-cuda13x", "source": "cupy"}
CUPY_ROCM_DISTS = ("cupy-rocm-7-0", "cupy-rocm-6-0", "cupy-rocm-5-0")
INSTALL_HINT = {
    "cuda": "pip install kvhal-cuda13 (or kvhal-cuda12 for a CUDA 12 driver or a Volta GPU)",
    "rocm": "pip install kvhal-rocm on a machine with ROCm (cupy-rocm needs the ROCm libraries)",
}


def install_hint(platform: str) -> str:
    """What to pip install, given which kvhal GPU wheel is here (its cupy is a dependency pip may have skipped)."""
    wheel_cupy = {"kvhal-cuda13": "cupy-cuda13x", "kvhal-cuda12": "cupy-cuda12x", "kvhal-rocm": "cupy-rocm-7-0"}
    for dist, cupy in wheel_cupy.items():
        if (platform == "rocm") == (dist == "kvhal-rocm"):
            try:
                importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            return f"pip install {cupy} ({dist} depends on it; it was installed without dependencies)"
    return INSTALL_HINT[platform]


def installed_cupy() -> dict[str, str]:
    """Installed cupy distributions -> version."""
    out = {}
    for name in (*CUPY_DISTS.values(), *CUPY_ROCM_DISTS):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def read_manifest(flavor: str) -> dict[str, Any]:
    path = PREBUILT_DIR / flavor / "manifest.json"
    if not path.is_file():
        return {}
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def choose_binary(flavor: str, arch: str | int) -> plan.KernelChoice:
    """The prebuilt binary for this device, or "compile" with the reason (none for the arch, or stale)."""
    manifest = read_manifest(flavor)
    if manifest and manifest.get("source_sha256") != source_sha256():
        target = f"sm_{arch}" if isinstance(arch, int) else arch
        return plan.KernelChoice("compile", target, None, f"prebuilt {flavor} kernels were built from another kvhal.cu")
    if flavor == "rocm":
        return plan.choose_hip_binary(str(arch), manifest)
    return plan.choose_cuda_binary(int(arch), manifest)


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    is_hip: bool
    cc: int  # compute capability as 90 for sm_90 (0 on HIP)
    gcn_arch: str  # gfx90a... on HIP
    n_sm: int
    runtime: int  # cudaRuntimeGetVersion / hipRuntimeGetVersion
    driver: int

    @property
    def flavor(self) -> str:
        return "rocm" if self.is_hip else f"cuda{self.runtime // 1000}"

    @property
    def arch(self) -> str | int:
        return self.gcn_arch if self.is_hip else self.cc


def query_device(index: int = 0) -> DeviceInfo:
    """Imports cupy and reads what the probe needs; raises with a reason a person can act on."""
    import cupy  # noqa: PLC0415  (the SDK, imported only here)

    rt = cupy.cuda.runtime
    is_hip = bool(getattr(rt, "is_hip", False))
    try:
        count = rt.getDeviceCount()
    except Exception as e:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, ...
        hint = ""
        if "InsufficientDriver" in str(e):
            rtv = int(rt.runtimeGetVersion())
            alt = ", or use kvhal-cuda12 with a CUDA 12 driver" if rtv >= 13000 else ""
            hint = (
                f"; no NVIDIA driver for CUDA {_version(rtv)} is loaded (none installed, or an older one): "
                f"install or update it{alt}"
            )
        elif "NoDevice" in str(e):
            hint = "; check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES"
        runtime_name = "HIP" if is_hip else "CUDA"
        raise BackendUnavailableError(f"the {runtime_name} runtime found no usable device ({e}){hint}") from e
    if count <= index:
        raise BackendUnavailableError(
            f"device {index} requested but {count} visible (check KVHAL_CUDA_DEVICE / KVHAL_ROCM_DEVICE and "
            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
        )
    props = rt.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    gcn = props.get("gcnArchName", b"")
    gcn = gcn.decode() if isinstance(gcn, bytes) else str(gcn)
    return DeviceInfo(
        index=index,
        name=name,
        is_hip=is_hip,
        cc=0 if is_hip else int(props["major"]) * 10 + int(props["minor"]),
        gcn_arch=gcn,
        n_sm=int(props["multiProcessorCount"]),
        runtime=int(rt.runtimeGetVersion()),
        driver=int(rt.driverGetVersion()),
    )


def refusal(info: DeviceInfo, platform: str) -> str | None:
    """Why this device/stack cannot run the ``platform`` backend, or None."""
    if platform == "cuda" and info.is_hip:
        return "the installed cupy is a ROCm build; use the rocm backend (KVHAL_BACKEND=rocm)"
    if platform == "rocm" and not info.is_hip:
        return "the installed cupy is a CUDA build; use the cuda backend (KVHAL_BACKEND=cuda)"
    if info.is_hip:
        return None
    if info.driver // 1000 < info.runtime // 1000:
        return (
            f"the NVIDIA driver supports CUDA {_version(info.driver)} but cupy uses the CUDA {_version(info.runtime)} "
            "runtime: update the driver, or install kvhal-cuda12 (cupy-cuda12x) for an older driver"
        )
    return plan.arch_refusal(info.cc, info.runtime // 1000)


@lru_cache(maxsize=8)
def probe(platform: str, device: int = 0) -> Probe:
    """The probe of "cuda" or "rocm" on device index ``device``; cached, as the registry probes on every listing."""
    if importlib.util.find_spec("cupy") is None:
        return Probe(None, f"cupy is not installed: {install_hint(platform)}")
    dists = installed_cupy()
    if CUPY_DISTS["cuda12"] in dists and CUPY_DISTS["cuda13"] in dists:
        warnings.warn(
            "kvhal: both cupy-cuda12x and cupy-cuda13x are installed; they share the `cupy` module and whichever was "
            "installed last wins: uninstall one (pip uninstall cupy-cuda12x or cupy-cuda13x)",
            RuntimeWarning,
            stacklevel=2,
        )
    which = ", ".join(f"{k} {v}" for k, v in dists.items()) or "cupy"
    rocm_dists = [d for d in dists if d in CUPY_ROCM_DISTS]
    if dists and platform == "rocm" and not rocm_dists:
        return Probe(None, f"the installed cupy is a CUDA build ({which}): {INSTALL_HINT['rocm']}")
    if dists and platform == "cuda" and len(rocm_dists) == len(dists):
        return Probe(None, f"the installed cupy is a ROCm build ({which}); use the rocm backend (KVHAL_BACKEND=rocm)")
    try:
        info = query_device(device)
    except Exception as e:
        return Probe(None, f"{which} is installed but unusable here: {type(e).__name__}: {e}")
    why = refusal(info, platform)
    if why:
        return Probe(None, f"{info.name}: {why}")
    choice = choose_binary(info.flavor, info.arch)
    if info.is_hip:
        stack = f"{info.gcn_arch}, HIP runtime {info.runtime}"
    else:
        stack = f"sm_{info.cc}, CUDA runtime {_version(info.runtime)}, driver {_version(info.driver)}"
    kernels = choice.note if choice.kind != "compile" else f"{choice.note}: NVRTC/hiprtc compiles at first use"
    reason = f"{info.name} ({stack}, {info.n_sm} SMs) via {which}; kernels: {kernels}"
    return Probe(score=100, reason=reason, device=f"{platform}:{device} {info.name}")


class CupyRuntime:
    """One device: its kernel module and launches. The emulated runtime in tests has the same surface.

    Immutable once built (the kernel functions are looked up here), so caches on several threads share it.
    """

    def __init__(self, device: int, platform: str) -> None:
        import cupy  # noqa: PLC0415

        self.xp = cupy
        self.info = query_device(device)
        why = refusal(self.info, platform)
        if why:
            raise BackendUnavailableError(f"{self.info.name}: {why}")
        self.device = cupy.cuda.Device(device)
        self.n_sm = self.info.n_sm
        with self.device:
            module = self._load(cupy)
            try:  # cupy loads the module into the device here: a binary the driver refuses is a reason, not a crash
                self._fns = {name: module.get_function(name) for name in kernel_names()}
            except Exception as e:  # a PTX newer than the driver, a missing or damaged prebuilt file
                raise BackendUnavailableError(
                    f"{self.info.name}: the driver could not load kvhal's kernels ({type(e).__name__}: {e}); update "
                    f"the GPU driver, or reinstall the kvhal-{self.info.flavor} wheel"
                ) from e

    def _load(self, cupy: Any) -> Any:
        choice = choose_binary(self.info.flavor, self.info.arch)
        if choice.kind != "compile":
            assert choice.file is not None
            return cupy.RawModule(path=str(PREBUILT_DIR / self.info.flavor / choice.file))
        warnings.warn(
            f"kvhal-cuda: {choice.note}; compiling kvhal.cu for {choice.arch} at first use "
            f"(install the kvhal-{self.info.flavor} wheel, or run nox -s compile-{self.info.flavor}, to skip this)",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            options = ("-std=c++17",) if self.info.is_hip else ("--std=c++17",)  # hiprtc takes clang's spelling
            module = cupy.RawModule(code=kernel_source(), options=options)
            module.compile()
        except Exception as e:
            raise BackendUnavailableError(
                f"no prebuilt kernel fits {self.info.name} ({choice.arch}) and compiling failed: {e}; "
                "install NVRTC (pip install nvidia-cuda-nvrtc-cu12 / nvidia-cuda-nvrtc) or a wheel built for this arch"
            ) from e
        return module

    def launch(
        self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, smem: int = 0
    ) -> None:
        with self.device:
            self._fns[name](grid, block, args, shared_mem=smem)

    def to_device(self, a: np.ndarray) -> Any:
        with self.device:
            return self.xp.asarray(a)

    def pointer_table(self, arrays: list[Any]) -> Any:
        """A device uint64 array of the arrays' device addresses (raw block I/O reaches every pool at once)."""
        return self.to_device(np.array([a.data.ptr for a in arrays], np.uint64))

    def to_host(self, a: Any) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)

    def synchronize(self) -> None:
        with self.device:
            self.xp.cuda.runtime.deviceSynchronize()
