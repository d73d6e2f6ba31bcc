"""kvhal's CUDA and ROCm backends: one kernel source (kernels/kvhal.cu) run through cupy.

``cuda`` runs under cupy-cuda12x or cupy-cuda13x, whichever is installed, and loads the prebuilt
cubin/PTX for the device's arch (kvhal_cuda/prebuilt/, shipped in the kvhal-cuda12/13 wheels), compiling
with NVRTC only for an arch with none. ``rocm`` is the same source through HIP (cupy on ROCm).
Launch geometry, spec limits and metadata packing live in ``plan`` (tested on the CPU), cupy glue in
``runtime``; the kernel source with its generated constants in ``source``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvhal import formats
from kvhal.backend import AttentionBatch, AttentionShape, Backend, Op, Pools, Probe
from kvhal.backend_util import (
    Option,
    check_block_data,
    check_block_ids,
    logsumexp,
    non_negative,
    one_of,
    parse_options,
    whole_pages,
)
from kvhal.errors import DTypeError, SpecError
from kvhal.interop import host_float_array
from kvhal.spec import CacheSpec

from . import plan, sdpa

__all__ = ["CudaBackend", "RocmBackend"]
__version__ = "0.1.0"

_i32 = np.int32
_i64 = np.int64
_f32 = np.float32


@dataclass(frozen=True)
class CacheState:
    """``Pools.state`` of one cache: its kernel plan and, for raw block I/O, a device table of its pool
    addresses (``[2 * n_layers]`` uint64: each layer's K pool, then its V pool)."""

    plan: plan.CachePlan
    pool_table: Any


class CudaBackend(Backend):
    name = "cuda"
    platform: ClassVar[str] = "cuda"
    formats = frozenset(formats.plain_names())  # every block format (kivi K per channel included); not kltq
    # f32 accumulation with split-KV: under the CPU emulator the contract cases stay below 3e-6; the margin
    # covers the GPU's expf/logf rounding, which the emulator does not reproduce
    attention_tolerance = 1e-4
    fused = frozenset({"attention_lse"})
    _no_sdpa: str | None = None  # why prefill="sdpa" cannot run here (no torch); set per instance
    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("device", int, 0, env="KVHAL_CUDA_DEVICE", check=non_negative, help="CUDA device index"),
        Option(
            "prefill", str, "sdpa", env="KVHAL_CUDA_PREFILL", check=one_of("sdpa", "kernel"),
            help="sequences of more than one query: sdpa (dequantize to bf16, torch SDPA; needs kvhal-cuda[torch]) "
            "or kernel (kvhal.cu's own prefill, f32)",
        ),
    )  # fmt: skip

    @classmethod
    def probe(cls) -> Probe:
        from . import runtime

        try:
            device = parse_options(cls.name, {}, cls.OPTIONS)["device"]
        except SpecError as e:  # a bad KVHAL_CUDA_DEVICE: unusable, and the reason says which
            return Probe(None, str(e))
        return runtime.probe(cls.platform, device)

    def __init__(self, **options: Any) -> None:
        """Options: ``device`` (the device index; ``KVHAL_CUDA_DEVICE`` / ``KVHAL_ROCM_DEVICE`` when not given) and
        ``prefill`` ("sdpa" or "kernel"; ``KVHAL_CUDA_PREFILL`` / ``KVHAL_ROCM_PREFILL``)."""
        opts = parse_options(self.name, options, self.OPTIONS)
        self._rt = self._runtime(opts)
        self._xp = self._rt.xp
        self.prefill: str = opts["prefill"]
        # the SDPA route rounds q, K and V to bf16; decode and the kernel route stay at f32's figure
        self.prefill_tolerance = sdpa.TOLERANCE if self.prefill == "sdpa" else None
        # without torch the route refuses prefill shapes, so supports() is asked per call
        self._no_sdpa = sdpa.torch_missing() if self.prefill == "sdpa" else None
        self.shape_limits = self._no_sdpa is not None

    def _runtime(self, options: dict[str, Any]) -> Any:
        """The device runtime (kernel module and launches); the tests' emulator overrides this."""
        from . import runtime

        return runtime.CupyRuntime(options["device"], self.platform)

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        why = super().supports(spec, op, shape) or plan.spec_refusal(spec, op)
        # a spec with an f16 tail (sinks, K per channel) attends through attention_lse, on the kernels: no torch
        prefill = shape is not None and shape.max_q_len > 1 and not spec.uses_tail
        if why is None and self._no_sdpa and op == "attention" and prefill:
            return f"{self._no_sdpa}; or backend_options={{'prefill': 'kernel'}} for kvhal's own prefill kernel"
        return why

    # -- pools --------------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        cache_plan = plan.CachePlan.of(spec)
        xp = self._xp
        with self._rt.device:
            k = [xp.zeros(spec.pool_shape(n_blocks, "k"), xp.uint8) for _ in range(spec.n_layers)]
            v = [xp.zeros(spec.pool_shape(n_blocks, "v"), xp.uint8) for _ in range(spec.n_layers)]
            table = self._rt.pointer_table([p for kv in zip(k, v) for p in kv])
        nbytes = sum(int(a.nbytes) for a in k + v)
        return Pools(spec, n_blocks, k, v, nbytes, CacheState(cache_plan, table))

    # -- arrays -------------------------------------------------------------------------------------------

    def asarray(self, x: Any, what: str) -> Any:
        xp = self._xp
        if not isinstance(x, xp.ndarray) and not hasattr(x, "__cuda_array_interface__"):
            x = host_float_array(x, what)  # host input: checked on the host, copied once
        with self._rt.device:
            arr = xp.asarray(x)
        if arr.dtype not in (xp.float32, xp.float16):
            raise DTypeError(f"{what} has dtype {arr.dtype}; kvhal takes float32 or float16 (convert with .astype)")
        return arr

    def to_numpy(self, x: Any) -> np.ndarray:
        return self._rt.to_host(x)

    def check_values(self, fmt: formats.Format, x: Any) -> None:
        if x.size == 0:
            return
        xp = self._xp
        with self._rt.device:
            ok = bool(xp.isfinite(x).all()) and float(xp.abs(x).max()) <= fmt.max_abs
        if not ok:
            fmt.check_values(self.to_numpy(x))  # raises NonFiniteError with the offending value

    # -- kernels ------------------------------------------------------------------------------------------

    def _f32(self, x: Any) -> Any:
        return self._xp.ascontiguousarray(x, dtype=self._xp.float32)

    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        cp: plan.CachePlan = pools.state.plan
        n = int(k.shape[0])
        H, D = cp.n_kv_heads, cp.head_dim
        paged = pools.spec.k_paged
        if paged:
            whole_pages(slots, cp.block_size)  # says why the library would refuse them
        if n == 0:
            return
        with self._rt.device:
            slots_d = self._rt.to_device(np.ascontiguousarray(slots, np.int64))
            for x, pool, side in ((k, pools.k[layer], cp.k), (v, pools.v[layer], cp.v)):
                name, grid, block = plan.store_launch(side.fmt, n, H, D, cp.block_size if paged and side is cp.k else 0)
                args = (self._f32(x), slots_d, pool, _i32(n), _i32(H), _i32(D), _i32(cp.block_size),
                        _i32(side.row_bytes), _i32(side.fmt_id))  # fmt: skip
                self._rt.launch(name, grid, block, args)

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        cp: plan.CachePlan = pools.state.plan
        H, D = cp.n_kv_heads, cp.head_dim
        xp = self._xp
        with self._rt.device:
            out = (xp.empty((n, H, D), xp.float32), xp.empty((n, H, D), xp.float32))
            if n == 0:
                return out
            ids = self._rt.to_device(np.ascontiguousarray(block_ids, np.int32))
            grid, block = plan.grid_1d(n * H * D)
            for o, pool, side in ((out[0], pools.k[layer], cp.k), (out[1], pools.v[layer], cp.v)):
                args = (pool, ids, o, _i32(n), _i32(H), _i32(D), _i32(cp.block_size), _i32(side.row_bytes),
                        _i32(side.fmt_id))  # fmt: skip
                self._rt.launch("kvhal_load", grid, block, args)
        return out

    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> Any:
        return self._attention(q, pools, layer, batch, False)

    def attention_lse(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
        """The kernels' own log-sum-exp (what the cache merges with its f16 tail, e.g. under a per-channel K
        format): every split's partial output and lse are kept, merged by the kernel and, for lse, here."""
        q = self.asarray(q, "q")  # the cache passes host rows here: onto the device once, as attention takes them
        out, part_lse = self._attention(q, pools, layer, batch, True)
        return self.to_numpy(out), logsumexp(self.to_numpy(part_lse).astype(np.float64))  # over [n_splits, R, Hq]

    def _attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch, want_lse: bool) -> Any:
        if self.prefill == "sdpa" and not want_lse and (batch.q_lens > 1).any():
            return self._attention_sdpa(q, pools, layer, batch)
        return self._attention_kernel(q, pools, layer, batch, want_lse)

    def attention_path(self, spec: CacheSpec, n_heads: int, q_len: int) -> str:
        """What an attention call of ``q_len`` queries per sequence runs (``kvhal bench``'s path column): the decode
        kernel, torch SDPA over bf16 pages, or kvhal.cu's prefill kernel."""
        if q_len <= 1:
            return "kvhal-decode"
        # a spec with an f16 tail (sinks, K per channel) attends through attention_lse: kvhal.cu's prefill kernel
        return "sdpa-bf16" if self.prefill == "sdpa" and not spec.uses_tail else "kvhal-prefill"

    def _attention_sdpa(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> Any:
        """Sequences of one query through the decode kernel (one launch for all of them), each longer one through
        ``sdpa.attend`` over its visible pages dequantized to bf16 (``kvhal_load_bf16``)."""
        torch = sdpa.import_torch()
        cp: plan.CachePlan = pools.state.plan
        xp, bs = self._xp, cp.block_size
        q_lens = np.asarray(batch.q_lens, np.int64)
        starts = np.cumsum(q_lens) - q_lens
        with self._rt.device:
            qd = self._f32(q)
            out = xp.empty(qd.shape, xp.float32)
            one = np.flatnonzero(q_lens == 1)
            if one.size:
                sub = batch.with_(
                    block_table=batch.block_table[one], seq_lens=batch.seq_lens[one], q_lens=batch.q_lens[one]
                )
                rows = self._rt.to_device(starts[one])
                out[rows] = self._attention_kernel(qd[rows], pools, layer, sub, False)
            for i in np.flatnonzero(q_lens > 1):
                q0, q_len, seq_len = int(starts[i]), int(q_lens[i]), int(batch.seq_lens[i])
                lo, hi = sdpa.visible_span(seq_len, q_len, batch.causal, batch.window)
                first = lo // bs
                ids = np.asarray(batch.block_table[i, first : -(-hi // bs)])
                k, v = (sdpa.from_device(torch, x[lo - first * bs :].view(xp.int16)).view(torch.bfloat16)
                        for x in self._load_bf16(pools, layer, ids, hi - first * bs))  # fmt: skip
                tq = sdpa.from_device(torch, qd[q0 : q0 + q_len]).to(torch.bfloat16)
                o = sdpa.attend(torch, tq, k, v, kv_start=lo, seq_len=seq_len, scale=batch.scale,
                                causal=batch.causal, window=batch.window)  # fmt: skip
                out[q0 : q0 + q_len] = xp.from_dlpack(o.float().contiguous())
        return out

    def _load_bf16(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        """``load`` as bf16 bits (device uint16 ``[n, H, D]``, rounded to nearest even): the SDPA route's pass."""
        cp: plan.CachePlan = pools.state.plan
        xp = self._xp
        out = (
            xp.empty((n, cp.n_kv_heads, cp.head_dim), xp.uint16),
            xp.empty((n, cp.n_kv_heads, cp.head_dim), xp.uint16),
        )
        ids = self._rt.to_device(np.ascontiguousarray(block_ids, np.int32))
        grid, block = plan.grid_1d(n * cp.n_kv_heads * cp.head_dim)
        for o, pool, side in ((out[0], pools.k[layer], cp.k), (out[1], pools.v[layer], cp.v)):
            args = (pool, ids, o, _i32(n), _i32(cp.n_kv_heads), _i32(cp.head_dim), _i32(cp.block_size),
                    _i32(side.row_bytes), _i32(side.fmt_id))  # fmt: skip
            self._rt.launch("kvhal_load_bf16", grid, block, args)
        return out

    def _attention_kernel(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch, want_lse: bool) -> Any:
        cp: plan.CachePlan = pools.state.plan
        R, Hq, D = (int(d) for d in q.shape)
        pl = plan.plan_attention(
            batch.block_table, batch.seq_lens, batch.q_lens, n_heads=Hq, head_dim=D, block_size=cp.block_size,
            n_sm=self._rt.n_sm, causal=batch.causal, window=batch.window, geometry=cp.prefill,
            n_kv_heads=cp.n_kv_heads,
        )  # fmt: skip
        xp = self._xp
        with self._rt.device:
            qd = self._f32(q)
            out = xp.empty((R, Hq, D), xp.float32)
            meta = self._rt.to_device(pl.meta)
            # the kernels write partials (output and lse per split) when told of more than one split: with want_lse
            # a single split is announced as two, so its lse is kept (the grid still has one; only p = 0 is written)
            n_splits = max(pl.n_splits, 2) if want_lse else pl.n_splits
            if n_splits > 1:
                part_o = xp.empty((pl.n_splits, R, Hq, D), xp.float32)
                part_lse = xp.full((pl.n_splits, R, Hq), -np.inf, xp.float32)  # rows without a tile stay -inf
            else:  # never written with one split
                part_o, part_lse = out, out
            shape = (_i32(R), _i32(Hq), _i32(cp.n_kv_heads), _i32(D), _i32(cp.block_size), _i32(cp.k.row_bytes),
                     _i32(cp.v.row_bytes), _i32(cp.k.fmt_id), _i32(cp.v.fmt_id), _f32(batch.scale), _i32(pl.split_pages),
                     _i32(n_splits))  # fmt: skip
            block = (plan.NUM_WARPS * 32, 1, 1)
            ptrs = (qd, pools.k[layer], pools.v[layer], meta, out, part_o, part_lse)
            g = pl.prefill
            for name, grid, smem in plan.attention_launches(pl, Hq, D, cp.k.row_bytes):
                if name == "kvhal_attn_decode":
                    args = (*ptrs, _i32(pl.tstride), _i32(pl.range_off), _i32(pl.decode_off), *shape,
                            _i32(pl.decode_group))  # fmt: skip
                elif name == "kvhal_attn_prefill":
                    args = (*ptrs, _i32(pl.n_seqs), _i32(pl.tstride), _i32(pl.range_off), _i32(pl.tile_off), *shape,
                            _i32(g.rows_per_warp), _i32(g.tile_tokens), _i32(g.k_stride))  # fmt: skip
                else:
                    args = (part_o, part_lse, out, _i32(R), _i32(Hq), _i32(D), _i32(pl.n_splits))
                    block = (min(D, 256) + 31 & ~31, 1, 1)
                self._rt.launch(name, grid, block, args, smem)
            if want_lse and pl.n_splits == 1:  # no merge launched: the one split's partial is the output
                out[...] = part_o[0]
        return (out, part_lse) if want_lse else out

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        cp: plan.CachePlan = pools.state.plan
        n, H = len(src), cp.n_kv_heads
        if n == 0:
            return
        with self._rt.device:
            s = self._rt.to_device(np.ascontiguousarray(src, np.int64))
            d = self._rt.to_device(np.ascontiguousarray(dst, np.int64))
            for pool, rb in ((pools.k[layer], cp.k.row_bytes), (pools.v[layer], cp.v.row_bytes)):
                tmp = self._xp.empty(n * H * rb, self._xp.uint8)
                grid, block = plan.grid_1d(n * H * rb)
                dims = (_i32(n), _i32(H), _i32(cp.block_size), _i32(rb))
                self._rt.launch("kvhal_copy_gather", grid, block, (pool, s, tmp, *dims))
                self._rt.launch("kvhal_copy_scatter", grid, block, (tmp, d, pool, *dims))

    # -- raw block I/O: one launch over every layer's pages and one transfer ------------------------------

    def _blocks_launch(self, pools: Pools, kernel: str, ids: np.ndarray, raw: Any) -> None:
        cp: plan.CachePlan = pools.state.plan
        L = pools.spec.n_layers
        grid, block = plan.blocks_launch(len(ids), L)
        ids_d = self._rt.to_device(ids)
        args = (pools.state.pool_table, ids_d, raw, _i32(L), _i64(cp.k.page_bytes), _i64(cp.v.page_bytes))
        self._rt.launch(kernel, grid, block, args)

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        ids = check_block_ids(pools.n_blocks, block_ids)
        nb = pools.spec.block_nbytes
        if ids.size == 0:
            return np.zeros((0, nb), np.uint8)
        with self._rt.device:
            raw = self._xp.empty((ids.size, nb), self._xp.uint8)
            self._blocks_launch(pools, "kvhal_blocks_gather", ids, raw)
            return self._rt.to_host(raw)

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        data = check_block_data(pools.spec, data)
        ids = check_block_ids(pools.n_blocks, block_ids, len(data))
        if ids.size == 0:
            return
        with self._rt.device:
            raw = self._rt.to_device(np.ascontiguousarray(data))
            self._blocks_launch(pools, "kvhal_blocks_scatter", ids, raw)

    def synchronize(self) -> None:
        self._rt.synchronize()


class RocmBackend(CudaBackend):
    """The same kernels through HIP: cupy built for ROCm, code objects per gfx target (or hiprtc)."""

    name = "rocm"
    platform = "rocm"
    OPTIONS = (
        Option("device", int, 0, env="KVHAL_ROCM_DEVICE", check=non_negative, help="HIP device index"),
        dataclasses.replace(CudaBackend.OPTIONS[1], env="KVHAL_ROCM_PREFILL"),
    )
