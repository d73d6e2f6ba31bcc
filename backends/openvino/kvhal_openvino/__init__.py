"""kvhal's OpenVINO backend: store, load and attention as OpenVINO graphs (Intel CPU, GPU, NPU).

Pools are host numpy arrays in kvhal's layout. Attention and load gather and dequantize the quantized
pages inside the graph; on the CPU device OpenVINO reads quantized and f32 pools in place
(``share_inputs``), while f16/bf16 pools (which the plugin would convert whole) and every pool on other
devices are fed only the pages a call reads. The graphs live in :mod:`kvhal_openvino.graphs`, imported
on first use so ``import kvhal`` never imports OpenVINO.

``KVHAL_OPENVINO_DEVICE`` (or ``backend_options={"device": ...}``) picks the device: CPU (default),
GPU, GPU.1, NPU, or any device string OpenVINO takes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

import numpy as np

from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, UnsupportedError
from kvhal.spec import CacheSpec

ENV_DEVICE = "KVHAL_OPENVINO_DEVICE"
# attention scores materialised per graph call; longer prefills run in query chunks of the same graph
SCORE_BUDGET_BYTES = 256 << 20
# auto-selection: on an Intel GPU this beats the generic OpenCL/Vulkan paths (60); on CPU the native
# `cpu` backend (50) is faster
SCORES = {"CPU": 20, "GPU": 70, "NPU": 40}
INSTALL_HINT = "pip install kvhal-openvino (or pip install openvino)"


def _device_from_env() -> str:
    return os.environ.get(ENV_DEVICE, "").strip() or "CPU"


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


class OpenVINOBackend(Backend):
    name = "openvino"
    formats = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"})
    # f32 matmuls and softmax (INFERENCE_PRECISION_HINT=f32); measured max error 3.7e-6 over the contract
    # cases and 3000/8000-token decodes (docs/backends/openvino.md)
    attention_tolerance = 2e-5

    @classmethod
    def probe(cls) -> Probe | None:
        if importlib.util.find_spec("openvino") is None:
            return None
        device = _device_from_env()
        if _missing_device(device):
            return None
        src = ENV_DEVICE if os.environ.get(ENV_DEVICE, "").strip() else f"the default; set {ENV_DEVICE} for GPU or NPU"
        checked = "" if "openvino" in sys.modules else "; checked when the backend starts"
        return Probe(
            score=SCORES.get(device.split(".")[0].split(":")[0], 20),
            reason=f"OpenVINO {importlib.metadata.version('openvino')} graphs on device {device} ({src}{checked})",
            device=f"openvino:{device}",
        )

    @classmethod
    def unavailable_reason(cls) -> str:
        if importlib.util.find_spec("openvino") is None:
            return f"the openvino Python package is not installed: {INSTALL_HINT}"
        return _missing_device(_device_from_env()) or "its probe found no usable device"

    def __init__(self, device: str | None = None) -> None:
        if importlib.util.find_spec("openvino") is None:
            raise BackendUnavailableError(f"backend 'openvino' is unavailable: {self.unavailable_reason()}")
        from . import graphs  # imports openvino

        self._g = graphs
        self.device = (device or _device_from_env()).strip()
        missing = _missing_device(self.device)
        if missing:
            src = "backend_options['device']" if device else ENV_DEVICE
            raise BackendUnavailableError(missing.replace(f"{self.device!r}", f"{self.device!r} (from {src})", 1))
        # the CPU plugin reads host arrays in place; a discrete device would upload a whole pool per call
        self._in_place = self.device.split(".")[0] == "CPU"
        self._copied = False
        self._requests: dict[tuple[Any, ...], Any] = {}

    # -- graphs -------------------------------------------------------------------------------------------

    def _run(self, key: tuple[Any, ...], inputs: list[np.ndarray], share_outputs: bool = False) -> list[np.ndarray]:
        req = self._requests.get(key)
        if req is None:
            try:
                req = self._g.compiled(self.device, key).create_infer_request()
            except RuntimeError as e:
                raise UnsupportedError(
                    f"OpenVINO could not compile kvhal's {key[0]} graph for device {self.device}: {e}; "
                    f"use another device ({ENV_DEVICE}) or another backend"
                ) from e
            self._requests[key] = req
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

    def _pages(self, pools: LayerPools, ids: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """The pool views a graph reads and the page ids into them.

        Pools are read in place on CPU, except f16/bf16 ones, which the plugin would convert whole:
        those (and devices off the host) get only the pages used, renumbered.
        """
        if not self._in_place or self._copied:
            used, inverse = np.unique(ids, return_inverse=True)
            pools = LayerPools(pools.k[used], pools.v[used], 0)
            ids = inverse.reshape(ids.shape)
        views = self._views(pools.k, self.spec.k_format) + self._views(pools.v, self.spec.v_format)
        return views, ids.astype(np.int32, copy=False)

    # -- Backend ------------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        self._copied = any(v in self._g.COPIED_VIEWS for f in (spec.k_format, spec.v_format) for v in self._g.VIEWS[f])
        out = []
        for _ in range(spec.n_layers):
            k = np.zeros(spec.pool_shape(n_blocks, "k"), np.uint8)
            v = np.zeros(spec.pool_shape(n_blocks, "v"), np.uint8)
            out.append(LayerPools(k, v, k.nbytes + v.nbytes))
        return out

    def _store_input(self, x: Any, fmt: str) -> np.ndarray:
        a: np.ndarray = np.ascontiguousarray(x, np.float32)
        return a.view(np.uint8) if fmt == "bf16" else a  # bf16 rounds the input's bits

    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        spec, g = self.spec, self._g
        n, heads = int(k.shape[0]), spec.n_kv_heads
        xs = [self._store_input(x, fmt) for x, fmt in ((k, spec.k_format), (v, spec.v_format))]
        graph_in = [x for x, fmt in zip(xs, (spec.k_format, spec.v_format)) if fmt != "f32"]
        parts: list[np.ndarray] = []
        if graph_in:
            key = ("store", spec.k_format, spec.v_format, heads, spec.head_dim)
            parts = self._run(key, graph_in, True)
        blk, off = slots // spec.block_size, slots % spec.block_size
        for pool, fmt, x in ((pools.k, spec.k_format, xs[0]), (pools.v, spec.v_format, xs[1])):
            if fmt == "f32":  # f32 rows are the input's bytes
                rows = x.view(np.uint8)
            else:
                # the graph's outputs are the row's fields (fp16 scales, quant bytes); lay them out back to back
                n_parts = 1 + (fmt in g.N_SCALES)
                ps, parts = parts[:n_parts], parts[n_parts:]
                nb = spec.head_dim // g.QK if fmt in g.N_SCALES else 1
                fields = [np.asarray(p).view(np.uint8).reshape(n, heads, nb, -1) for p in ps]
                rows = fields[0] if len(fields) == 1 else np.concatenate(fields, -1)
            pool[blk, :, off, :] = rows.reshape(n, heads, -1)

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        if n == 0 or len(block_ids) == 0:
            empty = np.zeros((0, spec.n_kv_heads, spec.head_dim), np.float32)
            return empty, empty.copy()
        views, ids = self._pages(pools, np.asarray(block_ids))
        key = ("load", spec.k_format, spec.v_format, spec.n_kv_heads, spec.block_size, spec.head_dim)
        k, v = self._run(key, [*views, ids])
        return k[:n], v[:n]

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
    ) -> np.ndarray:
        spec = self.spec
        q = np.ascontiguousarray(q, np.float32)
        n_heads = int(q.shape[1])
        g = n_heads // spec.n_kv_heads
        lens = np.asarray(seq_lens, np.int64)
        qn = np.asarray(q_lens, np.int64)
        n_seqs, q_max = len(lens), int(qn.max())
        starts = np.concatenate([[0], np.cumsum(qn)[:-1]])
        i = np.arange(q_max)
        iq = np.minimum(i[None, :], qn[:, None] - 1)  # padded slots repeat the sequence's last query
        rows = starts[:, None] + iq
        pos = lens[:, None] - qn[:, None] + iq  # query i of a sequence sits at seq_len - q_len + i
        hi = pos if causal else np.broadcast_to(lens[:, None] - 1, pos.shape)
        lo = np.maximum(pos - window, -1) if window is not None else np.full(pos.shape, -1)
        views, table = self._pages(pools, np.maximum(block_table, 0))
        key = ("attention", spec.k_format, spec.v_format, n_heads, spec.n_kv_heads, spec.block_size, spec.head_dim)
        ctx = table.shape[1] * spec.block_size
        chunk = max(1, SCORE_BUDGET_BYTES // (4 * n_seqs * n_heads * ctx))
        out = np.empty(q.shape, np.float32)
        for a in range(0, q_max, chunk):
            b = min(q_max, a + chunk)
            hi_c, lo_c = (np.repeat(x[:, a:b], g, axis=1).astype(np.int32) for x in (hi, lo))
            (res,) = self._run(
                key, [q, *views, table, rows[:, a:b].astype(np.int32), hi_c, lo_c, np.asarray(scale, np.float32)], True
            )
            valid = i[None, a:b] < qn[:, None]
            out[(starts[:, None] + i[None, a:b])[valid]] = res[valid]
        return out

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        bs = self.spec.block_size
        for pool in (pools.k, pools.v):
            pool[dst // bs, :, dst % bs, :] = pool[src // bs, :, src % bs, :]

    @property
    def compile_count(self) -> int:
        """compile_model calls this process has made for this backend's graphs (all instances)."""
        return int(self._g.compiles)


__all__ = ["OpenVINOBackend"]
