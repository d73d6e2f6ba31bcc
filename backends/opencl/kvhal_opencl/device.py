"""OpenCL device choice and the per-device runtime (context, queue, memory pool, program cache).

Imported by the backend on first use; ``select`` is the only chooser, shared by ``probe`` and the
backend's constructor (cached per selector, so the platforms are enumerated once per process).
"""

from __future__ import annotations

import importlib.util
import threading
from functools import cache, lru_cache
from importlib.resources import files
from typing import Any

import numpy as np

from kvhal.backend_util import format_table
from kvhal.errors import KVHalError

ENV_DEVICE = "KVHAL_OPENCL_DEVICE"
INSTALL_HINT = (
    "for the CPU, install PoCL: apt-get install pocl-opencl-icd ocl-icd-libopencl1 "
    "(or pip install pocl-binary-distribution); for a GPU, install its vendor's OpenCL ICD"
)
CPU_ITEMS_PER_CU = 4  # store/load/copy on CPUs: this many contiguous chunks per compute unit


class OpenCLBuildError(KVHalError):
    """An OpenCL program failed to build on the selected device (the message carries the build log)."""


# ---- choosing a device -------------------------------------------------------------------------------


def _devices(cl: Any) -> list[tuple[str, Any]]:
    """("platform:device", device) for every device of every platform."""
    out: list[tuple[str, Any]] = []
    for p, platform in enumerate(cl.get_platforms()):
        try:
            devs = platform.get_devices()
        except cl.Error:  # a platform with no devices raises DEVICE_NOT_FOUND
            devs = []
        out.extend((f"{p}:{d}", dev) for d, dev in enumerate(devs))
    return out


def describe(index: str, dev: Any) -> str:
    return f"[{index}] {dev.name.strip()} ({dev.platform.name.strip()})"


def kind_rank(cl: Any, dev: Any) -> int:
    """0 GPU, 1 accelerator, 2 CPU: the default order and the index into the probe's scores."""
    t = dev.type
    return 0 if t & cl.device_type.GPU else 1 if t & cl.device_type.ACCELERATOR else 2


@lru_cache(maxsize=8)
def select(selector: str) -> tuple[Any, str] | str:
    """The chosen device and its "p:d" index, or why there is none."""
    if importlib.util.find_spec("pyopencl") is None:
        return "pyopencl is not installed (pip install pyopencl, or install kvhal-opencl with its dependencies)"
    try:
        import pyopencl as cl
    except ImportError as e:  # a source build of pyopencl links the system's libOpenCL
        return f"pyopencl is installed but does not import ({e}); {INSTALL_HINT}"
    try:
        found = _devices(cl)
    except cl.Error as e:  # the ICD loader found no platform at all
        return f"no OpenCL platform found ({e}): no ICD is registered in /etc/OpenCL/vendors; {INSTALL_HINT}"
    return choose(cl, found, selector)


def choose(cl: Any, found: list[tuple[str, Any]], selector: str) -> tuple[Any, str] | str:
    """Apply a selector (empty: the first GPU, else accelerator, else CPU) to ``found``."""
    if not found:
        return f"OpenCL platforms are installed but report no devices; {INSTALL_HINT}"
    if not selector:
        index, dev = min(found, key=lambda f: kind_rank(cl, f[1]))  # min is stable: first of the best kind
        return dev, index
    if ":" in selector and selector.replace(":", "").isdigit():
        match = [f for f in found if f[0] == selector]
    else:
        s = selector.lower()
        match = [f for f in found if s in f[1].name.lower() or s in f[1].platform.name.lower()]
    if not match:
        listing = "; ".join(describe(i, d) for i, d in found)
        return f"{ENV_DEVICE}={selector!r} matches no OpenCL device; devices here: {listing}"
    return match[0][1], match[0][0]


# ---- kernel sources ----------------------------------------------------------------------------------


@cache
def source(name: str) -> str:
    return (files(__package__) / "kernels" / name).read_text()


@cache
def format_header() -> str:
    """``#define``s of every format's block length and bytes, generated from the registry's table:
    the kernels take their block sizes from here, never from constants of their own."""
    lines = ["// generated from kvhal.backend_util.format_table()"]
    for name, fid, block_len, block_bytes in format_table():
        lines += [
            f"#define FMT_ID_{name} {fid}",
            f"#define BLOCK_LEN_{name} {block_len}",
            f"#define BLOCK_BYTES_{name} {block_bytes}",
        ]
    return "\n".join(lines) + "\n"


# ---- one device's runtime ----------------------------------------------------------------------------


class Device:
    """Context, in-order queue, allocator and program cache of one device, shared by every backend
    instance and every cache on it. ``lock`` serialises what is not thread-safe: kernel arguments
    (set on shared kernel objects, then enqueued), the memory pool and the program cache."""

    def __init__(self, cl: Any, device: Any, index: str) -> None:
        import pyopencl.tools

        self.cl, self.device, self.index = cl, device, index
        self.name = device.name.strip()
        self.lock = threading.RLock()
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)  # in order: a mempool buffer is reusable once freed
        self.alloc = pyopencl.tools.MemoryPool(pyopencl.tools.ImmediateAllocator(self.queue))
        self.programs: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.local: dict[Any, int] = {}
        self.is_cpu = bool(device.type & cl.device_type.CPU)
        self.units = int(device.max_compute_units)
        self.max_alloc = int(device.max_mem_alloc_size)
        fp = device.single_fp_config
        if fp & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
            self.div_options: list[str] | None = ["-cl-fp32-correctly-rounded-divide-sqrt"]
        elif "cl_khr_fp64" in device.extensions:
            self.div_options = ["-DKVHAL_DIV_FP64"]
        else:
            self.div_options = None  # no exact float32 division: quantized stores cannot match numpy
        self.ftz = ["-DKVHAL_FTZ"] if not fp & cl.device_fp_config.DENORM else []

    def build(self, key: tuple[Any, ...], sources: tuple[str, ...], defines: dict[str, Any]) -> dict[str, Any]:
        """The kernels of ``format_header() + sources`` built with ``defines``, once per key."""
        with self.lock:
            kernels = self.programs.get(key)
            if kernels is None:
                src = format_header() + "\n".join(source(s) for s in sources)
                opts = [f"-D{k}={v}" for k, v in defines.items()] + (self.div_options or []) + self.ftz
                try:
                    prog = self.cl.Program(self.ctx, src).build(options=opts)
                except self.cl.Error as e:
                    raise OpenCLBuildError(
                        f"building {'+'.join(sources)} for {self.name} with {' '.join(opts)} failed: {e}; "
                        f"try another device ({ENV_DEVICE}), or report it with this build log"
                    ) from e
                kernels = {k.function_name: k for k in prog.all_kernels()}
                self.programs[key] = kernels
            return kernels

    def launch(self, knl: Any, n_units: int, args_before: list[Any], args_after: list[Any]) -> None:
        """Run ``knl(*args_before, n_units, chunk, *args_after)`` over ``n_units`` work units.

        CPUs get a few contiguous chunks per compute unit (one work item each); GPUs one unit per
        work item in work groups sized from the kernel's preferred multiple.
        """
        if n_units == 0:
            return
        if self.is_cpu:
            chunk = -(-n_units // min(n_units, self.units * CPU_ITEMS_PER_CU))
            items, local = -(-n_units // chunk), 1
        else:
            chunk, local = 1, self.local_size(knl)
            items = n_units
        glob = -(-items // local) * local
        with self.lock:
            knl(self.queue, (glob,), (local,), *args_before, np.int32(n_units), np.int32(chunk), *args_after)

    def local_size(self, knl: Any) -> int:
        with self.lock:
            size = self.local.get(knl)
            if size is None:
                info = self.cl.kernel_work_group_info
                most = knl.get_work_group_info(info.WORK_GROUP_SIZE, self.device)
                multiple = knl.get_work_group_info(info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, self.device)
                size = self.local[knl] = max(1, min(most, 4 * multiple))
            return size


_DEVICES: dict[int, Device] = {}
_DEVICES_LOCK = threading.Lock()


def runtime(cl: Any, dev: Any, index: str) -> Device:
    """The one shared runtime of ``dev`` in this process."""
    with _DEVICES_LOCK:
        if dev.int_ptr not in _DEVICES:
            _DEVICES[dev.int_ptr] = Device(cl, dev, index)
        return _DEVICES[dev.int_ptr]
