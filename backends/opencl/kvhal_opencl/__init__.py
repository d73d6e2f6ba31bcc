"""kvhal's OpenCL backend: pyopencl with ``.cl`` kernels (kernels/), for OpenCL GPUs and CPUs (PoCL).

Pools are uint8 ``pyopencl.array.Array`` s in kvhal's pool layout, byte-identical to the reference.
Device: the ``device`` option (env ``KVHAL_OPENCL_DEVICE``) is ``"platform:device"`` indices or a
case-insensitive substring of the device or platform name; by default the first GPU, else the first
accelerator, else the first CPU device. Every instance on a device shares its context, queue and
programs (:mod:`kvhal_opencl.device`); each cache's kernels and shape live in its ``Pools.state``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvhal import formats
from kvhal.backend import AttentionBatch, AttentionShape, Backend, Op, Pools, Probe
from kvhal.backend_util import Option, check_block_data, parse_options
from kvhal.errors import BackendUnavailableError, CapacityError, PositionError, ShapeError, SpecError
from kvhal.formats import Format
from kvhal.interop import host_float_array
from kvhal.spec import CacheSpec

from .device import ENV_DEVICE, Device, OpenCLBuildError, kind_rank, runtime, select

OPTIONS = (Option("device", str, "", env=ENV_DEVICE, help="'platform:device' indices or a device/platform name"),)
TILE = 16  # tokens per online-softmax step (page-local)
MIN_SPLIT_TOKENS = 64  # no KV split shorter than this: merging partials would cost more than it saves
# private floats per attention work item for q and acc of its QT heads: CPUs keep them in cache,
# GPUs in registers
QT_BUDGET = {True: 1024, False: 128}
SPLIT_TARGET = {True: 4, False: 256}  # work items per compute unit that attention aims for


def _units_per_row(fmt: Format, head_dim: int) -> int:
    """Work units of a row in codec.cl: one per block, or the whole row for unblocked (float) formats."""
    return 1 if fmt.block_len == 1 else head_dim // fmt.block_len


@dataclass
class _Plan:
    """One cache's kernels: the codec programs of its K and V formats, attention per GQA group."""

    shape: dict[str, int]
    k_codec: dict[str, Any]
    v_codec: dict[str, Any]
    attention: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)


class OpenCLBackend(Backend):
    name = "opencl"
    formats = frozenset(formats.GGML_CLASSIC)  # its kernels implement the ggml KV formats only
    # f32 accumulation with exp2 and split-K merging, against float64 on unit-scale inputs
    attention_tolerance: ClassVar[float] = 2e-5

    @classmethod
    def probe(cls) -> Probe:
        try:
            selector = parse_options(cls.name, {}, OPTIONS)["device"]
        except SpecError as e:  # its variable's value: this process's settings (auto must not pass it over)
            return Probe(None, str(e), misconfigured=True)
        found = select(selector)
        if isinstance(found, str):
            return Probe(None, found)
        import pyopencl as cl

        dev, index = found
        rank = kind_rank(cl, dev)
        kind = ("GPU", "accelerator", "CPU")[rank]
        reason = f"OpenCL {kind} {dev.name.strip()} on {dev.platform.name.strip()} ({dev.opencl_c_version.strip()})"
        if not dev.single_fp_config & cl.device_fp_config.DENORM:
            # a flushed subnormal scale quantizes to zeros where numpy keeps the quants (same values)
            reason += "; flushes float32 subnormals: blocks with |x| < 1.5e-36 may differ from the reference bytes"
        return Probe(score=(60, 40, 10)[rank], reason=reason, device=f"opencl:{index} {dev.name.strip()}")

    def __init__(self, **options: Any) -> None:
        selector = parse_options(self.name, options, OPTIONS)["device"]
        found = select(selector)
        if isinstance(found, str):
            raise BackendUnavailableError(f"backend 'opencl' is unavailable: {found}")
        import pyopencl as cl
        import pyopencl.array as cl_array

        self.cl_array = cl_array
        self.dev: Device = runtime(cl, *found)

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        why = super().supports(spec, op, shape)
        if why is not None:
            return why
        quantized = sorted({f.name for f in (spec.k_fmt, spec.v_fmt) if f.block_len > 1})
        if quantized and self.dev.div_options is None:
            return (
                f"{self.dev.name} has neither correctly rounded float32 division nor cl_khr_fp64, so its "
                f"{', '.join(quantized)} blocks could not match the reference bytes; use f16/bf16/f32 here, "
                f"another device ({ENV_DEVICE}), or another backend"
            )
        if spec.block_nbytes > self.dev.max_alloc:  # raw block I/O stages whole blocks in one buffer
            return (
                f"one block (all layers) of {spec.block_nbytes} bytes exceeds {self.dev.name}'s largest buffer "
                f"({self.dev.max_alloc} bytes); lower block_size"
            )
        return None

    # -- programs ----------------------------------------------------------------------------------

    def _codec(self, shape: dict[str, int], fmt: Format) -> dict[str, Any]:
        d = {"FMT": fmt.name, "ROW_BYTES": fmt.row_bytes(shape["HEAD_DIM"]), **shape}
        return self.dev.build(("codec", *d.values()), ("formats.cl", "codec.cl"), d)

    def _attention(self, pools: Pools, group: int) -> tuple[dict[str, Any], int]:
        plan: _Plan = pools.state
        with self.dev.lock:
            found = plan.attention.get(group)
            if found is None:
                s = pools.spec
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
                    **plan.shape,
                }
                kernels = self.dev.build(("attention", *d.values()), ("formats.cl", "attention.cl"), d)
                found = plan.attention[group] = (kernels, qt)
            return found

    def _blocks(self) -> dict[str, Any]:
        return self.dev.build(("blocks",), ("blocks.cl",), {})

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
        """Float32/float16 device arrays as they are; everything else (and its dtype errors) as the core does."""
        if isinstance(x, self.cl_array.Array) and x.dtype in (np.float32, np.float16):
            return x
        return host_float_array(x, what)

    def _empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self.cl_array.empty(self.dev.queue, shape, dtype, allocator=self.dev.alloc)

    # -- the contract --------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        k_shape, v_shape = spec.pool_shape(n_blocks, "k"), spec.pool_shape(n_blocks, "v")
        largest = max(math.prod(k_shape), math.prod(v_shape))
        if largest > self.dev.max_alloc:
            raise CapacityError(
                f"one layer's pool of {largest} bytes exceeds {self.dev.name}'s largest buffer "
                f"({self.dev.max_alloc} bytes); lower capacity_tokens"
            )
        shape = {"HEAD_DIM": spec.head_dim, "N_KV_HEADS": spec.n_kv_heads, "BLOCK_SIZE": spec.block_size}
        plan = _Plan(shape, self._codec(shape, spec.k_fmt), self._codec(shape, spec.v_fmt))
        with self.dev.lock:
            k = [self.cl_array.zeros(self.dev.queue, k_shape, np.uint8) for _ in range(spec.n_layers)]
            v = [self.cl_array.zeros(self.dev.queue, v_shape, np.uint8) for _ in range(spec.n_layers)]
        return Pools(spec, n_blocks, k, v, sum(a.nbytes for a in k + v), plan)

    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        s, plan = pools.spec, pools.state
        with self.dev.lock:
            slots_d = self._ints(slots)
            for pool, x, fmt, codec in (
                (pools.k[layer], k, s.k_fmt, plan.k_codec),
                (pools.v[layer], v, s.v_fmt, plan.v_codec),
            ):
                xd = self._f32(x)
                n_units = int(xd.shape[0]) * s.n_kv_heads * _units_per_row(fmt, s.head_dim)
                self.dev.launch(codec["store_rows"], n_units, [xd.data, slots_d.data], [pool.data])

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        s, plan = pools.spec, pools.state
        with self.dev.lock:
            n = n if len(block_ids) else 0
            k, v = (self._empty((n, s.n_kv_heads, s.head_dim)) for _ in range(2))
            if n:
                ids = self._ints(block_ids)
                for pool, fmt, codec, y in (
                    (pools.k[layer], s.k_fmt, plan.k_codec, k),
                    (pools.v[layer], s.v_fmt, plan.v_codec, v),
                ):
                    n_units = n * s.n_kv_heads * _units_per_row(fmt, s.head_dim)
                    self.dev.launch(codec["load_rows"], n_units, [pool.data, ids.data], [y.data])
        return k, v

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        s, plan = pools.spec, pools.state
        if len(src) == 0:
            return
        n_rows = len(src) * s.n_kv_heads
        with self.dev.lock:
            src_d, dst_d = self._ints(src), self._ints(dst)
            for pool, fmt, codec in ((pools.k[layer], s.k_fmt, plan.k_codec), (pools.v[layer], s.v_fmt, plan.v_codec)):
                rows = self._empty((n_rows * fmt.row_bytes(s.head_dim),), np.uint8)
                self.dev.launch(codec["gather_rows"], n_rows, [pool.data, src_d.data], [rows.data])
                self.dev.launch(codec["scatter_rows"], n_rows, [rows.data, dst_d.data], [pool.data])

    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> Any:
        s, dev = pools.spec, self.dev
        n_rows, n_heads = int(q.shape[0]), int(q.shape[1])
        group = n_heads // s.n_kv_heads
        kernels, qt = self._attention(pools, group)
        seq, _, lo, hi = batch.visible
        items = n_rows * s.n_kv_heads * (group // qt)
        longest = int((hi - lo).max())
        splits = max(1, min(-(-SPLIT_TARGET[dev.is_cpu] * dev.units // max(1, items)), -(-longest // MIN_SPLIT_TOKENS)))
        with dev.lock:
            rows = self._ints(np.stack([seq, lo, hi], axis=1))
            table = self._ints(batch.block_table)
            qd = self._f32(q)
            out = self._empty((n_rows, n_heads, s.head_dim))
            if splits > 1:
                part_acc = self._empty((splits, n_rows, n_heads, s.head_dim))
                part_ml = self._empty((splits, n_rows, n_heads, 2))
            else:
                part_acc = part_ml = out  # unused by the kernel when n_splits == 1
            local = 1 if dev.is_cpu else dev.local_size(kernels["attention"])
            kernels["attention"](
                dev.queue, (-(-items // local) * local, splits), (local, 1),
                qd.data, pools.k[layer].data, pools.v[layer].data, table.data, np.int32(batch.block_table.shape[1]),
                rows.data, np.float32(batch.scale * math.log2(math.e)), np.int32(n_rows), np.int32(splits),
                out.data, part_acc.data, part_ml.data,
            )  # fmt: skip
            if splits > 1:
                merge = kernels["attention_merge"]
                n = n_rows * n_heads
                local = 1 if dev.is_cpu else dev.local_size(merge)
                merge(
                    dev.queue, (-(-n // local) * local,), (local,),
                    part_acc.data, part_ml.data, np.int32(n_rows), np.int32(splits), out.data,
                )  # fmt: skip
        return out

    # -- raw blocks: per pool one gather (or scatter) launch over all listed blocks, one transfer ----------

    @staticmethod
    def _check_ids(pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= pools.n_blocks)):
            raise PositionError(f"block ids must be ints in [0, {pools.n_blocks}), got {ids!r}")
        return ids

    def _batches(self, pools: Pools, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(start, ids)`` batches whose staging buffer fits the device's largest buffer (one batch in practice)."""
        step = max(1, self.dev.max_alloc // pools.spec.block_nbytes)
        return [(a, ids[a : a + step]) for a in range(0, ids.size, step)]

    def _move_pages(self, pools: Pools, kernel: str, ids: np.ndarray, staging: Any) -> None:
        """``gather_pages`` every pool's pages of ``ids`` into ``staging`` [n, block_nbytes], or
        ``scatter_pages`` them back, each pool at its offset in the raw block layout."""
        s = pools.spec
        rows_per_page = s.n_kv_heads * s.block_size
        knl, ids_d, at = self._blocks()[kernel], self._ints(ids), 0
        for k, v in zip(pools.k, pools.v):
            for pool, rb in ((k, s.k_row_bytes), (v, s.v_row_bytes)):
                src, dst = (pool, staging) if kernel == "gather_pages" else (staging, pool)
                layout = [np.int32(rb), np.int32(rows_per_page), np.uint64(s.block_nbytes), np.uint64(at)]
                self.dev.launch(knl, ids.size * rows_per_page, [src.data, ids_d.data], [dst.data, *layout])
                at += rows_per_page * rb

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        ids = self._check_ids(pools, block_ids)
        out = np.empty((ids.size, pools.spec.block_nbytes), np.uint8)
        with self.dev.lock:
            for a, part in self._batches(pools, ids):
                staging = self._empty((part.size, pools.spec.block_nbytes), np.uint8)
                self._move_pages(pools, "gather_pages", part, staging)
                staging.get(ary=out[a : a + part.size])
        return out

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        data = check_block_data(pools.spec, data)
        ids = self._check_ids(pools, block_ids)
        if ids.size != data.shape[0]:
            raise ShapeError(f"{ids.size} block ids for {data.shape[0]} blocks of data; pass one id per block")
        with self.dev.lock:
            for a, part in self._batches(pools, ids):
                host = np.ascontiguousarray(data[a : a + part.size])
                staging = self.cl_array.to_device(self.dev.queue, host, allocator=self.dev.alloc)
                self._move_pages(pools, "scatter_pages", part, staging)

    def synchronize(self) -> None:
        self.dev.queue.finish()


__all__ = ["ENV_DEVICE", "OPTIONS", "OpenCLBackend", "OpenCLBuildError"]
