"""kvhal's CUDA and ROCm backends: one kernel source (kernels/kvhal.cu) run through cupy.

``cuda`` runs under cupy-cuda12x or cupy-cuda13x, whichever is installed, and loads the prebuilt
cubin/PTX for the device's arch (kvhal_cuda/prebuilt/, shipped in the kvhal-cuda12/13 wheels), compiling
with NVRTC only for an arch with none. ``rocm`` is the same source through HIP (cupy on ROCm).
Launch geometry and metadata packing live in ``plan`` (tested on the CPU), cupy glue in ``runtime``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from kvhal import formats
from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import DTypeError, UnsupportedError
from kvhal.interop import host_float_array
from kvhal.spec import CacheSpec

from . import plan

__all__ = ["CudaBackend", "RocmBackend"]
__version__ = "0.1.0"

_i32 = np.int32
_f32 = np.float32


class CudaBackend(Backend):
    name = "cuda"
    platform: ClassVar[str] = "cuda"
    formats = frozenset(plan.FORMAT_IDS)
    # f32 accumulation with split-KV: under the CPU emulator the contract cases stay below 3e-6; the margin
    # covers the GPU's expf/logf rounding, which the emulator does not reproduce
    attention_tolerance = 1e-4

    @classmethod
    def probe(cls) -> Probe | None:
        from . import runtime

        return runtime.probe(cls.platform)[0]

    @classmethod
    def unavailable_reason(cls) -> str:
        from . import runtime

        return runtime.probe(cls.platform)[1]

    def __init__(self, device: int = 0, _runtime: Any = None) -> None:
        """``device``: the CUDA/HIP device index. ``_runtime`` replaces cupy (the tests' CPU emulator)."""
        super().__init__()
        if _runtime is None:
            from . import runtime

            _runtime = runtime.CupyRuntime(device, self.platform)
        self._rt = _runtime
        self._xp = _runtime.xp

    # -- pools --------------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        if spec.head_dim > plan.MAX_HEAD_DIM:
            raise UnsupportedError(
                f"the {self.name} kernels take head_dim <= {plan.MAX_HEAD_DIM}, got {spec.head_dim}; "
                "use the reference or cpu backend for wider heads"
            )
        self.spec = spec
        pools = []
        with self._rt.device:
            for _ in range(spec.n_layers):
                k = self._xp.zeros(spec.pool_shape(n_blocks, "k"), self._xp.uint8)
                v = self._xp.zeros(spec.pool_shape(n_blocks, "v"), self._xp.uint8)
                pools.append(LayerPools(k, v, int(k.nbytes + v.nbytes)))
        return pools

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

    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        sp = self.spec
        n = int(k.shape[0])
        with self._rt.device:
            slots_d = self._rt.to_device(np.ascontiguousarray(slots, np.int64))
            for x, pool, fmt, rb in ((k, pools.k, sp.k_fmt, sp.k_row_bytes), (v, pools.v, sp.v_fmt, sp.v_row_bytes)):
                name, grid, block = plan.store_launch(fmt.name, n, sp.n_kv_heads, sp.head_dim)
                args = (self._f32(x), slots_d, pool, _i32(n), _i32(sp.n_kv_heads), _i32(sp.head_dim),
                        _i32(sp.block_size), _i32(rb), _i32(plan.FORMAT_IDS[fmt.name]))  # fmt: skip
                self._rt.launch(name, grid, block, args)

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        sp = self.spec
        shape = (n, sp.n_kv_heads, sp.head_dim)
        with self._rt.device:
            out = (self._xp.empty(shape, self._xp.float32), self._xp.empty(shape, self._xp.float32))
            if n == 0:
                return out
            ids = self._rt.to_device(np.ascontiguousarray(block_ids, np.int32))
            grid, block = plan.grid_1d(n * sp.n_kv_heads * sp.head_dim)
            for o, pool, fmt, rb in (
                (out[0], pools.k, sp.k_fmt, sp.k_row_bytes),
                (out[1], pools.v, sp.v_fmt, sp.v_row_bytes),
            ):
                args = (pool, ids, o, _i32(n), _i32(sp.n_kv_heads), _i32(sp.head_dim), _i32(sp.block_size), _i32(rb),
                        _i32(plan.FORMAT_IDS[fmt.name]))  # fmt: skip
                self._rt.launch("kvhal_load", grid, block, args)
        return out

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
        sp = self.spec
        R, Hq, D = (int(d) for d in q.shape)
        pl = plan.plan_attention(
            block_table, seq_lens, q_lens, n_heads=Hq, head_dim=D, block_size=sp.block_size, n_sm=self._rt.n_sm
        )
        xp = self._xp
        with self._rt.device:
            qd = self._f32(q)
            out = xp.empty((R, Hq, D), xp.float32)
            meta = self._rt.to_device(pl.meta)
            if pl.n_splits > 1:
                part_o = xp.empty((pl.n_splits, R, Hq, D), xp.float32)
                part_lse = xp.empty((pl.n_splits, R, Hq), xp.float32)
            else:  # never written with one split
                part_o, part_lse = out, out
            common = (_i32(pl.n_seqs), _i32(pl.tstride))
            shape = (_i32(R), _i32(Hq), _i32(sp.n_kv_heads), _i32(D), _i32(sp.block_size), _i32(sp.k_row_bytes),
                     _i32(sp.v_row_bytes), _i32(plan.FORMAT_IDS[sp.k_format]), _i32(plan.FORMAT_IDS[sp.v_format]),
                     _f32(scale), _i32(causal), _i32(window or 0), _i32(pl.split_pages), _i32(pl.n_splits))  # fmt: skip
            block = (plan.NUM_WARPS * 32, 1, 1)
            ptrs = (qd, pools.k, pools.v, meta, out, part_o, part_lse)
            g = pl.prefill
            for name, grid, smem in plan.attention_launches(pl, Hq, D):
                if name == "kvhal_attn_decode":
                    args = (*ptrs, *common, _i32(pl.decode_off), *shape)
                elif name == "kvhal_attn_prefill":
                    args = (*ptrs, *common, _i32(pl.tile_off), *shape, _i32(g.rows_per_warp), _i32(g.tile_tokens),
                            _i32(g.k_stride))  # fmt: skip
                else:
                    args = (part_o, part_lse, out, _i32(R), _i32(Hq), _i32(D), _i32(pl.n_splits))
                    block = (min(D, 256) + 31 & ~31, 1, 1)
                self._rt.launch(name, grid, block, args, smem)
        return out

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        sp = self.spec
        n = len(src)
        if n == 0:
            return
        with self._rt.device:
            s = self._rt.to_device(np.ascontiguousarray(src, np.int64))
            d = self._rt.to_device(np.ascontiguousarray(dst, np.int64))
            for pool, rb in ((pools.k, sp.k_row_bytes), (pools.v, sp.v_row_bytes)):
                tmp = self._xp.empty(n * sp.n_kv_heads * rb, self._xp.uint8)
                grid, block = plan.grid_1d(n * sp.n_kv_heads * rb)
                dims = (_i32(n), _i32(sp.n_kv_heads), _i32(sp.block_size), _i32(rb))
                self._rt.launch("kvhal_copy_gather", grid, block, (pool, s, tmp, *dims))
                self._rt.launch("kvhal_copy_scatter", grid, block, (tmp, d, pool, *dims))

    def synchronize(self) -> None:
        self._rt.synchronize()


class RocmBackend(CudaBackend):
    """The same kernels through HIP: cupy built for ROCm, code objects per gfx target (or hiprtc)."""

    name = "rocm"
    platform = "rocm"
