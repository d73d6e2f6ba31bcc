"""kvhal's OpenVINO backend: store, load and attention as OpenVINO graphs (Intel CPU, GPU, NPU).

Pools are host numpy arrays in kvhal's layout. Attention and load gather and dequantize the quantized
pages inside the graph; on the CPU device OpenVINO reads quantized and f32 pools in place
(``share_inputs``), while f16/bf16 pools (which the plugin would convert whole) and every pool on other
devices are fed only the pages a call reads. The graphs live in :mod:`kvhal_openvino.graphs`, imported
on first use so ``import kvhal`` never imports OpenVINO. Compiled graphs are shared by the process; each
cache has its own infer requests (``Pools.state``), so caches on one instance run on several threads.

The ``device`` option (env ``KVHAL_OPENVINO_DEVICE``) picks the device: CPU (default), GPU, GPU.1, NPU,
or any device string OpenVINO takes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhal import formats
from kvhal.backend import AttentionBatch, AttentionShape, HostPoolsBackend, Op, Pools, Probe
from kvhal.backend_util import Option, parse_options
from kvhal.errors import BackendUnavailableError, UnsupportedError
from kvhal.spec import CacheSpec

ENV_DEVICE = "KVHAL_OPENVINO_DEVICE"
OPTIONS = (Option("device", str, "CPU", env=ENV_DEVICE, help="CPU, GPU, GPU.1, NPU, AUTO:GPU,CPU, ..."),)
# attention scores materialised per graph call; longer prefills run in query chunks of the same graph
SCORE_BUDGET_BYTES = 256 << 20
# auto-selection: on an Intel GPU this beats the generic OpenCL/Vulkan paths (60); on CPU the native
# `cpu` backend (50) is faster
SCORES = {"CPU": 20, "GPU": 70, "NPU": 40}
INSTALL_HINT = "pip install kvhal-openvino (or pip install openvino)"


def _missing_device(device: str) -> str | None:
    """Why ``device`` cannot be used, when OpenVINO can tell cheaply (it is imported already); else None."""
    if "openvino" not in sys.modules:
        return None  # importing it costs ~0.3 s: the device is checked when the backend starts
    from . import graphs

    have = graphs.available_devices()
    base = device.split(":")[0]
    if base in graphs.VIRTUAL_DEVICES or device in have or base in {d.split(".")[0] for d in have}:
        return None
    return (
        f"OpenVINO device {device!r} is not on this machine; OpenVINO sees: {', '.join(have) or 'no devices'}. "
        f"Set {ENV_DEVICE} to one of them (CPU always works), or install the device's driver "
        "(Intel GPU: intel-opencl-icd; NPU: the Intel NPU driver)"
    )


@dataclass
class _Plan:
    """One cache's graph state: its infer requests (one per graph; a request is not for two threads)
    and whether its pools are fed as page subsets."""

    page_subsets: bool
    requests: dict[tuple[Any, ...], Any] = field(default_factory=dict)


class OpenVINOBackend(HostPoolsBackend):
    name = "openvino"
    formats = frozenset(formats.GGML_CLASSIC)  # its kernels implement the ggml KV formats only
    # f32 matmuls and softmax (INFERENCE_PRECISION_HINT=f32); measured max error 3.7e-6 over the contract
    # cases and 3000/8000-token decodes (docs/backends/openvino.md)
    attention_tolerance = 2e-5

    @classmethod
    def probe(cls) -> Probe:
        if importlib.util.find_spec("openvino") is None:
            return Probe(None, f"the openvino Python package is not installed: {INSTALL_HINT}")
        device = parse_options(cls.name, {}, OPTIONS)["device"]
        missing = _missing_device(device)
        if missing:
            return Probe(None, missing)
        src = ENV_DEVICE if os.environ.get(ENV_DEVICE, "").strip() else f"the default; set {ENV_DEVICE} for GPU or NPU"
        checked = "" if "openvino" in sys.modules else "; checked when the backend starts"
        return Probe(
            score=SCORES.get(device.split(".")[0].split(":")[0], 20),
            reason=f"OpenVINO {importlib.metadata.version('openvino')} graphs on device {device} ({src}{checked})",
            device=f"openvino:{device}",
        )

    def __init__(self, **options: Any) -> None:
        self.device = parse_options(self.name, options, OPTIONS)["device"].strip()
        if importlib.util.find_spec("openvino") is None:
            raise BackendUnavailableError(
                f"backend 'openvino' is unavailable: the openvino Python package is not installed: {INSTALL_HINT}"
            )
        from . import graphs  # imports openvino

        self._g = graphs
        missing = _missing_device(self.device)
        if missing:
            src = "backend_options['device']" if options.get("device") is not None else ENV_DEVICE
            raise BackendUnavailableError(missing.replace(f"{self.device!r}", f"{self.device!r} (from {src})", 1))
        # the CPU plugin reads host arrays in place; a discrete device would upload a whole pool per call
        self._in_place = self.device.split(".")[0] == "CPU"

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        return super().supports(spec, op, shape) or self._g.refusal(self.device, spec, op)

    # -- graphs -------------------------------------------------------------------------------------------

    def _run(
        self, pools: Pools, key: tuple[Any, ...], inputs: list[Any], share_outputs: bool = False
    ) -> list[np.ndarray]:
        plan: _Plan = pools.state
        req = plan.requests.get(key)
        if req is None:
            try:
                req = self._g.compiled(self.device, key).create_infer_request()
            except RuntimeError as e:
                raise UnsupportedError(
                    f"OpenVINO cannot compile kvhal's {key[0]} graph for device {self.device}: "
                    f"{self._g.compile_error(e)}; use another device ({ENV_DEVICE}) or another backend"
                ) from e
            plan.requests[key] = req
        res = req.infer(inputs, share_inputs=True, share_outputs=share_outputs)
        return [res[i] for i in range(len(res))]

    def _views(self, pool: np.ndarray, fmt: str) -> list[Any]:
        """Typed views of a pool's bytes (no copy); numpy has no bf16, so that one is an ov.Tensor."""
        g = self._g
        out: list[Any] = []
        for v in g.VIEWS[fmt]:
            view = pool.view(g.NP_TYPES[v])
            out.append(g.ov.Tensor(view, view.shape, g.ov.Type.bf16) if v == "bf16" else view)
        return out

    def _pages(self, pools: Pools, layer: int, ids: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """The pool views a graph reads and the page ids into them.

        Pools are read in place on CPU, except f16/bf16 ones, which the plugin would convert whole:
        those (and devices off the host) get only the pages used, renumbered.
        """
        k, v = pools.k[layer], pools.v[layer]
        if not self._in_place or pools.state.page_subsets:
            used, inverse = np.unique(ids, return_inverse=True)
            k, v, ids = k[used], v[used], inverse.reshape(ids.shape)
        views = self._views(k, pools.spec.k_format) + self._views(v, pools.spec.v_format)
        return views, ids.astype(np.int32, copy=False)

    # -- Backend ------------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        pools = super().allocate(spec, n_blocks)
        g = self._g
        pools.state = _Plan(any(v in g.COPIED_VIEWS for f in (spec.k_format, spec.v_format) for v in g.VIEWS[f]))
        return pools

    @staticmethod
    def _store_input(x: Any, fmt: str) -> np.ndarray:
        a: np.ndarray = np.ascontiguousarray(x, np.float32)
        return a.view(np.uint8) if fmt == "bf16" else a  # bf16 rounds the input's bits

    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        spec, g = pools.spec, self._g
        n, heads = int(k.shape[0]), spec.n_kv_heads
        xs = [self._store_input(x, fmt) for x, fmt in ((k, spec.k_format), (v, spec.v_format))]
        graph_in = [x for x, fmt in zip(xs, (spec.k_format, spec.v_format)) if fmt != "f32"]
        parts: list[np.ndarray] = []
        if graph_in:
            parts = self._run(pools, g.key("store", spec), graph_in, True)
        blk, off = slots // spec.block_size, slots % spec.block_size
        rows_kv = []
        for fmt, x in ((spec.k_fmt, xs[0]), (spec.v_fmt, xs[1])):
            if fmt.name == "f32":  # f32 rows are the input's bytes
                rows = x.view(np.uint8)
            else:
                # the graph's outputs are the row's fields (fp16 scales, quant bytes); lay them out back to back
                n_parts = 1 + (fmt.name in g.N_SCALES)
                ps, parts = parts[:n_parts], parts[n_parts:]
                nb = spec.head_dim // fmt.block_len
                fields = [np.asarray(p).view(np.uint8).reshape(n, heads, nb, -1) for p in ps]
                rows = fields[0] if len(fields) == 1 else np.concatenate(fields, -1)
            rows_kv.append(rows.reshape(n, heads, -1))
        pools.k[layer][blk, :, off, :] = rows_kv[0]  # both computed before either pool is written
        pools.v[layer][blk, :, off, :] = rows_kv[1]

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec = pools.spec
        if n == 0 or len(block_ids) == 0:
            empty = np.zeros((0, spec.n_kv_heads, spec.head_dim), np.float32)
            return empty, empty.copy()
        views, ids = self._pages(pools, layer, np.asarray(block_ids))
        k, v = self._run(pools, self._g.key("load", spec), [*views, ids])
        return k[:n], v[:n]

    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> np.ndarray:
        spec = pools.spec
        q = np.ascontiguousarray(q, np.float32)
        n_heads = int(q.shape[1])
        g = n_heads // spec.n_kv_heads
        qn = np.asarray(batch.q_lens, np.int64)
        n_seqs, q_max = len(qn), int(qn.max())
        starts = np.cumsum(qn) - qn
        i = np.arange(q_max)
        rows = starts[:, None] + np.minimum(i[None, :], qn[:, None] - 1)  # padded slots repeat the last query
        _, _, lo, hi = batch.visible
        hi, lo = hi[rows] - 1, lo[rows] - 1  # the graph's mask: lo < j <= hi
        views, table = self._pages(pools, layer, np.maximum(batch.block_table, 0))
        key = self._g.key("attention", spec, n_heads)
        ctx = table.shape[1] * spec.block_size
        chunk = max(1, SCORE_BUDGET_BYTES // max(1, 4 * n_seqs * n_heads * ctx))
        out = np.empty(q.shape, np.float32)
        for a in range(0, q_max, chunk):
            b = min(q_max, a + chunk)
            hi_c, lo_c = (np.repeat(x[:, a:b], g, axis=1).astype(np.int32) for x in (hi, lo))
            inputs = [q, *views, table, rows[:, a:b].astype(np.int32), hi_c, lo_c, np.asarray(batch.scale, np.float32)]
            (res,) = self._run(pools, key, inputs, True)
            valid = i[None, a:b] < qn[:, None]
            out[(starts[:, None] + i[None, a:b])[valid]] = res[valid]
        return out

    @property
    def compile_count(self) -> int:
        """compile_model calls this process has made for this backend's graphs (all instances)."""
        return int(self._g.compiles)


__all__ = ["ENV_DEVICE", "OPTIONS", "OpenVINOBackend"]
