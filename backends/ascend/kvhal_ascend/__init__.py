"""kvhal's Ascend backend: device-agnostic torch code that runs on ``npu`` through torch_npu.

The pools are uint8 torch tensors on the device in kvhal's pool layout, written by the torch
quantizers of :mod:`kvhal_ascend.ggml_torch` (byte-identical to the numpy spec); load and attention
gather pages and dequantize them on the fly, in f32.

Options (``kvhal.backend_util.parse_options``: the argument, else the environment, else the default):
``device`` / ``KVHAL_ASCEND_DEVICE`` is ``npu`` (default), ``npu:N``, ``cpu`` (CI: the same code on
torch's CPU device) or ``cuda[:N]`` (a check that the code stays device-agnostic on another
accelerator; kvhal-cuda is the CUDA backend); ``attention_batch_bytes`` bounds attention's f32
working set. Nothing of a cache lives on the instance: one instance serves any number of caches.

Importing this module imports neither torch nor torch_npu: ``probe`` looks with
``importlib.util.find_spec`` first and imports torch_npu only when it is there and an NPU is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import warnings
from functools import lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhal import formats
from kvhal.backend import AttentionBatch, Backend, Pools, Probe
from kvhal.backend_util import Option, check_block_data, check_block_ids, parse_options, positive
from kvhal.errors import BackendUnavailableError, DTypeError, SpecError
from kvhal.formats import Format
from kvhal.interop import host_float_array
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


OPTIONS = (
    Option(
        "device",
        str,
        "npu",
        env=ENV_DEVICE,
        check=lambda v: None if _parse_device(v) else "is not a device this backend runs on: use npu, npu:N or cpu",
        help="npu, npu:N, cpu or cuda[:N]",
    ),
    Option("attention_batch_bytes", int, ATTENTION_BATCH_BYTES, check=positive, help="attention's f32 working set"),
)


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


def _choose(raw: str) -> Probe:
    """Whether device ``raw`` (an option value, already checked) is usable: its Probe, score None if not.

    Cheap (find_spec only) unless an NPU is asked for and torch_npu is installed."""
    kind, index = _parse_device(raw) or ("", None)
    if importlib.util.find_spec("torch") is None:
        return Probe(
            None,
            "torch is not installed: pip install kvhal-ascend (it depends on torch; torch==2.13.0 for torch-npu 2.13)",
        )
    if kind == "cpu":
        return Probe(HOST_SCORE, f"torch CPU device ({ENV_DEVICE}={raw}): the Ascend code path on the host", "cpu")
    if kind == "cuda":
        import torch

        n = torch.cuda.device_count()
        if (index or 0) >= n:
            return Probe(None, f"device {raw} asked for but torch sees {n} CUDA device(s)")
        return Probe(HOST_SCORE, f"torch CUDA device ({ENV_DEVICE}={raw}): device-agnostic check", f"cuda:{index or 0}")
    if importlib.util.find_spec("torch_npu") is None:
        return Probe(None, f"torch_npu is not installed: {_INSTALL_NPU}, {_CPU_HINT}")
    torch_npu, error = _import_torch_npu()
    if torch_npu is None:
        if _cann_missing(error):
            return Probe(
                None,
                f"torch_npu is installed but Huawei CANN's libraries are missing ({error}): install CANN and "
                f"source its set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), {_CPU_HINT}",
            )
        return Probe(
            None,
            f"torch_npu is installed but does not import ({error}): torch-npu must match torch "
            "(torch-npu==2.13.0 for torch 2.13)",
        )
    n = int(torch_npu.npu.device_count())
    if n == 0:
        return Probe(
            None,
            "torch_npu imports but sees no NPU (device_count() == 0): check the driver with npu-smi info "
            f"and ASCEND_RT_VISIBLE_DEVICES, {_CPU_HINT}",
        )
    index = index or 0
    if index >= n:
        return Probe(None, f"device {raw} asked for but torch_npu sees {n} NPU(s)")
    name = torch_npu.npu.get_device_name(index)
    version = getattr(torch_npu, "__version__", "?")
    return Probe(NPU_SCORE, f"{name} (npu:{index} of {n}) via torch_npu {version}", f"npu:{index}")


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():  # read-only arrays are fine: kvhal never writes into inputs
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(a))


def _each_pool(pools: Pools) -> list[torch.Tensor]:
    """Every pool in the raw block layout's order: layer 0 K, layer 0 V, layer 1 K, ..."""
    return [pool for kv in zip(pools.k, pools.v) for pool in kv]


class AscendBackend(Backend):
    name = "ascend"
    formats = frozenset(formats.GGML_CLASSIC)  # its kernels implement the ggml KV formats only
    attention_tolerance = 1e-4  # f32 matmuls and softmax; 1e-6 is typical on the CPU device

    @classmethod
    def probe(cls) -> Probe:
        try:
            device = parse_options(cls.name, {}, OPTIONS)["device"]
        except SpecError as e:  # its variable's value: this process's settings (auto must not pass it over)
            return Probe(None, str(e), misconfigured=True)
        return _choose(device)

    def __init__(self, **options: Any) -> None:
        values = parse_options(self.name, options, OPTIONS)
        raw = values["device"]
        kind, _ = _parse_device(raw) or ("", None)
        if kind != "npu" and "torch" not in sys.modules:
            if importlib.util.find_spec("torch_npu") is not None:
                # with torch_npu installed, `import torch` auto-loads it and, without CANN, breaks torch for
                # the process; importing torch_npu first fails cleanly and leaves torch usable on the host
                _import_torch_npu()
        probe = _choose(raw)
        if not probe.available:
            raise BackendUnavailableError(f"ascend backend on {raw}: {probe.reason}")
        import torch

        from . import ggml_torch

        self.codec = ggml_torch
        self.device = torch.device(probe.device)
        self.batch_bytes: int = values["attention_batch_bytes"]

    # -- pools -----------------------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        import torch

        k = [
            torch.zeros(spec.pool_shape(n_blocks, "k"), dtype=torch.uint8, device=self.device)
            for _ in range(spec.n_layers)
        ]
        v = [
            torch.zeros(spec.pool_shape(n_blocks, "v"), dtype=torch.uint8, device=self.device)
            for _ in range(spec.n_layers)
        ]
        return Pools(spec, n_blocks, k, v, sum(int(x.numel()) for x in k + v))

    def _index(self, a: np.ndarray) -> torch.Tensor:
        return _from_numpy(np.asarray(a, np.int64)).to(self.device)

    def _rows(self, spec: CacheSpec, slots: np.ndarray) -> torch.Tensor:
        """Slot numbers -> row indices of the pool seen as ``[n_blocks * n_kv_heads * block_size, row_bytes]``."""
        bs, h = spec.block_size, spec.n_kv_heads
        slots = np.asarray(slots, np.int64)
        rows = ((slots // bs)[:, None] * h + np.arange(h)) * bs + (slots % bs)[:, None]
        return self._index(rows.ravel())

    def store(self, pools: Pools, layer: int, k: torch.Tensor, v: torch.Tensor, slots: np.ndarray) -> None:
        spec = pools.spec
        qk = self.codec.quantize(spec.k_format, k)
        qv = self.codec.quantize(spec.v_format, v)  # both quantized before either pool is written
        rows = self._rows(spec, slots)
        for pool, q in ((pools.k[layer], qk), (pools.v[layer], qv)):
            pool.view(-1, pool.shape[-1]).index_copy_(0, rows, q.reshape(-1, pool.shape[-1]))

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        s, d = self._rows(pools.spec, src), self._rows(pools.spec, dst)
        for pool in (pools.k[layer], pools.v[layer]):
            flat = pool.view(-1, pool.shape[-1])
            flat.index_copy_(0, d, flat.index_select(0, s))  # index_select copies: gather all, then scatter

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        import torch

        ids = self._index(check_block_ids(pools.n_blocks, block_ids))
        n = len(block_ids)
        # one gather per pool on the device, one copy to the host, in the raw block layout
        parts = [pool.index_select(0, ids).view(n, math.prod(pool.shape[1:])) for pool in _each_pool(pools)]
        return torch.cat(parts, dim=1).cpu().numpy()

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        data = check_block_data(pools.spec, data)
        ids = self._index(check_block_ids(pools.n_blocks, block_ids, len(data)))
        dev = _from_numpy(data).to(self.device)  # one copy to the device
        at = 0
        for pool in _each_pool(pools):
            size = math.prod(pool.shape[1:])
            pool.view(pool.shape[0], size).index_copy_(0, ids, dev[:, at : at + size])
            at += size

    def _pages(self, pool: torch.Tensor, fmt: str, ids: torch.Tensor, shape: tuple[int, int], n: int) -> torch.Tensor:
        """Pages ``ids`` (``shape`` = (seqs, pages each)) dequantized: ``[seqs, n_kv_heads, n, head_dim]`` f32."""
        b, nb = shape
        _, h, bs, rb = pool.shape
        pages = pool.index_select(0, ids).view(b, nb, h, bs, rb).permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, rb)
        return self.codec.dequantize(fmt, pages[:, :, :n].contiguous())

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        spec = pools.spec
        if n == 0:  # no page to gather (and a zero-size byte view cannot be reinterpreted as floats)
            empty = torch.zeros((0, spec.n_kv_heads, spec.head_dim), dtype=torch.float32, device=self.device)
            return empty, empty.clone()
        ids = self._index(block_ids)
        nb = len(block_ids)
        out = []
        for pool, fmt in ((pools.k[layer], spec.k_format), (pools.v[layer], spec.v_format)):
            x = self._pages(pool, fmt, ids, (1, nb), n)[0]  # [H, n, D]
            out.append(x.transpose(0, 1).contiguous())
        return out[0], out[1]

    # -- attention -------------------------------------------------------------------------------------

    def _batches(self, spec: CacheSpec, seq_lens: np.ndarray) -> list[np.ndarray]:
        """Sequences grouped so that each group's dequantized K/V (padded to its longest) fits the budget.

        Longest first, so a group pads little; a sequence over the budget on its own gets a group of one.
        """
        kv_bytes = 2 * spec.n_kv_heads * spec.head_dim * 4
        order = np.argsort(-seq_lens, kind="stable")
        groups: list[list[int]] = []
        for s in order.tolist():
            if groups and (len(groups[-1]) + 1) * int(seq_lens[groups[-1][0]]) * kv_bytes <= self.batch_bytes:
                groups[-1].append(s)
            else:
                groups.append([s])
        return [np.asarray(g, np.int64) for g in groups]

    def attention(self, q: torch.Tensor, pools: Pools, layer: int, batch: AttentionBatch) -> torch.Tensor:
        import torch

        spec = pools.spec
        k_pool, v_pool = pools.k[layer], pools.v[layer]
        n_tok, n_heads, dim = (int(x) for x in q.shape)
        hkv = spec.n_kv_heads
        group = n_heads // hkv
        seq_lens = np.asarray(batch.seq_lens, np.int64)
        q_lens = np.asarray(batch.q_lens, np.int64)
        block_table, scale, causal, window = batch.block_table, batch.scale, batch.causal, batch.window
        q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
        q = q.to(torch.float32)
        out = torch.empty((n_tok, n_heads, dim), dtype=torch.float32, device=self.device)
        for seqs in self._batches(spec, seq_lens):
            b = len(seqs)
            n_kv = int(seq_lens[seqs].max())
            nb = math.ceil(n_kv / spec.block_size)
            ids = self._index(np.maximum(block_table[seqs, :nb], 0).ravel())  # -1 padding -> page 0, masked
            k = self._pages(k_pool, spec.k_format, ids, (b, nb), n_kv)  # [b, hkv, n_kv, D] f32
            v = self._pages(v_pool, spec.v_format, ids, (b, nb), n_kv)
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
        Other dtypes, strings and ragged lists get the core's DTypeError (``host_float_array``).
        """
        import torch

        if isinstance(x, torch.Tensor):
            t = x.detach()
        elif isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            t = _from_numpy(host_float_array(x, what))
        else:
            try:
                t = torch.utils.dlpack.from_dlpack(x)
            except (TypeError, BufferError, RuntimeError, ValueError) as e:
                raise DTypeError(
                    f"{what} could not be read through DLPack ({e}); pass a torch tensor or numpy array"
                ) from e
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            host_float_array(t, what)  # raises the core's DTypeError: it takes these three dtypes only
            raise DTypeError(f"{what} has dtype {t.dtype}")  # pragma: no cover - the line above raised
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
        """Format.check_values with the common case on the device: two reductions, one small copy to the
        host. Only input that fails goes to the host, where the format's own check words the error."""
        import torch

        if not isinstance(x, torch.Tensor):
            fmt.check_values(self.to_numpy(x))
            return
        if x.numel() == 0:
            return
        bad, amax = torch.stack(
            [(~torch.isfinite(x)).any().to(torch.float32), x.abs().amax().to(torch.float32)]
        ).tolist()
        if bad or amax > fmt.max_abs:
            fmt.check_values(self.to_numpy(x.float() if x.dtype == torch.bfloat16 else x))
