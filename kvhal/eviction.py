"""Eviction policies: which positions of a sequence to keep when it must shrink.

A policy only chooses positions; ``KVCache.evict`` moves the kept rows byte for byte (no
re-quantization; with an f16 tail, ``TailStore.keep_rows`` lays them out as a store would) and reports every
dropped position in an ``EvictionResult``. A policy keeps the same
positions in all layers and KV heads (per-head scores summed over heads and layers), except ``AdaKV``,
which keeps its own positions per (layer, KV head) inside the sequence's shared pages.

* ``SinkWindow(sinks, window)`` — StreamingLLM: the first ``sinks`` tokens and the most recent ones.
* ``H2O(heavy, recent)`` — the ``recent`` newest tokens plus the ``heavy`` tokens with the largest
  attention mass received so far (accumulated by ``attention(..., observe=True)``).
* ``SnapKV(window, kernel, pool)`` — at prefill: the last ``window`` tokens plus the prefix tokens the
  observation window (the last ``window`` queries of the latest observed attention call) attends to
  most, after a 1-d pooling of the scores (``avg``: count_include_pad like torch's ``avg_pool1d``).
* ``Knorm()`` — kvpress's KnormPress: the keys of lowest L2 norm.
* ``ExpectedAttention(n_future, n_sink)`` — kvpress's ExpectedAttentionPress: each key's expected attention from
  future queries, from the prefill's query statistics (``expected_queries``) and the model's RoPE.
* ``AdaKV(press, ceiling, safeguard)`` — per-head budgets over ``press``'s per-head scores (SnapKV, H2O,
  ExpectedAttention): each
  layer keeps ``keep`` positions per KV head on average, the heads' normalised scores compared across heads,
  no head above ``ceiling * keep`` (the pages held) and none below its ``safeguard * keep`` best.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from .backend import AttentionBatch, Backend, Pools
from .backend_util import attention_mass_lse
from .errors import SequenceError, SpecError, UnsupportedError
from .seqs import Seq, SeqTable
from .spec import CacheSpec
from .tail import TailStore


def _count(name: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < minimum:
        raise SpecError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Scores:
    """What a policy may look at: per-position attention mass summed over layers and KV heads."""

    mass: np.ndarray  # accumulated over every observed query (H2O); zeros if nothing was observed
    window_mass: np.ndarray  # from the last observed call's final ``window`` queries (SnapKV)
    window: int  # the observation window those were taken over
    observed: bool
    # per observed layer, the same two per KV head: float64 ``[n_kv_heads, n]`` each (per-head policies)
    heads: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # the L2 norm of every stored key, float64 ``[n_layers, n_kv_heads, n]``, read when called (``Knorm``)
    key_norms: Callable[[], np.ndarray] | None = None
    # a layer's K, V of positions [0, n) as ``load`` returns them, f32 ``[n, n_kv_heads, head_dim]`` (``ExpectedAttention``)
    kv: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None
    n_layers: int = 0  # the cache's layers (``ExpectedAttention`` needs statistics for each)


class Policy(ABC):
    name: str
    needs_scores: ClassVar[bool] = True  # whether ``select`` reads observed attention mass (attention(observe=True))
    per_head: ClassVar[bool] = False  # True: ``select_heads`` chooses per (layer, KV head) instead of ``select``

    @abstractmethod
    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        """Ascending positions (< n, at most ``keep`` of them) to keep."""

    def head_scores(self, n: int, keep: int, scores: Scores, layer: int) -> np.ndarray:
        """Per KV head of ``layer``, each position's score ``[n_kv_heads, n]`` (+inf: always kept), comparable across
        heads. What ``AdaKV`` ranks."""
        raise SpecError(f"{type(self).__name__} has no per-head scores; AdaKV takes SnapKV, H2O or ExpectedAttention")

    def select_heads(self, n: int, keep: int, scores: Scores, n_layers: int) -> list[list[np.ndarray]]:
        """Per layer, per KV head, ascending positions to keep (``per_head`` policies)."""
        raise SpecError(f"{type(self).__name__} keeps the same positions in every head: call select")

    def with_queries(self, queries: Any) -> Policy:
        """This policy with per-layer query statistics (``expected_queries``), for ``ExpectedAttention`` (alone or
        under ``AdaKV``)."""
        raise SpecError(f"{type(self).__name__} takes no query statistics (ExpectedAttention does)")


@dataclass(frozen=True)
class SinkWindow(Policy):
    sinks: int = 4
    window: int | None = None  # None: as many recent tokens as keep_tokens allows
    name: str = field(default="sink_window", init=False)
    needs_scores: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _count("SinkWindow.sinks", self.sinks)
        if self.window is not None:
            _count("SinkWindow.window", self.window, 1)

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        sinks = min(self.sinks, keep, n)
        recent = keep - sinks if self.window is None else min(self.window, keep - sinks)
        recent = min(recent, n - sinks)
        return np.r_[np.arange(sinks), np.arange(n - recent, n)].astype(np.int64)


@dataclass(frozen=True)
class H2O(Policy):
    heavy: int
    recent: int
    name: str = field(default="h2o", init=False)

    def __post_init__(self) -> None:
        _count("H2O.heavy", self.heavy)
        _count("H2O.recent", self.recent)

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        if not scores.observed:
            raise SpecError("H2O needs attention scores: call attention(..., observe=True) on this sequence first")
        recent = min(self.recent, keep, n)
        heavy = min(self.heavy, keep - recent, n - recent)
        older = scores.mass[: n - recent]
        top = np.argsort(-older, kind="stable")[:heavy]  # ties: the earlier position
        return np.sort(np.r_[top, np.arange(n - recent, n)]).astype(np.int64)

    def head_scores(self, n: int, keep: int, scores: Scores, layer: int) -> np.ndarray:
        out = _observed(scores, layer)[0].copy()  # every query row's weights sum to 1 in every head: comparable
        out[:, n - min(self.recent, keep, n) :] = np.inf
        return out


@dataclass(frozen=True)
class SnapKV(Policy):
    window: int = 32
    kernel: int = 5
    pool: str = "avg"
    name: str = field(default="snapkv", init=False)

    def __post_init__(self) -> None:
        _count("SnapKV.window", self.window, 1)
        _count("SnapKV.kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise SpecError(f"SnapKV.kernel must be odd (same-length pooling), got {self.kernel}")
        if not isinstance(self.pool, str) or self.pool not in ("avg", "max"):  # (an array compares elementwise)
            raise SpecError(f"SnapKV.pool must be 'avg' or 'max', got {self.pool!r}")

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        if not scores.observed:
            raise SpecError("SnapKV needs the prefill's attention: call attention(..., observe=True) on it first")
        if scores.window != self.window:
            raise SpecError(
                f"SnapKV(window={self.window}) needs the mass of the last {self.window} queries; this cache "
                f"observes {scores.window}: create it with observe_window={self.window}"
            )
        win = min(self.window, keep, n)
        prefix = scores.window_mass[: n - win]
        pooled = pool1d(prefix, self.kernel, self.pool)
        top = np.argsort(-pooled, kind="stable")[: max(0, min(keep - win, n - win))]
        return np.sort(np.r_[top, np.arange(n - win, n)]).astype(np.int64)

    def head_scores(self, n: int, keep: int, scores: Scores, layer: int) -> np.ndarray:
        window_mass = _observed(scores, layer)[1]
        if scores.window != self.window:
            raise SpecError(
                f"SnapKV(window={self.window}) needs observe_window={self.window}; this cache observes {scores.window}"
            )
        win = min(self.window, keep, n)
        out = np.full((window_mass.shape[0], n), np.inf)  # the observation window: kept by every head
        for h, m in enumerate(window_mass):  # the window's mean weights per head: comparable across heads
            out[h, : n - win] = pool1d(m[: n - win], self.kernel, self.pool)
        return out


@dataclass(frozen=True)
class Knorm(Policy):
    """kvpress's ``KnormPress``: keep the keys of lowest L2 norm (low-norm keys draw the most attention,
    Devoto et al. 2024). Reads the stored keys, no attention scores; the norms summed over layers and KV heads
    choose one set of positions. Not a scorer for ``AdaKV``: each head's norms have their own scale (on SmolLM2-135M
    comparing them across heads measured KL 0.47 against 3.5e-2 for this uniform choice)."""

    name: str = field(default="knorm", init=False)
    needs_scores: ClassVar[bool] = False

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        assert scores.key_norms is not None
        total = scores.key_norms().sum(axis=(0, 1))
        return np.sort(np.argsort(total, kind="stable")[: min(keep, n)]).astype(np.int64)


def _real(name: str, x: object, minimum: float = 0.0) -> float:
    ok = isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
    try:
        value = float(x) if ok else math.nan  # type: ignore[arg-type]
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value) or value < minimum:
        raise SpecError(f"{name} must be a finite real number >= {minimum}, got {x!r}")
    return value


def expected_queries(
    q: np.ndarray,
    positions: np.ndarray,
    inv_freq: np.ndarray,
    rope_scale: float = 1.0,
    n_sink: int = 4,
    n_future: int = 512,
) -> tuple[np.ndarray, np.ndarray]:
    """kvpress's ``ExpectedAttentionPress`` statistics of one layer's queries, re-derived: the mean and covariance
    (per query head, over the rows at positions ``>= n_sink``) of the queries before RoPE, both carried by the mean
    RoPE rotation of the next ``n_future`` positions (``max(positions) + 1`` on). ``q``: the queries as attention
    gets them, after RoPE (transformers' rotate-half layout: channel ``i`` pairs with ``i + head_dim / 2``),
    ``[n, n_heads, head_dim]``; ``positions``: their RoPE positions ``[n]``; ``inv_freq``: the RoPE frequencies
    ``[head_dim / 2]`` and ``rope_scale`` the factor on cos and sin (transformers' ``attention_scaling``).
    Returns float64 ``mean [n_heads, head_dim]`` and ``cov [n_heads, head_dim, head_dim]``."""
    try:
        q, inv_freq = np.asarray(q, np.float64), np.asarray(inv_freq, np.float64)
    except (TypeError, ValueError):
        raise SpecError(
            f"expected_queries takes real arrays q and inv_freq; got {type(q).__name__}, {type(inv_freq).__name__}"
        ) from None
    positions = np.asarray(positions)
    if positions.dtype.kind not in "iu":  # a float or a string is not a RoPE position
        raise SpecError(f"expected_queries takes integer positions [n]; got dtype {positions.dtype}")
    if q.ndim != 3 or positions.shape != q.shape[:1] or inv_freq.shape != (q.shape[2] // 2,) or q.shape[2] % 2:
        raise SpecError(
            f"expected_queries takes q [n, n_heads, head_dim], positions [n] and inv_freq [head_dim / 2]; got "
            f"{q.shape}, {positions.shape}, {inv_freq.shape}"
        )
    scale = _real("rope_scale", rope_scale)
    if scale == 0:  # the queries are divided by it
        raise SpecError("rope_scale must be > 0 (transformers' attention_scaling, 1.0 for the default RoPE), got 0")
    n_sink, n_future = _count("n_sink", n_sink), _count("n_future", n_future, 1)
    half = q.shape[2] // 2
    rows = positions >= n_sink
    if not rows.any():
        raise SpecError(f"expected_queries needs queries at positions >= n_sink={n_sink}; got none")
    ang = positions[rows, None].astype(np.float64) * inv_freq  # [n, half]
    c, sn = (np.cos(ang) * scale)[:, None], (np.sin(ang) * scale)[:, None]
    x1, x2 = q[rows, :, :half], q[rows, :, half:]
    pre = np.concatenate([x1 * c + x2 * sn, x2 * c - x1 * sn], axis=-1) / scale**2  # R(p)^-1 q
    mean = pre.mean(axis=0)
    centred = pre - mean
    by_head = centred.transpose(1, 0, 2)  # [H, n, d]: one GEMM per head
    cov = np.matmul(by_head.transpose(0, 2, 1), by_head) / len(pre)
    t = np.arange(int(positions.max()) + 1, int(positions.max()) + 1 + n_future, dtype=np.float64)
    cbar = np.cos(t[:, None] * inv_freq).mean(axis=0) * scale
    sbar = np.sin(t[:, None] * inv_freq).mean(axis=0) * scale
    rot = np.zeros((2 * half, 2 * half))  # the mean rotation: [[cos, -sin], [sin, cos]] per channel pair
    i = np.arange(half)
    rot[i, i], rot[i + half, i + half] = cbar, cbar
    rot[i, i + half], rot[i + half, i] = -sbar, sbar
    return mean @ rot.T, rot @ cov @ rot.T


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """kvpress's ``ExpectedAttentionPress``: each key's expected attention from future queries, whose statistics
    (``expected_queries``: the prefill's queries before RoPE, past the first ``n_sink``, rotated on by the mean RoPE
    rotation of the next ``n_future`` positions) give per query head ``softmax_j(mu . k_j / sqrt(d) +
    k_j^T S k_j / (2 d))``, averaged over each KV head's query heads and (``vnorm``) times ``|v_j|`` after adding
    ``epsilon``. The first ``n_sink`` positions are always kept. kvpress keeps per layer and head; here the scores
    summed over layers and KV heads choose one set (under ``AdaKV``: per head). ``queries``: per layer, the
    ``(mean, cov)`` of ``expected_queries``, which the transformers integration fills in from the prefill (a
    ``press``); a direct ``KVCache.evict`` passes ``with_queries(...)``."""

    n_future: int = 512
    n_sink: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0
    queries: tuple[tuple[np.ndarray, np.ndarray], ...] | None = field(default=None, compare=False, repr=False)
    name: str = field(default="expected_attention", init=False)
    needs_scores: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _count("ExpectedAttention.n_future", self.n_future, 1)
        _count("ExpectedAttention.n_sink", self.n_sink)
        for what in ("covariance", "vnorm"):
            if not isinstance(getattr(self, what), (bool, np.bool_)):
                raise SpecError(f"ExpectedAttention.{what} must be a bool, got {getattr(self, what)!r}")
        _real("ExpectedAttention.epsilon", self.epsilon)
        if self.queries is not None:
            if not isinstance(self.queries, (tuple, list)):  # an int is not iterable, a str not pairs
                raise SpecError(
                    f"ExpectedAttention.queries must be one (mean, cov) pair per layer, as expected_queries returns "
                    f"(or None), got {type(self.queries).__name__}"
                )
            for i, pair in enumerate(self.queries):
                ok = isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, np.ndarray) for x in pair)
                if not ok or pair[0].ndim != 2 or pair[1].shape != (*pair[0].shape, pair[0].shape[1]):
                    raise SpecError(
                        f"ExpectedAttention.queries[{i}] must be (mean [n_heads, head_dim], cov [n_heads, head_dim, "
                        "head_dim]) numpy arrays, as expected_queries returns"
                    )

    def with_queries(self, queries: Any) -> ExpectedAttention:
        """This policy with every layer's query statistics (a sequence of ``expected_queries`` results)."""
        try:
            pairs = tuple((np.asarray(m, np.float64), np.asarray(c, np.float64)) for m, c in queries)
        except (TypeError, ValueError):
            raise SpecError(
                f"ExpectedAttention.with_queries takes one (mean, cov) pair per layer, as expected_queries returns; "
                f"got {type(queries).__name__}"
            ) from None
        return replace(self, queries=pairs)

    def head_scores(self, n: int, keep: int, scores: Scores, layer: int) -> np.ndarray:
        if self.queries is None or scores.kv is None:
            raise SpecError(
                "ExpectedAttention needs each layer's query statistics: KVHalCache.from_model(..., press=) fills them "
                "from the prefill; for KVCache.evict pass policy.with_queries([expected_queries(...) per layer])"
            )
        if len(self.queries) != scores.n_layers:  # more would read layers the cache lacks, fewer would ignore some
            raise SpecError(
                f"ExpectedAttention has query statistics for {len(self.queries)} layers but the cache has "
                f"{scores.n_layers}: pass one expected_queries(...) per layer"
            )
        mean, cov = self.queries[layer]
        k, v = (np.asarray(x, np.float64) for x in scores.kv(layer))
        n_kv_heads, d = k.shape[1], k.shape[2]
        if mean.shape[1] != d or mean.shape[0] % n_kv_heads or not mean.shape[0]:
            raise SpecError(
                f"ExpectedAttention.queries[{layer}] has {mean.shape[0]} heads of {mean.shape[1]}; the cache has "
                f"{n_kv_heads} KV heads of {d}"
            )
        group = mean.shape[0] // n_kv_heads
        sink = min(self.n_sink, n)
        out = np.full((n_kv_heads, n), np.inf)
        if sink == n:  # every position is a sink: no softmax over an empty set
            return out
        kh = np.repeat(k[sink:n].transpose(1, 0, 2), group, axis=0)  # [Hq, m, d]
        logits = np.matmul(kh, mean[:, :, None])[:, :, 0] / math.sqrt(d)
        if self.covariance:
            logits += (np.matmul(kh, cov) * kh).sum(axis=-1) / d / 2
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w = (w / w.sum(axis=1, keepdims=True)).reshape(n_kv_heads, group, -1).mean(axis=1)  # [H, m]
        if self.vnorm:
            w = (w + self.epsilon) * np.linalg.norm(v[sink:n], axis=-1).T
        out[:, sink:] = w
        return out

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        if self.queries is None:
            self.head_scores(n, keep, scores, 0)  # raises, saying what to pass
        assert self.queries is not None
        total = sum(self.head_scores(n, keep, scores, layer).sum(axis=0) for layer in range(len(self.queries)))
        return np.sort(np.argsort(-np.asarray(total), kind="stable")[: min(keep, n)]).astype(np.int64)


def _observed(scores: Scores, layer: int) -> tuple[np.ndarray, np.ndarray]:
    if layer not in scores.heads:
        raise SpecError(
            f"per-head budgets over attention scores need every layer's; layer {layer} was not observed: call "
            "attention(..., observe=True) on the prefill at every layer"
        )
    return scores.heads[layer]


@dataclass(frozen=True)
class AdaKV(Policy):
    """AdaKV's per-head budgets over ``press``'s per-head scores: per layer, the ``n_kv_heads * keep`` (position,
    head) pairs of highest score are kept, compared across heads (every head's scores are mean attention weights:
    on one scale); each head first keeps its ``safeguard * keep`` best and never more than ``ceiling * keep``.
    Heads hold their own positions inside the sequence's shared pages, so the pages held are those of the
    longest head: ``ceiling`` bounds them (1.1 at keep 0.5 holds at most 55% of the pages). kvpress's
    ``AdaKVPress`` (``alpha_safeguard``) has no ceiling: it masks rather than frees."""

    press: Policy
    ceiling: float = 1.1
    safeguard: float = 0.2
    name: str = field(default="adakv", init=False)
    per_head: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.press, (SnapKV, H2O, ExpectedAttention)):
            raise SpecError(
                "AdaKV.press must be a scorer whose scores compare across heads (attention weights: SnapKV, H2O or "
                f"ExpectedAttention), got {self.press!r}"
            )
        _real("AdaKV.ceiling", self.ceiling, 1.0)
        if _real("AdaKV.safeguard", self.safeguard) > 1:
            raise SpecError(f"AdaKV.safeguard must be a real number in [0, 1], got {self.safeguard!r}")

    def select(self, n: int, keep: int, scores: Scores) -> np.ndarray:
        raise SpecError("AdaKV keeps different positions per KV head: KVCache.evict runs it (select_heads)")

    def with_queries(self, queries: Any) -> AdaKV:
        """``AdaKV(ExpectedAttention)`` with its scorer's query statistics (``ExpectedAttention.with_queries``)."""
        if not isinstance(self.press, ExpectedAttention):
            raise SpecError(f"AdaKV({type(self.press).__name__}) takes no query statistics")
        return replace(self, press=self.press.with_queries(queries))

    def select_heads(self, n: int, keep: int, scores: Scores, n_layers: int) -> list[list[np.ndarray]]:
        cap = int(min(n, self.ceiling * keep))  # (a huge finite ceiling times keep is inf: no int of it)
        n_safe = min(keep, int(self.safeguard * keep))
        out = []
        for layer in range(n_layers):
            sc = self.press.head_scores(n, keep, scores, layer)
            n_heads = sc.shape[0]
            if n_safe:  # each head's own best are kept whatever the other heads score
                best = np.argsort(-sc, axis=1, kind="stable")[:, :n_safe]
                np.put_along_axis(sc, best, np.inf, axis=1)
            order = np.argsort(-sc.ravel(), kind="stable")  # ties: the lower head, then the earlier position
            head = order // n
            rank = np.empty_like(order)  # each entry's rank within its own head, in the global order
            for h in range(n_heads):
                at = head == h
                rank[at] = np.arange(int(at.sum()))
            chosen = order[rank < cap][: n_heads * keep]
            out.append([np.sort(chosen[chosen // n == h] % n).astype(np.int64) for h in range(n_heads)])
        return out


def pool1d(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Same-length 1-d pooling with zero padding of ``kernel // 2`` (avg counts the padding)."""
    pad = kernel // 2
    padded = np.pad(x.astype(np.float64), pad, constant_values=0.0 if how == "avg" else -np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel)
    return windows.mean(axis=1) if how == "avg" else windows.max(axis=1)


@dataclass(frozen=True)
class EvictionResult:
    """What ``evict`` (or a full cache) did to one sequence: nothing is dropped without this record."""

    seq: int
    policy: str
    cause: str  # "evict" (called) or "on_full" (a store found no free block)
    kept: np.ndarray  # old positions kept, ascending; they are positions 0..len(kept)-1 now (per-head: by some head)
    dropped: np.ndarray  # old positions dropped (per-head: by every head)
    blocks_freed: int  # blocks returned to the free list
    bytes_freed: int
    # a per-head eviction (AdaKV): per layer, per KV head, the old positions that head keeps, now its positions
    # 0..; the sequence is as long as the longest of them
    heads: tuple[tuple[np.ndarray, ...], ...] | None = None

    @property
    def length(self) -> int:
        """The sequence's length after the eviction (the longest head's for a per-head one)."""
        return len(self.kept) if self.heads is None else max(len(k) for layer in self.heads for k in layer)


@dataclass(frozen=True)
class EvictOnFull:
    """``KVCache(on_full=EvictOnFull(policy, keep_tokens))``: when a store finds no free block, the
    longest sequence is evicted down to ``keep_tokens`` with ``policy`` and the store retried."""

    policy: Policy
    keep_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise SpecError(f"EvictOnFull.policy must be a kvhal.eviction policy, got {type(self.policy).__name__}")
        if self.policy.per_head:
            raise UnsupportedError(
                f"EvictOnFull takes a policy that keeps the same positions in every head, not {self.policy.name}; "
                "use SnapKV, H2O or SinkWindow"
            )
        _count("EvictOnFull.keep_tokens", self.keep_tokens)


OnEvict = Callable[[EvictionResult], None]


def check_press(
    press: Any, keep: Any, observe_window: int, spec: CacheSpec, backend: Backend
) -> tuple[Policy | None, float | None]:
    """A prefill press (a policy run after the prefill) and the fraction ``keep`` of each row it keeps, checked
    against the cache they will run on (its ``observe_window``, whether its backend masks per-head holes): both or
    neither."""
    if press is None and keep is None:
        return None, None
    if press is None or keep is None:
        raise SpecError(
            f"press and keep go together (got press={press!r}, keep={keep!r}): e.g. press=SnapKV(window=64), "
            "keep=0.5 keeps half of each row's prefill"
        )
    if not isinstance(press, Policy):
        raise SpecError(
            "press must be a kvhal.eviction policy (SinkWindow, Knorm, H2O, SnapKV, ExpectedAttention, AdaKV), got "
            f"{press!r}"
        )
    if (
        not isinstance(keep, (int, float, np.integer, np.floating))
        or isinstance(keep, (bool, np.bool_))
        or not (math.isfinite(keep) and 0 < keep <= 1)
    ):
        raise SpecError(f"keep is the fraction of each row's prefill to keep, a real number in (0, 1]; got {keep!r}")
    scorer = press.press if isinstance(press, AdaKV) else press
    if isinstance(scorer, SnapKV) and scorer.window != observe_window:
        raise SpecError(
            f"press={press!r} needs the mass of the last {scorer.window} queries but the cache observes "
            f"{observe_window}: pass observe_window={scorer.window} (from_model's default for a SnapKV press)"
        )
    if press.per_head and not backend.masks_heads_of(spec):
        raise UnsupportedError(no_head_masks(press, backend))
    return press, float(keep)


def no_head_masks(policy: Policy, backend: Backend) -> str:
    return (
        f"{policy.name} keeps different positions per KV head, and backend {backend.name!r} cannot mask a head's "
        "dropped rows in attention (of this spec's formats); use a policy that keeps the same positions in every head (SnapKV, H2O, "
        "SinkWindow), or the reference backend (cpu masks them for every K format but kltq)"
    )


class Evictor:
    """One cache's eviction: observed attention mass per sequence, ``evict``, and making room on a full cache
    (``on_full=EvictOnFull``); every drop is reported as an ``EvictionResult`` to ``on_evict``."""

    def __init__(
        self,
        spec: CacheSpec,
        backend: Backend,
        pools: Pools,
        table: SeqTable,
        tail: TailStore,
        load: Callable[[Seq, int], tuple[np.ndarray, np.ndarray]],
        observe_window: int,
        on_full: str | EvictOnFull,
        on_evict: OnEvict | None,
    ) -> None:
        self.spec, self.backend, self.pools, self.table, self.tail = spec, backend, pools, table, tail
        self.load = load  # a sequence's K, V at a layer as KVCache.load returns them
        self.observe_window, self.on_full, self.on_evict = observe_window, on_full, on_evict
        self.counts = {"evict": 0, "on_full": 0, "n": 0}  # tokens dropped by cause, evictions that dropped any

    def observe(self, seqs: list[Seq], layer: int, q: Any, batch: AttentionBatch) -> Any:
        """Attention over ``seqs`` (returned) that also accumulates the attention mass each key received from this
        call's queries. A backend that fuses ``attention_lse`` gives the row LSEs with the output, and the mass
        is one pass of ``q K^T`` against them: the backend's own if it fuses ``attention_mass`` too, else one
        float32 pass over ``load`` (``attention_mass_lse``); otherwise the float64 host default. A spec with a
        tail: ``observe_tail``."""
        fused = self.backend.fused
        if "attention_lse" in fused:
            out, lse = self.backend.attention_lse(q, self.pools, layer, batch)
            if "attention_mass" in fused:
                mass = self.backend.attention_mass(q, self.pools, layer, batch, self.observe_window, lse)
            else:
                mass = attention_mass_lse(self.backend, q, self.pools, layer, batch, lse, self.observe_window)
        else:
            out = self.backend.attention(q, self.pools, layer, batch)
            mass = self.backend.attention_mass(q, self.pools, layer, batch, self.observe_window)
        self._accumulate(seqs, layer, mass)
        return out

    def observe_tail(
        self,
        seqs: list[Seq],
        layer: int,
        q: Any,
        batch: AttentionBatch,
        lse: np.ndarray,
        pages_q: tuple[Any, np.ndarray] | None = None,
    ) -> None:
        """With an f16 tail, after ``TailStore.attention`` (its ``lse``, and the ``pages_q`` it took): the mass over
        pages and tail together (``TailStore.mass``), accumulated as ``observe`` does."""
        self._accumulate(seqs, layer, self.tail.mass(seqs, layer, q, batch, self.observe_window, lse, pages_q))

    def _accumulate(self, seqs: list[Seq], layer: int, mass: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for s, (total, tail) in zip(seqs, mass):
            old = s.mass.get(layer)
            if old is not None:
                total[:, : old.shape[1]] += old[:, : total.shape[1]]
            s.mass[layer], s.window_mass[layer] = total, tail

    def evict(self, sid: int, s: Seq, policy: Policy, keep_tokens: int) -> EvictionResult:
        n = max(s.lens, default=0)
        if policy.per_head and n > keep_tokens:
            return self._evict_heads(sid, s, policy, keep_tokens)
        kept = np.arange(n) if n <= keep_tokens else policy.select(n, keep_tokens, self.scores(s, n))
        return self._compact(sid, s, kept, policy.name, "evict")

    def _evict_heads(self, sid: int, s: Seq, policy: Policy, keep_tokens: int) -> EvictionResult:
        if not self.backend.masks_heads_of(self.spec):
            raise UnsupportedError(no_head_masks(policy, self.backend))
        n = max(s.lens)
        if min(s.lens) != n:
            raise SequenceError(
                f"{policy.name} compacts every layer at once; this sequence holds {min(s.lens)} to {n} tokens per "
                "layer: store every layer first"
            )
        heads = policy.select_heads(n, keep_tokens, self.scores(s, n), self.spec.n_layers)
        freed = (self.tail.keep_heads if self.spec.uses_tail else self.table.keep_heads)(s, heads)
        kept = np.unique(np.concatenate([k for layer in heads for k in layer]))
        dropped = np.setdiff1d(np.arange(n), kept)
        self.counts["evict"] += n - int(np.mean([len(k) for layer in heads for k in layer]))
        self.counts["n"] += 1
        frozen = tuple(tuple(layer) for layer in heads)
        result = EvictionResult(sid, policy.name, "evict", kept, dropped, freed, freed * self.spec.block_nbytes, frozen)
        if self.on_evict is not None:
            self.on_evict(result)
        return result

    def scores(self, s: Seq, n: int) -> Scores:
        def fit(m: np.ndarray) -> np.ndarray:
            out = np.zeros((m.shape[0], n))
            w = min(n, m.shape[1])
            out[:, :w] = m[:, :w]
            return out

        heads = {layer: (fit(m), fit(s.window_mass[layer])) for layer, m in s.mass.items()}
        total = sum((m.sum(axis=0) for m, _ in heads.values()), np.zeros(n))
        window = sum((w.sum(axis=0) for _, w in heads.values()), np.zeros(n))
        memo: dict[str, np.ndarray] = {}

        def key_norms() -> np.ndarray:  # every layer's keys as stored (dequantized by the backend), read once
            if "norms" not in memo:
                table, norms = np.asarray(s.blocks, np.int64), np.zeros((len(s.lens), self.spec.n_kv_heads, n))
                for layer, length in enumerate(s.lens):  # a layer not stored that far adds nothing past its end
                    if self.spec.uses_tail:
                        k = self.tail.values(s, layer)[0][:n]
                    else:
                        k = self.backend.to_numpy(self.backend.load(self.pools, layer, table, min(n, length))[0])
                    norms[layer, :, : len(k)] = np.linalg.norm(np.asarray(k, np.float64), axis=-1).T
                memo["norms"] = norms
            return memo["norms"]

        def kv(layer: int) -> tuple[np.ndarray, np.ndarray]:
            k, v = self.load(s, layer)
            return k[:n], v[:n]

        return Scores(total, window, self.observe_window, bool(s.mass), heads, key_norms, kv, len(s.lens))

    def _compact(self, sid: int, s: Seq, kept: np.ndarray, policy: str, cause: str) -> EvictionResult:
        n = max(s.lens, default=0)
        kept = np.asarray(kept, np.int64)
        freed = (self.tail.keep_rows if self.spec.uses_tail else self.table.keep_rows)(s, kept)
        dropped = np.setdiff1d(np.arange(n), kept)
        if dropped.size:
            self.counts[cause] += int(dropped.size)
            self.counts["n"] += 1
        result = EvictionResult(sid, policy, cause, kept, dropped, freed, freed * self.spec.block_nbytes)
        if self.on_evict is not None and dropped.size:
            self.on_evict(result)
        return result

    def make_room(self, storing: Seq, layer: int, n: int) -> bool:
        """on_full=EvictOnFull, before a store of ``n`` rows into ``storing`` at ``layer`` that does not fit: evict
        the longest resident sequences, one after another, until it fits. All or nothing: the evictions are
        planned on a copy of the refcounts first (copy-on-write included) and carried out only when the store
        then fits; otherwise nothing is evicted and the store's ``CapacityError`` follows. True if it evicted."""
        if not isinstance(self.on_full, EvictOnFull):
            return False
        bs, policy, keep = self.spec.block_size, self.on_full.policy, self.on_full.keep_tokens
        alloc = self.table.allocator
        tail = self.spec.uses_tail  # pages hold tail.paged_after(length) tokens of a sequence of that length

        def pages(lens: list[int]) -> list[int]:
            return [self.tail.paged_after(n) for n in lens] if tail else lens

        refs: dict[int, int] = {}  # planned refcount changes over the allocator's; copies get ids < 0

        def ref(b: int) -> int:
            return refs.get(b, 1 if b < 0 else int(alloc.ref[b]))

        usable, fresh = alloc.n_usable, 0
        state = {
            sid: (list(x.blocks), list(x.lens), list(x.pages()), x)
            for sid, x in self.table.items()
            if not (x.base or x.holes)
        }
        plan: list[tuple[int, Seq, np.ndarray]] = []
        while True:
            blocks, lens, paged = next(
                ((b, ln, p) for b, ln, p, x in state.values() if x is storing),
                (storing.blocks, storing.lens, storing.pages()),
            )
            p0 = paged[layer] - storing.base
            p1 = max(p0, self.tail.paged_after(lens[layer] + n)) if tail else p0 + n  # the rows the store pages
            if self.table.blocks_needed(blocks, p0, p1, ref) <= usable:
                break
            todo = [(sid, st) for sid, st in state.items() if sid not in {p[0] for p in plan}]
            if not todo:
                return False
            sid, (blocks_v, lens_v, _, victim) = max(todo, key=lambda kv: (max(kv[1][1], default=0), -kv[0]))
            n_v = max(lens_v, default=0)
            if n_v <= keep:
                return False
            kept = np.asarray(policy.select(n_v, keep, self.scores(victim, n_v)), np.int64)
            moved = np.flatnonzero(kept != np.arange(len(kept)))
            first = int(moved[0]) if moved.size else len(kept)
            new_lens = [int(np.searchsorted(kept, L)) for L in lens_v]
            n_keep = -(-max(pages(new_lens), default=0) // bs)
            for i in range(first // bs, n_keep) if moved.size else ():  # copy-on-write of shared pages
                if ref(blocks_v[i]) > 1:
                    if usable == 0:
                        return False  # the compaction itself would not fit
                    usable, fresh = usable - 1, fresh + 1
                    refs[blocks_v[i]] = ref(blocks_v[i]) - 1
                    blocks_v[i] = -fresh
            for b in blocks_v[n_keep:]:
                refs[b] = ref(b) - 1
                usable += refs[b] == 0
            state[sid] = (blocks_v[:n_keep], new_lens, pages(new_lens), victim)
            plan.append((sid, victim, kept))
        for sid, victim, kept in plan:
            self._compact(sid, victim, kept, policy.name, "on_full")
        return bool(plan)
