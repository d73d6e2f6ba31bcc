"""kvhal's OpenCL backend: pyopencl with ``.cl`` kernels (kernels/), for OpenCL GPUs and CPUs (PoCL).

Pools are uint8 ``pyopencl.array.Array`` s in kvhal's pool layout, byte-identical to the reference.
Device: ``KVHAL_OPENCL_DEVICE`` (or the ``device=`` backend option) is ``"platform:device"`` indices
or a case-insensitive substring of the device or platform name; by default the first GPU, else the
first accelerator, else the first CPU device. Programs are built once per device and cache shape and
shared by every backend instance on that device; pyopencl adds its own on-disk binary cache.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib.resources import files
from typing import Any, ClassVar

import numpy as np

from kvhal import formats
from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, CapacityError, DTypeError, KVHalError, UnsupportedError
from kvhal.formats import Format
from kvhal.interop import host_float_array
from kvhal.spec import CacheSpec

ENV_DEVICE = "KVHAL_OPENCL_DEVICE"
INSTALL_HINT = (
    "for the CPU, install PoCL: apt-get install pocl-opencl-icd ocl-icd-libopencl1 "
    "(or pip install pocl-binary-distribution); for a GPU, install its vendor's OpenCL ICD"
)
FLOAT_FORMATS = ("f32", "f16", "bf16")
TILE = 16  # tokens per online-softmax step (page-local)
MIN_SPLIT_TOKENS = 64  # no KV split shorter than this: merging partials would cost more than it saves
# private floats per attention work item for q and acc of its QT heads: CPUs keep them in cache,
# GPUs in registers
QT_BUDGET = {True: 1024, False: 128}
SPLIT_TARGET = {True: 4, False: 256}  # work items per compute unit that attention aims for
CPU_ITEMS_PER_CU = 4  # store/load/copy on CPUs: this many contiguous chunks per compute unit


class OpenCLBuildError(KVHalError):
    """An OpenCL program failed to build on the selected device (the message carries the build log)."""


# ---- device discovery (shared by probe and __init__) ----------------------------------------------


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


def _describe(index: str, dev: Any) -> str:
    return f"[{index}] {dev.name.strip()} ({dev.platform.name.strip()})"


def _kind_rank(cl: Any, dev: Any) -> int:
    t = dev.type
    return 0 if t & cl.device_type.GPU else 1 if t & cl.device_type.ACCELERATOR else 2


@lru_cache(maxsize=8)
def _select(selector: str) -> tuple[Any, str] | str:
    """The chosen device and its "p:d" index, or why there is none (text for unavailable_reason)."""
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
    return _choose(cl, found, selector)


def _choose(cl: Any, found: list[tuple[str, Any]], selector: str) -> tuple[Any, str] | str:
    """Apply ``KVHAL_OPENCL_DEVICE`` (empty: the first GPU, else accelerator, else CPU) to ``found``."""
    if not found:
        return f"OpenCL platforms are installed but report no devices; {INSTALL_HINT}"
    if not selector:
        index, dev = min(found, key=lambda f: _kind_rank(cl, f[1]))  # min is stable: first of the best kind
        return dev, index
    if ":" in selector and selector.replace(":", "").isdigit():
        match = [f for f in found if f[0] == selector]
    else:
        s = selector.lower()
        match = [f for f in found if s in f[1].name.lower() or s in f[1].platform.name.lower()]
    if not match:
        listing = "; ".join(_describe(i, d) for i, d in found)
        return f"{ENV_DEVICE}={selector!r} matches no OpenCL device; devices here: {listing}"
    return match[0][1], match[0][0]


@dataclass
class _Device:
    """Context, in-order queue, allocator and program cache of one device, shared by all instances."""

    cl: Any
    device: Any
    index: str
    ctx: Any = field(init=False)
    queue: Any = field(init=False)
    alloc: Any = field(init=False)
    programs: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict, init=False)
    local: dict[Any, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        import pyopencl.tools

        cl, dev = self.cl, self.device
        self.ctx = cl.Context([dev])
        self.queue = cl.CommandQueue(self.ctx)  # in order: a mempool buffer is reusable once freed
        self.alloc = pyopencl.tools.MemoryPool(pyopencl.tools.ImmediateAllocator(self.queue))
        self.is_cpu = bool(dev.type & cl.device_type.CPU)
        self.units = int(dev.max_compute_units)
        fp = dev.single_fp_config
        if fp & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
            self.div_options: list[str] | None = ["-cl-fp32-correctly-rounded-divide-sqrt"]
        elif "cl_khr_fp64" in dev.extensions:
            self.div_options = ["-DKVHAL_DIV_FP64"]
        else:
            self.div_options = None  # no exact float32 division: quantized stores cannot match numpy
        self.ftz = ["-DKVHAL_FTZ"] if not fp & cl.device_fp_config.DENORM else []

    def build(self, key: tuple[Any, ...], sources: tuple[str, ...], defines: dict[str, Any]) -> dict[str, Any]:
        kernels = self.programs.get(key)
        if kernels is None:
            src = "\n".join(_source(s) for s in sources)
            opts = [f"-D{k}={v}" for k, v in defines.items()] + (self.div_options or []) + self.ftz
            try:
                prog = self.cl.Program(self.ctx, src).build(options=opts)
            except self.cl.Error as e:
                raise OpenCLBuildError(
                    f"building {'+'.join(sources)} for {self.device.name.strip()} with {' '.join(opts)} failed: {e}; "
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
        if self.is_cpu:
            chunk = -(-n_units // min(n_units, self.units * CPU_ITEMS_PER_CU))
            items, local = -(-n_units // chunk), 1
        else:
            chunk, local = 1, self.local_size(knl)
            items = n_units
        glob = -(-items // local) * local
        knl(self.queue, (glob,), (local,), *args_before, np.int32(n_units), np.int32(chunk), *args_after)

    def local_size(self, knl: Any) -> int:
        size = self.local.get(knl)
        if size is None:
            info = self.cl.kernel_work_group_info
            most = knl.get_work_group_info(info.WORK_GROUP_SIZE, self.device)
            multiple = knl.get_work_group_info(info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, self.device)
            size = self.local[knl] = max(1, min(most, 4 * multiple))
        return size


_DEVICES: dict[int, _Device] = {}


@cache
def _source(name: str) -> str:
    return (files(__name__) / "kernels" / name).read_text()


class OpenCLBackend(Backend):
    name = "opencl"
    formats = frozenset(formats.names())
    # f32 accumulation with exp2 and split-K merging, against float64 on unit-scale inputs
    attention_tolerance: ClassVar[float] = 2e-5

    @classmethod
    def probe(cls) -> Probe | None:
        found = _select(os.environ.get(ENV_DEVICE, "").strip())
        if isinstance(found, str):
            return None
        import pyopencl as cl

        dev, index = found
        rank = _kind_rank(cl, dev)
        kind = ("GPU", "accelerator", "CPU")[rank]
        reason = f"OpenCL {kind} {dev.name.strip()} on {dev.platform.name.strip()} ({dev.opencl_c_version.strip()})"
        if not dev.single_fp_config & cl.device_fp_config.DENORM:
            # a flushed subnormal scale quantizes to zeros where numpy keeps the quants (same values)
            reason += "; flushes float32 subnormals: blocks with |x| < 1.5e-36 may differ from the reference bytes"
        return Probe(score=(60, 40, 10)[rank], reason=reason, device=f"opencl:{index} {dev.name.strip()}")

    @classmethod
    def unavailable_reason(cls) -> str:
        found = _select(os.environ.get(ENV_DEVICE, "").strip())
        return found if isinstance(found, str) else "available"

    def __init__(self, device: str | None = None) -> None:
        selector = (device if device is not None else os.environ.get(ENV_DEVICE, "")).strip()
        found = _select(selector)
        if isinstance(found, str):
            raise BackendUnavailableError(f"backend 'opencl' is unavailable: {found}")
        import pyopencl as cl
        import pyopencl.array as cl_array

        self.cl, self.cl_array = cl, cl_array
        dev, index = found
        key = dev.int_ptr
        if key not in _DEVICES:
            _DEVICES[key] = _Device(cl, dev, index)
        self.dev = _DEVICES[key]

    # -- programs ----------------------------------------------------------------------------------

    def _shape_defines(self) -> dict[str, int]:
        s = self.spec
        return {"HEAD_DIM": s.head_dim, "N_KV_HEADS": s.n_kv_heads, "BLOCK_SIZE": s.block_size}

    def _codec(self, fmt: Format) -> dict[str, Any]:
        d = {"FMT": fmt.name, "ROW_BYTES": fmt.row_bytes(self.spec.head_dim), **self._shape_defines()}
        return self.dev.build(("codec", *d.values()), ("formats.cl", "codec.cl"), d)

    def _attention(self, group: int) -> tuple[dict[str, Any], int]:
        s = self.spec
        budget = QT_BUDGET[self.dev.is_cpu] // s.head_dim
        qt = max([t for t in range(1, group + 1) if group % t == 0 and t <= budget] or [1])
        d = {
            "K_FMT": s.k_format,
            "V_FMT": s.v_format,
            "K_ROW_BYTES": s.k_row_bytes,
            "V_ROW_BYTES": s.v_row_bytes,
            "GROUP": group,
            "QT": qt,
            "TILE": min(TILE, s.block_size),
            **self._shape_defines(),
        }
        return self.dev.build(("attention", *d.values()), ("formats.cl", "attention.cl"), d), qt

    @staticmethod
    def _units_per_row(fmt: Format, head_dim: int) -> int:
        return 1 if fmt.name in FLOAT_FORMATS else head_dim // fmt.block_len

    # -- arrays ------------------------------------------------------------------------------------

    def _ints(self, a: np.ndarray) -> Any:
        return self.cl_array.to_device(self.dev.queue, np.ascontiguousarray(a, np.int32), allocator=self.dev.alloc)

    def _f32(self, x: Any) -> Any:
        """``x`` as a contiguous float32 device array of this context (uploads host arrays)."""
        if isinstance(x, self.cl_array.Array) and x.context == self.dev.ctx and x.dtype == np.float32:
            return x if x.offset == 0 and x.flags.c_contiguous else x.copy()
        if isinstance(x, self.cl_array.Array):
            x = x.get()
        host = np.ascontiguousarray(x, np.float32)
        return self.cl_array.to_device(self.dev.queue, host, allocator=self.dev.alloc)

    def asarray(self, x: Any, what: str) -> Any:
        if isinstance(x, self.cl_array.Array):
            if x.dtype not in (np.float32, np.float16):
                raise DTypeError(f"{what} has dtype {x.dtype}; kvhal takes float32 or float16 (use .astype)")
            return x
        return host_float_array(x, what)

    def _empty(self, shape: tuple[int, ...]) -> Any:
        return self.cl_array.empty(self.dev.queue, shape, np.float32, allocator=self.dev.alloc)

    # -- the contract --------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        quantized = sorted({spec.k_format, spec.v_format} - set(FLOAT_FORMATS))
        if quantized and self.dev.div_options is None:
            raise UnsupportedError(
                f"{self.dev.device.name.strip()} has neither correctly rounded float32 division nor cl_khr_fp64, "
                f"so its {', '.join(quantized)} blocks could not match the reference bytes; use f16/bf16/f32 "
                f"here, another device ({ENV_DEVICE}), or another backend"
            )
        limit = int(self.dev.device.max_mem_alloc_size)
        pools = []
        for _ in range(spec.n_layers):
            k_shape, v_shape = spec.pool_shape(n_blocks, "k"), spec.pool_shape(n_blocks, "v")
            if max(math.prod(k_shape), math.prod(v_shape)) > limit:
                raise CapacityError(
                    f"one layer's pool of {math.prod(k_shape)} bytes exceeds {self.dev.device.name.strip()}'s "
                    f"largest buffer ({limit} bytes); lower capacity_tokens"
                )
            k = self.cl_array.zeros(self.dev.queue, k_shape, np.uint8)
            v = self.cl_array.zeros(self.dev.queue, v_shape, np.uint8)
            pools.append(LayerPools(k, v, k.nbytes + v.nbytes))
        return pools

    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        s = self.spec
        slots_d = self._ints(slots)
        for pool, x, fmt in ((pools.k, k, s.k_fmt), (pools.v, v, s.v_fmt)):
            xd = self._f32(x)
            n_units = int(xd.shape[0]) * s.n_kv_heads * self._units_per_row(fmt, s.head_dim)
            knl = self._codec(fmt)["store_rows"]
            self.dev.launch(knl, n_units, [xd.data, slots_d.data], [pool.data])

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        s = self.spec
        k, v = (self._empty((n, s.n_kv_heads, s.head_dim)) for _ in range(2))
        if n:
            ids = self._ints(block_ids)
            for pool, fmt, y in ((pools.k, s.k_fmt, k), (pools.v, s.v_fmt, v)):
                n_units = n * s.n_kv_heads * self._units_per_row(fmt, s.head_dim)
                self.dev.launch(self._codec(fmt)["load_rows"], n_units, [pool.data, ids.data], [y.data])
        return k, v

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        s = self.spec
        if len(src) == 0:
            return
        src_d, dst_d = self._ints(src), self._ints(dst)
        n_rows = len(src) * s.n_kv_heads
        for pool, fmt in ((pools.k, s.k_fmt), (pools.v, s.v_fmt)):
            kernels = self._codec(fmt)
            rows = self.cl_array.empty(
                self.dev.queue, n_rows * fmt.row_bytes(s.head_dim), np.uint8, allocator=self.dev.alloc
            )
            self.dev.launch(kernels["gather_rows"], n_rows, [pool.data, src_d.data], [rows.data])
            self.dev.launch(kernels["scatter_rows"], n_rows, [rows.data, dst_d.data], [pool.data])

    def attention(
        self,
        q: Any,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> Any:
        s, dev = self.spec, self.dev
        n_rows, n_heads = int(q.shape[0]), int(q.shape[1])
        group = n_heads // s.n_kv_heads
        kernels, qt = self._attention(group)
        # each query row's visible KV range [lo, hi), straight from the conventions in kvhal/backend.py
        seq = np.repeat(np.arange(len(q_lens)), q_lens)
        first = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        pos = seq_lens[seq] - q_lens[seq] + (np.arange(n_rows) - first)
        hi = pos + 1 if causal else seq_lens[seq]
        lo = np.maximum(0, pos - window + 1) if window is not None else np.zeros_like(pos)
        rows = self._ints(np.stack([seq, lo, hi], axis=1))
        table = self._ints(block_table)
        qd = self._f32(q)
        out = self._empty((n_rows, n_heads, s.head_dim))

        items = n_rows * s.n_kv_heads * (group // qt)
        longest = int((hi - lo).max())
        splits = max(1, min(-(-SPLIT_TARGET[dev.is_cpu] * dev.units // items), -(-longest // MIN_SPLIT_TOKENS)))
        if splits > 1:
            part_acc = self._empty((splits, n_rows, n_heads, s.head_dim))
            part_ml = self._empty((splits, n_rows, n_heads, 2))
        else:
            part_acc = part_ml = out  # unused by the kernel when n_splits == 1
        local = 1 if dev.is_cpu else dev.local_size(kernels["attention"])
        kernels["attention"](
            dev.queue, (-(-items // local) * local, splits), (local, 1),
            qd.data, pools.k.data, pools.v.data, table.data, np.int32(block_table.shape[1]), rows.data,
            np.float32(scale * math.log2(math.e)), np.int32(n_rows), np.int32(splits),
            out.data, part_acc.data, part_ml.data,
        )  # fmt: skip
        if splits > 1:
            merge = kernels["attention_merge"]
            n = n_rows * n_heads
            local = 1 if dev.is_cpu else dev.local_size(merge)
            merge(
                dev.queue,
                (-(-n // local) * local,),
                (local,),
                part_acc.data,
                part_ml.data,
                np.int32(n_rows),
                np.int32(splits),
                out.data,
            )
        return out

    def synchronize(self) -> None:
        self.dev.queue.finish()
