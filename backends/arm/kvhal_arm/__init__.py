"""kvhal's ``arm`` backend: store, load and attention as ONNX graphs run by onnxruntime.

Aimed at Arm CPUs, where onnxruntime's MLAS routes fp32 GEMMs to Arm KleidiAI micro-kernels (SME/SME2
cores); it runs on any onnxruntime CPU build. Pools are host numpy uint8 arrays in kvhal's layout.
One InferenceSession per (op, formats, shape class) is built on first use and cached process-wide;
token counts, batch sizes and context lengths are dynamic dims, so a decode step never builds one.

* store: a graph quantizes K/V bit-exactly as ``kvhal/formats/ggml.py``; the host scatters the rows
  into their slots (an ONNX graph cannot write into its input in place).
* load / attention: the graph gathers the pages and dequantizes them itself (bit ops, Cast, Mul).

Settings (backend option, else environment, else default):

* ``kleidiai=True/False`` or ``KVHAL_KLEIDIAI=1/0`` -> session config ``mlas.disable_kleidiai`` "0"/"1";
  default on (onnxruntime's own default). It acts only on arm64; elsewhere it is accepted and inert.
* ``providers=[...]`` or ``KVHAL_ORT_PROVIDERS=a,b`` -> the session providers; default CPU only.
* ``threads=N`` or ``KVHAL_ORT_THREADS=N`` -> intra-op threads per session; 0 (default) is onnxruntime's
  choice (one per physical core). An engine with its own thread pool sets it.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, SpecError
from kvhal.spec import CacheSpec

from . import graphs

__all__ = ["ArmBackend", "kleidiai_can_apply"]

KLEIDIAI_KEY = "mlas.disable_kleidiai"
DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
OPTIONS = ("kleidiai", "providers", "threads")
NO_WINDOW = 1 << 62


def kleidiai_can_apply() -> bool:
    """onnxruntime ships KleidiAI kernels only in its arm64 builds."""
    return platform.machine().lower() in ("aarch64", "arm64")


@dataclass(frozen=True)
class Settings:
    kleidiai: bool
    kleidiai_source: str
    providers: tuple[str, ...]
    providers_source: str
    threads: int = 0

    @property
    def disable_kleidiai(self) -> str:
        """The value given to the session config entry ``mlas.disable_kleidiai``."""
        return "0" if self.kleidiai else "1"

    def kleidiai_text(self) -> str:
        where = (
            f"applies on this {platform.machine()} machine"
            if kleidiai_can_apply()
            else f"cannot apply on this {platform.machine() or 'unknown'} machine (arm64 only)"
        )
        state = "on" if self.kleidiai else "off"
        return f"KleidiAI {state} ({self.kleidiai_source}; {KLEIDIAI_KEY}={self.disable_kleidiai}), {where}"


def _parse_kleidiai(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).strip() in ("0", "1"):
        return str(value).strip() == "1"
    raise SpecError(f"{what}={value!r}: use 1 (KleidiAI on) or 0 (off), or True/False as a backend option")


def _parse_providers(value: Any, what: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) for p in items):
        raise SpecError(f"{what}={value!r}: give onnxruntime provider names, e.g. ['CPUExecutionProvider']")
    out = tuple(p.strip() for p in items if p.strip())
    if not out:
        raise SpecError(f"{what}={value!r} names no provider; e.g. CPUExecutionProvider")
    return out


def _parse_threads(value: Any, what: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if isinstance(value, bool) or n < 0 or str(value).strip() != str(n):
        raise SpecError(f"{what}={value!r}: give a thread count >= 0 (0 lets onnxruntime choose)")
    return n


def resolve_settings(kleidiai: Any = None, providers: Any = None, threads: Any = None) -> Settings:
    """Option beats environment beats default; invalid values raise SpecError naming the fix."""
    env_k = os.environ.get("KVHAL_KLEIDIAI", "").strip()
    if kleidiai is not None:
        k, k_src = _parse_kleidiai(kleidiai, "kleidiai"), f"kleidiai={kleidiai!r} option"
    elif env_k:
        k, k_src = _parse_kleidiai(env_k, "KVHAL_KLEIDIAI"), f"KVHAL_KLEIDIAI={env_k}"
    else:
        k, k_src = True, "default; KVHAL_KLEIDIAI unset"
    env_p = os.environ.get("KVHAL_ORT_PROVIDERS", "").strip()
    if providers is not None:
        p, p_src = _parse_providers(providers, "providers"), "providers option"
    elif env_p:
        p, p_src = _parse_providers(env_p, "KVHAL_ORT_PROVIDERS"), "KVHAL_ORT_PROVIDERS"
    else:
        p, p_src = DEFAULT_PROVIDERS, "default"
    env_t = os.environ.get("KVHAL_ORT_THREADS", "").strip()
    if threads is not None:
        t = _parse_threads(threads, "threads")
    else:
        t = _parse_threads(env_t, "KVHAL_ORT_THREADS") if env_t else 0
    return Settings(k, k_src, p, p_src, t)


def _missing_packages() -> str | None:
    for module, dist in (("onnxruntime", "onnxruntime"), ("onnx", "onnx")):
        if importlib.util.find_spec(module) is None:
            return f"{dist} is not installed (pip install kvhal-arm, or pip install onnxruntime onnx)"
    return None


# Sessions are shared by every ArmBackend with the same settings: two caches of one shape class
# build their graphs once. InferenceSession.run is thread-safe; building is serialized.
_SESSIONS: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()


class ArmBackend(Backend):
    name = "arm"
    formats = frozenset(graphs.FORMATS)
    # fp32 GEMM + softmax against the float64 oracle; measured ~2e-6 on the contract cases
    attention_tolerance = 2e-5
    # floats one attention run may hold per big intermediate (scores, dequantized K/V); larger
    # batches split into several runs by sequence, then by query chunk
    run_budget: ClassVar[int] = 1 << 25

    @classmethod
    def probe(cls) -> Probe | None:
        if _missing_packages() is not None:
            return None
        try:
            s = resolve_settings()
        except SpecError:
            return None
        score = 30 if kleidiai_can_apply() else 5
        reason = f"onnxruntime graphs, providers {','.join(s.providers)} ({s.providers_source}); {s.kleidiai_text()}"
        return Probe(score=score, reason=reason, device=f"host ({s.providers[0]})")

    @classmethod
    def unavailable_reason(cls) -> str:
        missing = _missing_packages()
        if missing:
            return missing
        try:
            resolve_settings()
        except SpecError as e:
            return str(e)
        return "its probe found no usable device"  # pragma: no cover - probe() succeeds here

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise SpecError(f"backend 'arm' has no option(s) {unknown}; it takes {list(OPTIONS)}")
        self.settings = resolve_settings(options.get("kleidiai"), options.get("providers"), options.get("threads"))
        missing = _missing_packages()
        if missing:
            raise BackendUnavailableError(f"backend 'arm' is unavailable: {missing}")
        import onnxruntime

        self._ort = onnxruntime
        available = onnxruntime.get_available_providers()
        absent = [p for p in self.settings.providers if p not in available]
        if absent:
            raise BackendUnavailableError(
                f"onnxruntime provider(s) {', '.join(absent)} ({self.settings.providers_source}) are not available "
                f"in this onnxruntime build; available: {', '.join(available)} "
                "(set KVHAL_ORT_PROVIDERS or providers=[...] to some of those)"
            )
        self.sessions: dict[tuple[Any, ...], Any] = {}  # the sessions this backend has used

    def describe(self) -> str:
        """One line for ``kvhal info`` and logs: runtime, providers, KleidiAI state and whether it can act."""
        s = self.settings
        return (
            f"arm: onnxruntime {self._ort.__version__}, providers {','.join(s.providers)} ({s.providers_source}); "
            f"{s.kleidiai_text()}; {s.threads or 'default'} intra-op threads; {len(self.sessions)} session(s) built"
        )

    def session_options(self, exact: bool) -> Any:
        so = self._ort.SessionOptions()
        so.add_session_config_entry(KLEIDIAI_KEY, self.settings.disable_kleidiai)
        so.log_severity_level = 3
        so.intra_op_num_threads = self.settings.threads
        # the quantize/dequantize graphs must reproduce the spec bit for bit: only the basic,
        # semantics-preserving rewrites there; attention may take the fused MatMul rewrites
        level = self._ort.GraphOptimizationLevel
        so.graph_optimization_level = level.ORT_ENABLE_BASIC if exact else level.ORT_ENABLE_ALL
        return so

    def _session(self, op: str, *key: Any) -> Any:
        full = (op, *key, self.settings.providers, self.settings.kleidiai, self.settings.threads)
        sess = self.sessions.get(full)
        if sess is not None:
            return sess
        with _LOCK:
            sess = _SESSIONS.get(full)
            if sess is None:
                model = getattr(graphs, f"{op}_graph")(*key)
                try:
                    sess = self._ort.InferenceSession(
                        model, self.session_options(exact=op != "attention"), providers=list(self.settings.providers)
                    )
                except Exception as e:
                    raise BackendUnavailableError(
                        f"onnxruntime {self._ort.__version__} could not build the arm {op} graph ({type(e).__name__}: "
                        f"{e}); kvhal-arm needs onnxruntime >= 1.25 (ONNX opset {graphs.OPSET}, BitCast)"
                    ) from e
                _SESSIONS[full] = sess
        self.sessions[full] = sess
        return sess

    # -- the backend contract -------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        self._dtypes = (graphs.view_dtype(spec.k_format), graphs.view_dtype(spec.v_format))
        pools = []
        for _ in range(spec.n_layers):
            k = np.zeros(spec.pool_shape(n_blocks, "k"), np.uint8)
            v = np.zeros(spec.pool_shape(n_blocks, "v"), np.uint8)
            pools.append(LayerPools(k, v, k.nbytes + v.nbytes))
        return pools

    def _views(self, pools: LayerPools) -> tuple[np.ndarray, np.ndarray]:
        """The pools as the graphs' element types: zero-copy views of the same bytes."""
        return pools.k.view(self._dtypes[0]), pools.v.view(self._dtypes[1])

    def store(self, pools: LayerPools, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        sp = self.spec
        sess = self._session("store", sp.k_format, sp.v_format, sp.n_kv_heads, sp.head_dim)
        k_rows, v_rows = sess.run(
            None, {"k": np.ascontiguousarray(k, np.float32), "v": np.ascontiguousarray(v, np.float32)}
        )
        blk, off = slots // sp.block_size, slots % sp.block_size
        kp, vp = self._views(pools)
        kp[blk, :, off, :] = k_rows
        vp[blk, :, off, :] = v_rows

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        sp = self.spec
        if n == 0:
            empty = np.zeros((0, sp.n_kv_heads, sp.head_dim), np.float32)
            return empty, empty.copy()
        sess = self._session("load", sp.k_format, sp.v_format, sp.n_kv_heads, sp.block_size, sp.head_dim)
        kp, vp = self._views(pools)
        feeds = {"k_pool": kp, "v_pool": vp, "block_ids": np.asarray(block_ids, np.int64), "n": np.array([n], np.int64)}
        k, v = sess.run(None, feeds)
        return k, v

    def attention(
        self,
        q: np.ndarray,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> np.ndarray:
        sp = self.spec
        q = np.ascontiguousarray(q, np.float32)
        n_heads = q.shape[1]
        sess = self._session("attention", sp.k_format, sp.v_format, n_heads, sp.n_kv_heads, sp.block_size, sp.head_dim)
        kp, vp = self._views(pools)
        fixed = {
            "q": q,
            "k_pool": kp,
            "v_pool": vp,
            "scale": np.array(scale, np.float32),
            "causal": np.array(causal, np.bool_),
            "window": np.array(NO_WINDOW if window is None else window, np.int64),
        }
        lens = seq_lens.astype(np.int64)
        ql = q_lens.astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(ql)[:-1]])
        outs = [
            sess.run(["out"], {**fixed, **self._run_inputs(block_table, lens, run, n_heads)})[0]
            for run in self._plan(lens, ql, starts, n_heads)
        ]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    def _plan(self, lens: np.ndarray, ql: np.ndarray, starts: np.ndarray, n_heads: int) -> list[list[tuple[int, ...]]]:
        """Pieces (seq, first q row, count, first position) grouped into runs that fit ``run_budget``.

        A run holds ``seqs * L * (queries * n_heads + 2 * kv_heads * head_dim)`` floats at its peak
        (scores plus dequantized K and V, L the longest context, padded). Pieces keep q's row order, so
        the runs' outputs concatenate into the answer.
        """
        sp, bs = self.spec, self.spec.block_size
        kv_cost = 2 * sp.n_kv_heads * sp.head_dim
        pieces = []
        for s, (n_kv, n_q, a) in enumerate(zip(lens.tolist(), ql.tolist(), starts.tolist(), strict=True)):
            ctx = -(-n_kv // bs) * bs
            chunk = max(1, (self.run_budget // ctx - kv_cost) // n_heads)
            for i in range(0, n_q, chunk):
                pieces.append((s, a + i, min(chunk, n_q - i), n_kv - n_q + i, ctx))
        runs: list[list[tuple[int, ...]]] = [[]]
        for piece in pieces:
            trial = runs[-1] + [piece]
            ctx, nq = max(p[4] for p in trial), max(p[2] for p in trial)
            if runs[-1] and len(trial) * ctx * (nq * n_heads + kv_cost) > self.run_budget:
                runs.append([piece])
            else:
                runs[-1] = trial
        return runs

    def _run_inputs(
        self, table: np.ndarray, lens: np.ndarray, run: list[tuple[int, ...]], n_heads: int
    ) -> dict[str, np.ndarray]:
        seq, first, count, first_pos, ctx = (np.array(c, np.int64) for c in zip(*run, strict=True))
        mq = int(count.max())
        i = np.arange(mq, dtype=np.int64)
        group = n_heads // self.spec.n_kv_heads
        return {
            "block_table": np.ascontiguousarray(table[seq, : int(ctx.max()) // self.spec.block_size]),
            "seq_lens": lens[seq],
            # padded queries repeat the last real one and are dropped by out_index
            "q_index": first[:, None] + np.minimum(i[None, :], count[:, None] - 1),
            "pos": np.repeat(first_pos[:, None] + i[None, :], group, axis=1),
            "out_index": np.concatenate([r * mq + np.arange(c) for r, c in enumerate(count.tolist())]),
        }

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        bs = self.spec.block_size
        for pool in (pools.k, pools.v):
            pool[dst // bs, :, dst % bs, :] = pool[src // bs, :, src % bs, :]
