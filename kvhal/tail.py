"""The f16 precision tail: a sequence's last ``spec.tail`` tokens (and a per-channel K format's open page)
kept in f16 host memory, in stored form; whole blocks leave it for the quantized pages as they fill.

Attention runs the backend's kernel over the quantized pages and float64 over the tail, merged by
log-sum-exp: exact, since the two key sets are disjoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import formats
from .backend import AttentionBatch, Backend, Pools
from .backend_util import merge_lse, softmax
from .errors import UnsupportedError
from .formats.ggml import round_f16
from .seqs import Seq, SeqTable
from .spec import CacheSpec


class TailStore:
    def __init__(self, spec: CacheSpec, backend: Backend, pools: Pools, table: SeqTable) -> None:
        self.spec, self.backend, self.pools, self.table = spec, backend, pools, table

    def store(self, s: Seq, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append stored-form rows to the tail; whole blocks that leave it (all but the last ``tail`` tokens, a
        block at a time) are quantized into the pages from their f16 values."""
        spec, bs = self.spec, self.spec.block_size
        f16 = formats.get("f16")
        for fmt, x in ((spec.k_fmt, k), (spec.v_fmt, v)):  # finite already (store): one pass for the range
            amax = float(np.abs(x).max()) if x.size else 0.0
            for f in (f16, fmt):
                if amax > f.max_abs and not f.saturates:
                    f.check_values(x)  # raises, with its message
        assert s.paged is not None
        # in f32 holding f16 values (round_f16: numpy's float16 cast is a scalar loop); f16 again in the tail
        ck, cv = round_f16(k), round_f16(v)
        if layer in s.tail_k and len(s.tail_k[layer]):
            ck = np.concatenate([s.tail_k[layer].astype(np.float32), ck])
            cv = np.concatenate([s.tail_v[layer].astype(np.float32), cv])
        total = s.lens[layer] + len(k)
        sink = spec.sink_tokens
        if s.lens[layer] < sink:  # the sequence's first sink_tokens rows, kept in f16 for good
            new = ck[len(ck) - len(k) :][: sink - s.lens[layer]]
            old = s.sink_k.get(layer)
            s.sink_k[layer] = (
                np.concatenate([old, new.astype(np.float16)]) if old is not None else new.astype(np.float16)
            )
            newv = cv[len(cv) - len(v) :][: sink - s.lens[layer]].astype(np.float16)
            oldv = s.sink_v.get(layer)
            s.sink_v[layer] = np.concatenate([oldv, newv]) if oldv is not None else newv
        p0 = s.paged[layer]
        flush = max(0, total - spec.tail - p0) // bs * bs
        if flush:
            kq, vq = self.backend.asarray(ck[:flush], "k"), self.backend.asarray(cv[:flush], "v")
            self.table.write(s, layer, kq, vq, p0)
        s.tail_k[layer], s.tail_v[layer] = ck[flush:].astype(np.float16), cv[flush:].astype(np.float16)
        s.paged[layer] = p0 + flush
        s.lens[layer] = total

    def remove(self, s: Seq, lo: int, hi: int) -> None:
        """seq_rm with a tail: a suffix that lies in the tail only (its rows are dropped there)."""
        paged = max(s.pages(), default=0)
        n = max(s.lens, default=0)
        if lo >= n:
            return
        if hi < n or lo < paged:
            raise UnsupportedError(
                f"seq_rm [{lo}, {hi}) with an f16 tail: only a suffix within the tail (positions >= {paged}, to the "
                f"end {n}) can be removed yet, since quantized blocks do not go back to f16; free the sequence and "
                "store it again instead"
            )
        for layer, L in enumerate(s.lens):
            if L > lo:
                keep = lo - s.pages()[layer]
                s.tail_k[layer], s.tail_v[layer] = s.tail_k[layer][:keep], s.tail_v[layer][:keep]
                if layer in s.sink_k:
                    s.sink_k[layer], s.sink_v[layer] = s.sink_k[layer][:lo], s.sink_v[layer][:lo]
                s.lens[layer] = lo
        del s.tokens[lo:]
        s.keep_mass(np.arange(lo))

    def fork(self, s: Seq, lo: int, hi: int) -> Seq:
        """seq_cp with a tail: a whole sequence (its quantized blocks shared, its tail copied)."""
        n = max(s.lens, default=0)
        if lo != 0 or hi < n:
            raise UnsupportedError(
                f"seq_cp [{lo}, {hi}) with an f16 tail: only a copy of the whole sequence (p0=0, p1=-1) is supported "
                "yet; a part would need quantized blocks back in f16"
            )
        return self.table.share_all(s)

    def sink_rows(self, s: Seq, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored-form f32 rows of the f16 sink positions ``[0, min(sink_tokens, stored))``."""
        empty = np.zeros((0, self.spec.n_kv_heads, self.spec.head_dim), np.float16)
        return s.sink_k.get(layer, empty).astype(np.float32), s.sink_v.get(layer, empty).astype(np.float32)

    def rows(self, s: Seq, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored-form f32 rows of tail positions ``[lo, hi)`` (counted from the tail's start)."""
        return s.tail_k[layer][lo:hi].astype(np.float32), s.tail_v[layer][lo:hi].astype(np.float32)

    def attention(
        self,
        layer: int,
        q: Any,
        seqs: list[Seq],
        q_lens: list[int],
        scale: float,
        causal: bool,
        window: int | None,
        pages_q: tuple[Any, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Attention over the quantized pages (the backend's kernel) merged with float64 attention over the tail.

        ``pages_q``: for a K format scored in its own coefficient space (kltq), the queries the pages take and
        the score term they leave out per query row and head (``q . mu``), added back to their log-sum-exp."""
        bs, pools = self.spec.block_size, self.pools
        sink = self.spec.sink_tokens
        if sink and window is not None:
            raise UnsupportedError(
                "attention with a window over a cache with f16 sinks (CacheSpec.sinks) is not supported; pass "
                "window=None or sinks=0"
            )
        qh = np.asarray(self.backend.to_numpy(q), np.float32)
        qp, offset = (qh, None) if pages_q is None else (np.asarray(self.backend.to_numpy(pages_q[0]), np.float32),
                                                          pages_q[1] * scale)  # fmt: skip
        group = qh.shape[1] // self.spec.n_kv_heads
        out = np.empty(qh.shape, np.float32)
        start = 0
        for s, n_q in zip(seqs, q_lens):
            rows, prow = qh[start : start + n_q], qp[start : start + n_q]
            L, P = s.lens[layer], s.pages()[layer]
            pos = np.arange(L - n_q, L)
            S = min(sink, P)  # page positions [0, S) are attended in f16 from the sink rows instead
            a = max(0, P - max(L - n_q, S))  # queries that sit in the kernel's paged region [S, P)
            parts = []
            if S:
                ks, vs = self.sink_rows(s, layer)
                kt = np.repeat(ks[:S].astype(np.float64), group, axis=1)
                vt = np.repeat(vs[:S].astype(np.float64), group, axis=1)
                scores = np.einsum("qhd,khd->hqk", rows.astype(np.float64), kt) * scale
                if causal:
                    scores = np.where((np.arange(S)[None, :] <= pos[:, None])[None], scores, -np.inf)
                p, lse_s = softmax(scores)
                parts.append((np.einsum("hqk,khd->qhd", p, vt).astype(np.float32), lse_s.T))
            if P > S:
                o = np.zeros(rows.shape, np.float32)
                lse = np.full(rows.shape[:2], -np.inf)
                pages = AttentionBatch(
                    s.table()[None, S // bs : P // bs], np.array([P - S], np.int32), np.array([0], np.int32), scale
                )

                def run(
                    r: np.ndarray, causal_: bool, win: int | None, pages: AttentionBatch = pages
                ) -> tuple[np.ndarray, np.ndarray]:
                    batch = pages.with_(q_lens=np.array([len(r)], np.int32), causal=causal_, window=win)
                    return self.backend.attention_lse(r, pools, layer, batch)

                b = max(0, P - (L - n_q)) - a  # paged-region queries before S (sink queries): no page key
                if not causal:  # every query sees every page key
                    b, a = 0, 0
                if a:  # the last `a` positions of the pages: the kernel's own masking
                    o[b : b + a], lse[b : b + a] = run(prow[b : b + a], causal, window)
                if b + a < n_q and window is None:  # every page key precedes these queries
                    o[b + a :], lse[b + a :] = run(prow[b + a :], False, None)
                elif b + a < n_q:  # window: as the last query of the pages with a window shortened to match
                    assert window is not None
                    for i in range(b + a, n_q):
                        w = P - int(pos[i]) + window - 1
                        if w >= 1:
                            o[i : i + 1], lse[i : i + 1] = run(prow[i : i + 1], False, w)
                if offset is not None:
                    lse = lse + offset[start : start + n_q]
                parts.append((o, lse))
            if L > P:
                kt = np.repeat(s.tail_k[layer].astype(np.float64), group, axis=1)  # [T, Hq, D]
                vt = np.repeat(s.tail_v[layer].astype(np.float64), group, axis=1)
                scores = np.einsum("qhd,khd->hqk", rows.astype(np.float64), kt) * scale
                j = np.arange(P, L)[None, :]
                lo = pos[:, None] - window + 1 if window is not None else np.full((n_q, 1), P)
                hi = pos[:, None] + 1 if causal else np.full((n_q, 1), L)
                scores = np.where(((j >= lo) & (j < hi))[None], scores, -np.inf)
                p, lse_t = softmax(scores)
                parts.append((np.einsum("hqk,khd->qhd", p, vt).astype(np.float32), lse_t.T))
            out[start : start + n_q] = merge_lse(parts)
            start += n_q
        return out
