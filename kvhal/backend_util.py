"""What several backends need, written once: format ids and sizes from the registry, the visible
KV range of each query, backend options (with their environment variables) and the raw block layout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import formats
from .attention import AttentionBatch
from .errors import FormatError, PositionError, ShapeError, SpecError
from .spec import CacheSpec

# -- formats ----------------------------------------------------------------------------------------


def format_id(name: str) -> int:
    """A format's index in the registry: the id kernels switch on (stable: formats only join at the end)."""
    return formats.names().index(formats.get(name).name)


def format_table() -> list[tuple[str, int, int, int]]:
    """``(name, id, block_len, block_bytes)`` of every format, in id order: the one table kernels are
    generated from (a C header, a WGSL constant, a define list)."""
    plain = set(formats.plain_names())  # side-data formats (kltq) run no block kernel: not in the table
    return [
        (f.name, i, f.block_len, f.block_bytes)
        for i, f in enumerate(map(formats.get, formats.names()))
        if f.name in plain
    ]


def whole_pages(slots: np.ndarray, block_size: int) -> np.ndarray:
    """The pages that ``slots`` fill completely, each in token order: what a store of a per-channel K
    format (KIVI) takes. Anything else is a FormatError: such pages are quantized once, whole."""
    slots = np.asarray(slots, np.int64)
    if slots.size % block_size or np.any(slots.reshape(-1, block_size) % block_size != np.arange(block_size)):
        raise FormatError(
            f"a per-channel K format quantizes whole pages: stores must fill pages of {block_size} tokens "
            "in order (the cache keeps a page's tokens in its f16 tail until the page is full)"
        )
    pages = slots.reshape(-1, block_size)
    if np.any(pages // block_size != pages[:, :1] // block_size):
        raise FormatError(f"slots {pages.tolist()} do not form whole pages of {block_size} tokens")
    return pages[:, 0] // block_size


# -- attention geometry -----------------------------------------------------------------------------


# -- options ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One backend option: ``kind`` is int or str; ``env`` the variable that sets it when not given;
    ``check`` returns why a value is invalid (None when fine)."""

    name: str
    kind: type
    default: Any = None
    env: str | None = None
    check: Callable[[Any], str | None] | None = None
    help: str = ""


def positive(x: int) -> str | None:
    return None if x > 0 else "must be > 0"


def non_negative(x: int) -> str | None:
    return None if x >= 0 else "must be >= 0"


def one_of(*choices: Any) -> Callable[[Any], str | None]:
    return lambda x: None if x in choices else f"must be one of {', '.join(map(str, choices))}"


def _typed(backend: str, opt: Option, value: Any, source: str) -> Any:
    if opt.kind is int and isinstance(value, str) and source != "argument":
        try:
            value = int(value.strip())
        except ValueError:
            raise SpecError(f"backend {backend!r} option {opt.name}: {value!r} is not an integer ({source})") from None
    ok = isinstance(value, opt.kind) and not (opt.kind is int and isinstance(value, bool))
    if opt.kind is int and isinstance(value, np.integer):
        value, ok = int(value), True
    if not ok:
        raise SpecError(
            f"backend {backend!r} option {opt.name} must be {opt.kind.__name__}, got {type(value).__name__} "
            f"{value!r} ({source})"
        )
    if opt.check is not None and (why := opt.check(value)) is not None:
        raise SpecError(f"backend {backend!r} option {opt.name}={value!r} {why} ({source})")
    return value


def parse_options(backend: str, given: dict[str, Any], options: Sequence[Option]) -> dict[str, Any]:
    """Every option's value: the argument if given, else its environment variable if set, else its default.
    Unknown names, wrong types and invalid values are ``SpecError`` naming the option and where it came from."""
    known = {o.name: o for o in options}
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise SpecError(f"backend {backend!r} has no option {', '.join(unknown)}; the options it takes: {takes}")
    out: dict[str, Any] = {}
    for opt in options:
        if given.get(opt.name) is not None:
            out[opt.name] = _typed(backend, opt, given[opt.name], "argument")
        elif opt.env and (raw := os.environ.get(opt.env, "").strip()):
            out[opt.name] = _typed(backend, opt, raw, f"from {opt.env}; unset it or fix its value")
        else:
            out[opt.name] = opt.default
    return out


# -- raw block layout -------------------------------------------------------------------------------


def pages_to_blocks(spec: CacheSpec, pages: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per-layer ``(k_pages, v_pages)`` host arrays ``[n, n_kv_heads, block_size, row_bytes]`` -> the
    raw block layout ``[n, block_nbytes]`` (for each layer, K page then V page)."""
    parts = []
    for k, v in pages:
        n = k.shape[0]
        parts += [np.asarray(x, np.uint8).reshape(n, math.prod(x.shape[1:])) for x in (k, v)]
    out = np.concatenate(parts, axis=1) if parts else np.zeros((0, spec.block_nbytes), np.uint8)
    assert out.shape[1] == spec.block_nbytes
    return out


def blocks_to_pages(spec: CacheSpec, data: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """The inverse of ``pages_to_blocks``: views of ``data [n, block_nbytes]`` per layer."""
    data = check_block_data(spec, data)
    n = data.shape[0]
    k_shape = (n, spec.n_kv_heads, spec.block_size, spec.k_row_bytes)
    v_shape = (n, spec.n_kv_heads, spec.block_size, spec.v_row_bytes)
    kb, vb = spec.page_nbytes("k"), spec.page_nbytes("v")
    out = []
    for layer in range(spec.n_layers):
        at = layer * (kb + vb)
        out.append((data[:, at : at + kb].reshape(k_shape), data[:, at + kb : at + kb + vb].reshape(v_shape)))
    return out


def check_block_ids(n_blocks: int, block_ids: Any, n_data: int | None = None) -> np.ndarray:
    """``block_ids`` as int64, each in ``[0, n_blocks)``, one per block of data when ``n_data`` is given."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= n_blocks)):
        raise PositionError(f"block ids must be a 1-d array of ints in [0, {n_blocks}), got {block_ids!r}")
    if n_data is not None and ids.size != n_data:
        raise ShapeError(f"{ids.size} block ids for {n_data} blocks of data; pass one id per block")
    return ids.astype(np.int64, copy=False)


def check_block_data(spec: CacheSpec, data: Any) -> np.ndarray:
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise ShapeError(f"block data must be a uint8 numpy array, got {type(data).__name__}")
    if data.ndim != 2 or data.shape[1] != spec.block_nbytes:
        raise ShapeError(f"block data has shape {data.shape}; expected [n_blocks, {spec.block_nbytes}] for this spec")
    return data


# -- attention in float64 over the stored keys (observe=True, streaming) ---------------------------------


def _scores_f64(
    backend: Any, q: Any, pools: Any, layer: int, batch: AttentionBatch
) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """Per sequence: its query rows, masked scores ``[Hq, n_q, n_kv]`` (-inf where not visible) and its V
    ``[n_kv, Hq, D]``, in float64 from the backend's own ``load`` (so from the bytes as stored)."""
    spec = pools.spec
    qh = np.asarray(backend.to_numpy(q), np.float64)
    group = qh.shape[1] // spec.n_kv_heads
    _, _, lo, hi = batch.visible
    start = 0
    for s, (n_kv, n_q) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens.tolist())):
        rows = slice(start, start + n_q)
        start += n_q
        k, v = backend.load(pools, layer, batch.block_table[s, : -(-n_kv // spec.block_size)], n_kv)
        k = scored_keys(pools, layer, np.asarray(backend.to_numpy(k), np.float64))
        k = np.repeat(k, group, axis=1)  # [n_kv, Hq, D]
        v = np.repeat(scored_keys(pools, layer, np.asarray(backend.to_numpy(v), np.float64), "v"), group, axis=1)
        scores = np.einsum("qhd,khd->hqk", qh[rows], k) * batch.scale
        j = np.arange(n_kv)[None, :]
        seen = ((j >= lo[rows, None]) & (j < hi[rows, None]))[None]  # [1, n_q, n_kv]
        if (hidden := batch.hidden(s, n_kv)) is not None:  # per-head holes: [Hq, 1, n_kv]
            seen = seen & ~np.repeat(hidden, group, axis=0)[:, None, :]
        yield rows, np.where(seen, scores, -np.inf), v


def scored_keys(pools: Any, layer: int, k: np.ndarray, which: str = "k") -> np.ndarray:
    """Loaded keys (``which="v"``: values) as attention weighs them: for a kltq format (K: queries come in its
    coefficient space; V: the cache maps the output back to values) the coefficients ``T (x' - mu)`` of the
    loaded ``x' = mu + S c'`` (``T S = I``: the decoded ``c'``); else ``k``."""
    if not getattr(pools.spec, f"{which}_fmt").side_data:
        return k
    from .formats import kltq

    return kltq.coefficients((pools.side if which == "k" else pools.v_side)[layer], 0, k)


def softmax(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax and log-sum-exp of masked scores; a row that sees nothing: zeros and -inf; a NaN score: NaN."""
    m = scores.max(axis=-1, keepdims=True) if scores.shape[-1] else np.full(scores.shape[:-1] + (1,), -np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denom == 0, 0.0, p / denom), (np.log(denom) + m)[..., 0]


def attention_mass(
    backend: Any, q: Any, pools: Any, layer: int, batch: AttentionBatch, tail: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence, the softmax weight each key received, summed over query heads of its KV head:
    ``(all queries, the last ``tail`` queries)``, each float64 ``[n_kv_heads, seq_len]``."""
    n_kv_heads = pools.spec.n_kv_heads
    return [
        head_mass(softmax(scores)[0], n_kv_heads, tail) for _, scores, _ in _scores_f64(backend, q, pools, layer, batch)
    ]


def head_mass(p: np.ndarray, n_kv_heads: int, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax weights ``p [Hq, n_q, n_kv]`` summed over each KV head's query heads and over the queries: all of
    them, and the last ``tail`` apart; float64 ``[n_kv_heads, n_kv]`` each."""
    per_kv = p.reshape(n_kv_heads, -1, *p.shape[1:]).sum(axis=1)  # [H, n_q, n_kv]
    return per_kv.sum(axis=1), per_kv[:, max(0, p.shape[1] - tail) :].sum(axis=1)


def attention_lse(backend: Any, q: Any, pools: Any, layer: int, batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
    """Attention and the log-sum-exp of each row's scores (natural log, scale applied): f32 ``[n_q, H, D]``
    and f64 ``[n_q, H]`` (-inf where a row sees no key). Partial results over disjoint key sets merge
    exactly with ``merge_lse``."""
    shape = backend.to_numpy(q).shape
    out = np.zeros(shape, np.float32)
    lse = np.full(shape[:2], -np.inf)
    for rows, scores, v in _scores_f64(backend, q, pools, layer, batch):
        p, lse_rows = softmax(scores)
        out[rows] = np.einsum("hqk,khd->qhd", p, v)
        lse[rows] = lse_rows.T
    return out, lse


def logsumexp(lses: np.ndarray) -> np.ndarray:
    """``log(sum(exp(lses)))`` over axis 0, the lse of the union of disjoint key sets: -inf where every part
    is -inf (no part saw a key); a NaN part stays NaN."""
    top = lses.max(axis=0)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        total = np.log(np.exp(lses - safe).sum(axis=0)) + safe
    return np.where(np.isneginf(top), -np.inf, total)


def merge_lse(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Attention over the union of disjoint key sets from each set's ``(out, lse)``: the log-sum-exp rule, and
    the union's log-sum-exp (float64). 0 where no part saw a key; a NaN part (a NaN in q or K) makes the row NaN,
    as one kernel call would."""
    lses = np.stack([lse for _, lse in parts])  # [P, n_q, H]
    total = logsumexp(lses)
    w = np.exp(lses - np.where(np.isfinite(total), total, 0.0))  # 0 for parts a row did not see
    out = sum(np.asarray(o, np.float64) * wi[..., None] for (o, _), wi in zip(parts, w))
    return np.where(np.isneginf(total)[..., None], 0.0, out).astype(np.float32), total


def attention_mass_lse(
    backend: Any, q: Any, pools: Any, layer: int, batch: AttentionBatch, lse: Any, tail: int, tile: int = 128
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``attention_mass`` from the log-sum-exp a fused kernel already returned: the weight key ``j`` got from
    query row ``i`` of head ``h`` is ``exp(q_i.k_j * scale - lse_ih)``, so one float32 pass of ``q K^T`` over
    the backend's own ``load``, in tiles of ``tile`` query rows that touch only the keys they see (no
    softmax, no max pass, no V), gives it. Column sums are float32 per tile, added up in float64.
    Same return as ``attention_mass``."""
    spec = pools.spec
    qf = np.asarray(backend.to_numpy(q), np.float32)
    lsef = np.asarray(backend.to_numpy(lse), np.float32)  # [n_q, Hq]
    n_kv_heads = spec.n_kv_heads
    group = qf.shape[1] // n_kv_heads
    _, _, lo_all, hi_all = batch.visible
    out = []
    start = 0
    for s, (n_kv, n_q) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens.tolist())):
        rows = slice(start, start + n_q)
        start += n_q
        k, _ = backend.load(pools, layer, batch.block_table[s, : -(-n_kv // spec.block_size)], n_kv)
        k = scored_keys(pools, layer, np.asarray(backend.to_numpy(k), np.float64))
        d = qf.shape[-1]
        # [q * scale, -lse] . [k, 1] = q.k * scale - lse: one matmul per tile and head gives the exponent
        kf = np.ones((n_kv_heads, d + 1, n_kv), np.float32)
        kf[:, :d] = np.asarray(backend.to_numpy(k), np.float32).transpose(1, 2, 0)
        qa = np.empty((n_kv_heads, n_q * group, d + 1), np.float32)
        qa[:, :, :d] = (
            (qf[rows] * np.float32(batch.scale))
            .reshape(n_q, n_kv_heads, group, d)
            .transpose(1, 0, 2, 3)
            .reshape(n_kv_heads, n_q * group, d)
        )
        qa[:, :, d] = -lsef[rows].reshape(n_q, n_kv_heads, group).transpose(1, 0, 2).reshape(n_kv_heads, -1)
        lo, hi = lo_all[rows], hi_all[rows]
        lo_g, hi_g = np.repeat(lo, group)[:, None], np.repeat(hi, group)[:, None]  # per row of a tile's ``e``
        total = np.zeros((n_kv_heads, n_kv))
        window = np.zeros((n_kv_heads, n_kv))
        split = max(0, n_q - tail)  # the last ``tail`` queries are summed apart as well
        bounds = sorted({*range(0, n_q, tile), split, n_q})
        for a, b in zip(bounds[:-1], bounds[1:]):
            k0, k1 = int(lo[a:b].min()), int(hi[a:b].max())
            if k1 <= k0:
                continue
            full0, full1 = int(lo[a:b].max()), int(hi[a:b].min())  # every row of the tile sees [full0, full1)
            edges = [(e0, e1) for e0, e1 in ((k0, min(full0, k1)), (max(full1, full0, k0), k1)) if e1 > e0]
            masks = [
                (e0 - k0, e1 - k0, (j < lo_g[a * group : b * group]) | (j >= hi_g[a * group : b * group]))
                for e0, e1 in edges
                for j in [np.arange(e0, e1)]
            ]  # the ragged edges only (the causal diagonal, the window's start): at most a tile wide each
            for h in range(n_kv_heads):
                e = qa[h, a * group : b * group] @ kf[h, :, k0:k1]  # [(b-a)*g, k1-k0]
                for c0, c1, hidden in masks:
                    np.putmask(e[:, c0:c1], hidden, -np.inf)
                np.exp(e, out=e)
                col = e.sum(axis=0)
                if batch.holes is not None:  # the keys this head does not attend received nothing
                    col[max(0, batch.holes[s, h, 0] - k0) : max(0, batch.holes[s, h, 1] - k0)] = 0.0
                total[h, k0:k1] += col
                if a >= split:
                    window[h, k0:k1] += col
        out.append((total, window))
    return out
