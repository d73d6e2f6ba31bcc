"""kvhal's ``arm`` backend: store, load and attention as ONNX graphs run by onnxruntime.

Aimed at Arm CPUs, where onnxruntime's MLAS routes fp32 GEMMs to Arm KleidiAI micro-kernels (SME/SME2
cores); it runs on any onnxruntime CPU build. Pools are host numpy uint8 arrays in kvhal's layout;
a cache's integer views of them live in its ``Pools.state``, so one instance serves any number of caches.
One InferenceSession per (op, formats, shape class) is built on first use and cached process-wide;
token counts, batch sizes and context lengths are dynamic dims, so a decode step never builds one.

* store: a graph quantizes K/V bit-exactly as ``kvhal/formats/ggml.py``; the host scatters the rows
  into their slots (an ONNX graph cannot write into its input in place).
* load / attention: the graph gathers the pages and dequantizes them itself (bit ops, Cast, Mul).

Settings (backend option, else environment, else default):

* ``kleidiai=True/False`` (or 1/0) or ``KVHAL_KLEIDIAI=1/0`` -> session config ``mlas.disable_kleidiai`` "0"/"1";
  default on (onnxruntime's own default). It acts only on arm64; elsewhere it is accepted and inert.
* ``providers=[...]`` (or ``"a,b"``) or ``KVHAL_ORT_PROVIDERS=a,b`` -> the session providers; default CPU only.
* ``threads=N`` or ``KVHAL_ORT_THREADS=N`` -> intra-op threads per session; 0 (default) is onnxruntime's
  choice (one per physical core). An engine with its own thread pool sets it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvhal.backend import AttentionBatch, HostPoolsBackend, Pools, Probe
from kvhal.backend_util import Option, non_negative, one_of, parse_options
from kvhal.errors import BackendUnavailableError, SpecError
from kvhal.spec import CacheSpec

from . import graphs

__all__ = ["ArmBackend", "kleidiai_can_apply"]

KLEIDIAI_KEY = "mlas.disable_kleidiai"
NO_WINDOW = 1 << 62
MIN_ORT = (1, 25)  # ONNX opset 26 (BitCast)


def _providers(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


OPTIONS = (
    Option("kleidiai", int, 1, env="KVHAL_KLEIDIAI", check=one_of(0, 1), help="1: KleidiAI on, 0: off"),
    Option(
        "providers",
        str,
        "CPUExecutionProvider",
        env="KVHAL_ORT_PROVIDERS",
        check=lambda v: None if _providers(v) else "names no provider; e.g. CPUExecutionProvider",
        help="onnxruntime providers, comma-separated",
    ),
    Option("threads", int, 0, env="KVHAL_ORT_THREADS", check=non_negative, help="intra-op threads, 0: onnxruntime's"),
)


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


def resolve_settings(options: dict[str, Any]) -> Settings:
    """Option beats environment beats default (``parse_options``); invalid values are SpecErrors.

    ``kleidiai`` also takes True/False and ``providers`` a list of names: both become the option's
    own type (0/1, a comma list) before parsing."""
    given = dict(options)
    if isinstance(given.get("kleidiai"), bool):
        given["kleidiai"] = int(given["kleidiai"])
    names = given.get("providers")
    if isinstance(names, (list, tuple)) and all(isinstance(p, str) for p in names):
        given["providers"] = ",".join(names)
    values = parse_options("arm", given, OPTIONS)

    def source(opt: Option) -> str:
        if given.get(opt.name) is not None:
            return f"{opt.name} option"
        raw = os.environ.get(opt.env or "", "").strip()
        return f"{opt.env}={raw}" if raw else f"default; {opt.env} unset"

    k, p, _ = OPTIONS
    return Settings(values["kleidiai"] == 1, source(k), _providers(values["providers"]), source(p), values["threads"])


def _runtime_problem() -> str | None:
    """Why onnxruntime/onnx cannot run the graphs here (None: they can), from package metadata only."""
    for module in ("onnxruntime", "onnx"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install kvhal-arm, or pip install onnxruntime onnx)"
    try:
        version = importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        return None  # a build installed under another distribution name (onnxruntime-gpu, ...)
    parts = version.split(".")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() and (int(parts[0]), int(parts[1])) < MIN_ORT:
        return (
            f"onnxruntime {version} is too old: kvhal-arm needs onnxruntime >= {MIN_ORT[0]}.{MIN_ORT[1]} "
            f"(ONNX opset {graphs.OPSET}, BitCast); pip install -U onnxruntime"
        )
    return None


@dataclass
class _CacheState:
    """One cache's zero-copy views of its pools as the graphs' integer element types, per layer."""

    k: list[np.ndarray]
    v: list[np.ndarray]


# Sessions are shared by every ArmBackend with the same settings: two caches of one shape class
# build their graphs once. InferenceSession.run is thread-safe; building is serialized.
_SESSIONS: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()


class ArmBackend(HostPoolsBackend):
    name = "arm"
    formats = frozenset(graphs.FORMATS)
    # fp32 GEMM + softmax against the float64 oracle; measured ~2e-6 on the contract cases
    attention_tolerance = 2e-5
    # floats one attention run may hold per big intermediate (scores, dequantized K/V); larger
    # batches split into several runs by sequence, then by query chunk
    run_budget: ClassVar[int] = 1 << 25

    @classmethod
    def probe(cls) -> Probe:
        problem = _runtime_problem()
        if problem is not None:
            return Probe(None, problem)
        try:
            s = resolve_settings({})
        except SpecError as e:
            return Probe(None, str(e))
        score = 30 if kleidiai_can_apply() else 5
        reason = f"onnxruntime graphs, providers {','.join(s.providers)} ({s.providers_source}); {s.kleidiai_text()}"
        return Probe(score, reason, device=f"host ({s.providers[0]})")

    def __init__(self, **options: Any) -> None:
        self.settings = resolve_settings(options)
        problem = _runtime_problem()
        if problem is not None:
            raise BackendUnavailableError(f"backend 'arm' is unavailable: {problem}")
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
        self.sessions: dict[tuple[Any, ...], Any] = {}  # the sessions this backend has used (under _LOCK)

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

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        pools = super().allocate(spec, n_blocks)
        kt, vt = graphs.view_dtype(spec.k_format), graphs.view_dtype(spec.v_format)
        # views, not copies: write_blocks and copy_slots write pools.k/v, the graphs read these
        pools.state = _CacheState([k.view(kt) for k in pools.k], [v.view(vt) for v in pools.v])
        return pools

    def store(self, pools: Pools, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        sp = pools.spec
        sess = self._session("store", sp.k_format, sp.v_format, sp.n_kv_heads, sp.head_dim)
        k_rows, v_rows = sess.run(
            None, {"k": np.ascontiguousarray(k, np.float32), "v": np.ascontiguousarray(v, np.float32)}
        )
        blk, off = slots // sp.block_size, slots % sp.block_size
        pools.state.k[layer][blk, :, off, :] = k_rows
        pools.state.v[layer][blk, :, off, :] = v_rows

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        sp = pools.spec
        if n == 0:
            empty = np.zeros((0, sp.n_kv_heads, sp.head_dim), np.float32)
            return empty, empty.copy()
        sess = self._session("load", sp.k_format, sp.v_format, sp.n_kv_heads, sp.block_size, sp.head_dim)
        feeds = {
            "k_pool": pools.state.k[layer],
            "v_pool": pools.state.v[layer],
            "block_ids": np.asarray(block_ids, np.int64),
            "n": np.array([n], np.int64),
        }
        k, v = sess.run(None, feeds)
        return k, v

    def attention(self, q: np.ndarray, pools: Pools, layer: int, batch: AttentionBatch) -> np.ndarray:
        sp = pools.spec
        q = np.ascontiguousarray(q, np.float32)
        n_heads = q.shape[1]
        sess = self._session("attention", sp.k_format, sp.v_format, n_heads, sp.n_kv_heads, sp.block_size, sp.head_dim)
        fixed = {
            "q": q,
            "k_pool": pools.state.k[layer],
            "v_pool": pools.state.v[layer],
            "scale": np.array(batch.scale, np.float32),
            "causal": np.array(batch.causal, np.bool_),
            "window": np.array(NO_WINDOW if batch.window is None else batch.window, np.int64),
        }
        lens = batch.seq_lens.astype(np.int64)
        ql = batch.q_lens.astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(ql)[:-1]])
        outs = [
            sess.run(["out"], {**fixed, **self._run_inputs(sp, batch.block_table, lens, run, n_heads)})[0]
            for run in self._plan(sp, lens, ql, starts, n_heads)
        ]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    def _plan(
        self, sp: CacheSpec, lens: np.ndarray, ql: np.ndarray, starts: np.ndarray, n_heads: int
    ) -> list[list[tuple[int, ...]]]:
        """Pieces (seq, first q row, count, first position) grouped into runs that fit ``run_budget``.

        A run holds ``seqs * L * (queries * n_heads + 2 * kv_heads * head_dim)`` floats at its peak
        (scores plus dequantized K and V, L the longest context, padded). Pieces keep q's row order, so
        the runs' outputs concatenate into the answer.
        """
        bs = sp.block_size
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

    @staticmethod
    def _run_inputs(
        sp: CacheSpec, table: np.ndarray, lens: np.ndarray, run: list[tuple[int, ...]], n_heads: int
    ) -> dict[str, np.ndarray]:
        seq, first, count, first_pos, ctx = (np.array(c, np.int64) for c in zip(*run, strict=True))
        mq = int(count.max())
        i = np.arange(mq, dtype=np.int64)
        group = n_heads // sp.n_kv_heads
        return {
            "block_table": np.ascontiguousarray(table[seq, : int(ctx.max()) // sp.block_size]),
            "seq_lens": lens[seq],
            # padded queries repeat the last real one and are dropped by out_index
            "q_index": first[:, None] + np.minimum(i[None, :], count[:, None] - 1),
            "pos": np.repeat(first_pos[:, None] + i[None, :], group, axis=1),
            "out_index": np.concatenate([r * mq + np.arange(c) for r, c in enumerate(count.tolist())]),
        }
