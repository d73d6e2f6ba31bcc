"""kvhal's Ascend backend: device-agnostic torch code that runs on ``npu`` through torch_npu.

The pools are uint8 torch tensors on the device in kvhal's pool layout, written by the torch
quantizers of :mod:`kvhal_ascend.ggml_torch` (byte-identical to the numpy spec); load and attention
gather pages and dequantize them on the fly, in f32.

Device choice: ``KVHAL_ASCEND_DEVICE`` (or the ``device`` backend option) is ``npu`` (default),
``npu:N``, ``cpu`` (CI: the same code on torch's CPU device) or ``cuda[:N]`` (a check that the code
stays device-agnostic on another accelerator; kvhal-cuda is the CUDA backend).

Importing this module imports neither torch nor torch_npu: ``probe`` looks with
``importlib.util.find_spec`` first and imports torch_npu only when it is there and an NPU is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
import warnings
from functools import lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, DTypeError, NonFiniteError
from kvhal.formats import Format
from kvhal.spec import CacheSpec

if TYPE_CHECKING:
    import torch

__all__ = ["AscendBackend"]

ENV_DEVICE = "KVHAL_ASCEND_DEVICE"
NPU_SCORE = 80  # an NPU is the only accelerator this backend is for: beat the host backends
HOST_SCORE = 1  # the CPU/CUDA check paths: chosen only by name or when nothing else runs
_DEVICE_RE = re.compile(r"^(npu|cpu|cuda)(?::(\d+))?$")
_INSTALL_NPU = "pip install 'kvhal-ascend[npu]' (torch-npu==2.13.0, pinned to torch 2.13)"
_CPU_HINT = f"or set {ENV_DEVICE}=cpu to run this backend's code on the host"
ATTENTION_BATCH_BYTES = 256 << 20  # f32 working set (dequantized K/V, scores) per batched attention step


def _parse_device(value: str) -> tuple[str, int | None] | None:
    m = _DEVICE_RE.match(value.strip().lower())
    return (m.group(1), None if m.group(2) is None else int(m.group(2))) if m else None


def _requested() -> str:
    return os.environ.get(ENV_DEVICE, "").strip() or "npu"


@lru_cache(maxsize=1)
def _import_torch_npu() -> tuple[ModuleType | None, str]:
    """Import torch_npu once: (module, "") or (None, the import error text).

    torch_npu must come before torch: with it installed, ``import torch`` auto-loads it and, when
    CANN is missing, fails with a RuntimeError and leaves torch half-imported for the whole process,
    whereas ``import torch_npu`` first fails cleanly (ImportError naming the missing CANN library)
    and leaves a working torch. The outcome is cached because a failed import is not repeatable.
    """
    try:
        return importlib.import_module("torch_npu"), ""
    except Exception as e:  # ImportError/OSError for missing CANN libs, RuntimeError for a torch mismatch
        cause = f" (caused by {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        return None, f"{type(e).__name__}: {e}{cause}"


def _cann_missing(error: str) -> bool:
    """The import failed on a shared library (libhccl.so, libascendcl.so, ...): CANN is not on the path."""
    return "cannot open shared object" in error or re.search(r"\blib[\w+-]+\.so\b", error) is not None


def _probe_state(raw: str | None = None) -> tuple[Probe | None, str]:
    """(probe, "") when device ``raw`` (default: the env's) is usable, else (None, why not).

    Cheap (find_spec only) unless an NPU is asked for and torch_npu is installed.
    """
    raw = raw or _requested()
    parsed = _parse_device(raw)
    if parsed is None:
        return None, f"{ENV_DEVICE}={raw!r} is not a device this backend runs on: use npu, npu:N or cpu"
    kind, index = parsed
    if importlib.util.find_spec("torch") is None:
        return (
            None,
            "torch is not installed: pip install kvhal-ascend (it depends on torch; torch==2.13.0 for torch-npu 2.13)",
        )
    if kind == "cpu":
        return Probe(HOST_SCORE, f"torch CPU device ({ENV_DEVICE}={raw}): the Ascend code path on the host", "cpu"), ""
    if kind == "cuda":
        import torch

        n = torch.cuda.device_count()
        if (index or 0) >= n:
            return None, f"{ENV_DEVICE}={raw} but torch sees {n} CUDA device(s)"
        return Probe(
            HOST_SCORE, f"torch CUDA device ({ENV_DEVICE}={raw}): device-agnostic check", f"cuda:{index or 0}"
        ), ""
    if importlib.util.find_spec("torch_npu") is None:
        return None, f"torch_npu is not installed: {_INSTALL_NPU}, {_CPU_HINT}"
    torch_npu, error = _import_torch_npu()
    if torch_npu is None:
        if _cann_missing(error):
            return None, (
                f"torch_npu is installed but Huawei CANN's libraries are missing ({error}): install CANN and "
                f"source its set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), {_CPU_HINT}"
            )
        return (
            None,
            f"torch_npu is installed but does not import ({error}): torch-npu must match torch (torch-npu==2.13.0 for torch 2.13)",
        )
    n = int(torch_npu.npu.device_count())
    if n == 0:
        return None, (
            "torch_npu imports but sees no NPU (device_count() == 0): check the driver with npu-smi info "
            f"and ASCEND_RT_VISIBLE_DEVICES, {_CPU_HINT}"
        )
    index = index or 0
    if index >= n:
        return None, f"{ENV_DEVICE}={raw} but torch_npu sees {n} NPU(s)"
    name = torch_npu.npu.get_device_name(index)
    version = getattr(torch_npu, "__version__", "?")
    return Probe(NPU_SCORE, f"{name} (npu:{index} of {n}) via torch_npu {version}", f"npu:{index}"), ""


class AscendBackend(Backend):
    name = "ascend"
    formats = frozenset(["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
    attention_tolerance = 1e-4  # f32 matmuls and softmax; 1e-6 is typical on the CPU device

    @classmethod
    def probe(cls) -> Probe | None:
        return _probe_state()[0]

    @classmethod
    def unavailable_reason(cls) -> str:
        return _probe_state()[1] or "available"

    def __init__(self, device: str | None = None, attention_batch_bytes: int = ATTENTION_BATCH_BYTES) -> None:
        raw = device or _requested()
        parsed = _parse_device(raw)
        if parsed is None:
            raise BackendUnavailableError(
                f"device {raw!r} is not one the ascend backend runs on: use npu, npu:N or cpu"
            )
        kind, index = parsed
        if kind == "npu":
            probe, reason = _probe_state(raw)
            if probe is None:
                raise BackendUnavailableError(f"ascend backend on {raw}: {reason}")
        elif "torch" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
            # with torch_npu installed, `import torch` auto-loads it and, without CANN, breaks torch for
            # the process; importing torch_npu first fails cleanly and leaves torch usable on the host
            _import_torch_npu()
        import torch

        from . import ggml_torch

        self.codec = ggml_torch
        self.device = torch.device(kind if kind == "cpu" else f"{kind}:{index or 0}")
        self.batch_bytes = int(attention_batch_bytes)

    # -- pools -----------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        import torch

        self.spec = spec
        pools = []
        for _ in range(spec.n_layers):
            k = torch.zeros(spec.pool_shape(n_blocks, "k"), dtype=torch.uint8, device=self.device)
            v = torch.zeros(spec.pool_shape(n_blocks, "v"), dtype=torch.uint8, device=self.device)
            pools.append(LayerPools(k, v, k.numel() + v.numel()))
        return pools

    def _index(self, a: np.ndarray) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(self.device)

    def _rows(self, slots: np.ndarray) -> torch.Tensor:
        """Slot numbers -> row indices of the pool seen as ``[n_blocks * n_kv_heads * block_size, row_bytes]``."""
        bs, h = self.spec.block_size, self.spec.n_kv_heads
        slots = np.asarray(slots, np.int64)
        rows = ((slots // bs)[:, None] * h + np.arange(h)) * bs + (slots % bs)[:, None]
        return self._index(rows.ravel())

    def store(self, pools: LayerPools, k: torch.Tensor, v: torch.Tensor, slots: np.ndarray) -> None:
        qk = self.codec.quantize(self.spec.k_format, k)
        qv = self.codec.quantize(self.spec.v_format, v)  # both quantized before either pool is written
        rows = self._rows(slots)
        for pool, q in ((pools.k, qk), (pools.v, qv)):
            pool.view(-1, pool.shape[-1]).index_copy_(0, rows, q.reshape(-1, pool.shape[-1]))

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        s, d = self._rows(src), self._rows(dst)
        for pool in (pools.k, pools.v):
            flat = pool.view(-1, pool.shape[-1])
            flat.index_copy_(0, d, flat.index_select(0, s))  # index_select copies: gather all, then scatter

    def _pages(self, pool: torch.Tensor, fmt: str, ids: torch.Tensor, shape: tuple[int, int], n: int) -> torch.Tensor:
        """Pages ``ids`` (``shape`` = (seqs, pages each)) dequantized: ``[seqs, n_kv_heads, n, head_dim]`` f32."""
        b, nb = shape
        _, h, bs, rb = pool.shape
        pages = pool.index_select(0, ids).view(b, nb, h, bs, rb).permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, rb)
        return self.codec.dequantize(fmt, pages[:, :, :n].contiguous())

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._index(block_ids)
        nb = len(block_ids)
        out = []
        for pool, fmt in ((pools.k, self.spec.k_format), (pools.v, self.spec.v_format)):
            x = self._pages(pool, fmt, ids, (1, nb), n)[0]  # [H, n, D]
            out.append(x.transpose(0, 1).contiguous())
        return out[0], out[1]

    # -- attention -------------------------------------------------------------------------------------

    def _batches(self, seq_lens: np.ndarray) -> list[np.ndarray]:
        """Sequences grouped so that each group's dequantized K/V (padded to its longest) fits the budget.

        Longest first, so a group pads little; a sequence over the budget on its own gets a group of one.
        """
        kv_bytes = 2 * self.spec.n_kv_heads * self.spec.head_dim * 4
        order = np.argsort(-seq_lens, kind="stable")
        groups: list[list[int]] = []
        for s in order.tolist():
            if groups and (len(groups[-1]) + 1) * int(seq_lens[groups[-1][0]]) * kv_bytes <= self.batch_bytes:
                groups[-1].append(s)
            else:
                groups.append([s])
        return [np.asarray(g, np.int64) for g in groups]

    def attention(
        self,
        q: torch.Tensor,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> torch.Tensor:
        import torch

        spec = self.spec
        n_tok, n_heads, dim = (int(x) for x in q.shape)
        hkv = spec.n_kv_heads
        group = n_heads // hkv
        seq_lens = np.asarray(seq_lens, np.int64)
        q_lens = np.asarray(q_lens, np.int64)
        q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
        q = q.to(torch.float32)
        out = torch.empty((n_tok, n_heads, dim), dtype=torch.float32, device=self.device)
        for seqs in self._batches(seq_lens):
            b = len(seqs)
            n_kv = int(seq_lens[seqs].max())
            nb = math.ceil(n_kv / spec.block_size)
            ids = self._index(np.maximum(block_table[seqs, :nb], 0).ravel())  # -1 padding -> page 0, masked
            k = self._pages(pools.k, spec.k_format, ids, (b, nb), n_kv)  # [b, hkv, n_kv, D] f32
            v = self._pages(pools.v, spec.v_format, ids, (b, nb), n_kv)
            ql = q_lens[seqs]
            # queries padded to the group's longest; a padding row repeats its sequence's last query,
            # so it is never fully masked, and is dropped at the end
            qi = np.minimum(np.arange(int(ql.max()))[None, :], ql[:, None] - 1)  # [b, qmax]
            pos = (seq_lens[seqs] - ql)[:, None] + qi  # query i of a sequence sits at seq_len - q_len + i
            kv_len = self._index(seq_lens[seqs])[:, None, None]
            chunk = max(1, self.batch_bytes // (b * n_kv * n_heads * 8))  # scores + probabilities, f32
            for c0 in range(0, qi.shape[1], chunk):
                ci, cp = qi[:, c0 : c0 + chunk], pos[:, c0 : c0 + chunk]
                nq = ci.shape[1]
                # keys this chunk can see at all: up to its last position (causal), from its first
                # position's window start
                hi = min(n_kv, int(cp.max()) + 1) if causal else n_kv
                lo = max(0, int(cp.min()) - window + 1) if window is not None else 0
                lo = min(lo, hi - 1)
                rows = self._index((q_start[seqs][:, None] + ci).ravel())
                qb = q.index_select(0, rows).view(b, nq, hkv, group, dim).permute(0, 2, 3, 1, 4)
                qb = qb.reshape(b, hkv, group * nq, dim)
                scores = torch.matmul(qb, k[:, :, lo:hi].transpose(-1, -2)) * scale  # [b, hkv, group*nq, hi-lo]
                j = torch.arange(lo, hi, device=self.device)[None, None, :]
                p_t = self._index(cp)[:, :, None]
                visible = j < kv_len
                if causal:
                    visible = visible & (j <= p_t)
                if window is not None:
                    visible = visible & (j > p_t - window)
                scores = scores.view(b, hkv, group, nq, hi - lo).masked_fill(~visible[:, None, None], float("-inf"))
                p = torch.softmax(scores, dim=-1).view(b, hkv, group * nq, hi - lo)
                o = torch.matmul(p, v[:, :, lo:hi]).view(b, hkv, group, nq, dim).permute(0, 3, 1, 2, 4)
                real = (c0 + np.arange(nq))[None, :] < ql[:, None]  # [b, nq]
                dest = (q_start[seqs][:, None] + c0 + np.arange(nq)[None, :])[real]
                keep = np.flatnonzero(real.ravel())
                o = o.reshape(b * nq, n_heads, dim).index_select(0, self._index(keep))
                out.index_copy_(0, self._index(dest), o)
        return out

    def synchronize(self) -> None:
        import torch

        if self.device.type != "cpu":
            torch.get_device_module(self.device).synchronize()

    # -- array interop ---------------------------------------------------------------------------------

    def asarray(self, x: Any, what: str) -> torch.Tensor:
        """torch tensors as they are (moved to the device), numpy through from_numpy, others through DLPack.

        bfloat16 torch tensors are taken too: Ascend models keep activations in bf16, and every format
        quantizes from f32, which bf16 widens to exactly, so storing them equals storing ``x.float()``.
        """
        import torch

        if isinstance(x, torch.Tensor):
            t = x.detach()
        elif isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            from kvhal.interop import host_float_array

            arr = np.ascontiguousarray(host_float_array(x, what))  # its dtype errors, same words as the core's
            with warnings.catch_warnings():  # read-only arrays are fine: kvhal never writes into inputs
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(arr)
        else:
            try:
                t = torch.utils.dlpack.from_dlpack(x)
            except (TypeError, BufferError, RuntimeError, ValueError) as e:
                raise DTypeError(
                    f"{what} could not be read through DLPack ({e}); pass a torch tensor or numpy array"
                ) from e
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise DTypeError(
                f"{what} has dtype {t.dtype}; kvhal takes float32 or float16 (this backend also bfloat16): "
                "convert with .float()"
            )
        if t.device != self.device:
            if t.device.type not in ("cpu", self.device.type) and self.device.type != "cpu":
                t = t.cpu()  # between two accelerator kinds torch copies through the host
            t = t.to(self.device)
        return t

    def to_numpy(self, x: Any) -> np.ndarray:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
        from kvhal.interop import to_numpy

        return to_numpy(x)

    def check_values(self, fmt: Format, x: Any) -> None:
        """Format.check_values on the device: two reductions and one small copy to the host."""
        import torch

        if not isinstance(x, torch.Tensor):
            fmt.check_values(self.to_numpy(x))
            return
        if x.numel() == 0:
            return
        bad = ~torch.isfinite(x)
        stats = torch.stack([bad.sum().to(torch.float32), x.abs().amax().to(torch.float32)]).tolist()
        if stats[0] > 0:
            first = float(x[bad][0])
            raise NonFiniteError(  # the words of kvhal.formats.Format.check_values
                f"{int(bad.sum())} non-finite value(s) (first: {first}) in input for format {fmt.name}; "
                "kvhal stores finite values only: find the NaN/inf upstream (overflowing activations) "
                "or clamp before storing"
            )
        amax = stats[1]
        if amax > fmt.max_abs:
            raise NonFiniteError(
                f"|x| = {amax:g} exceeds {fmt.max_abs:g}, the largest value format {fmt.name} stores "
                "without overflowing to inf; clamp, rescale, or use a wider format (f32/bf16)"
            )
