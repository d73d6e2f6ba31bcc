"""The f16 precision tail: a sequence's last ``spec.tail`` tokens (and a per-channel K format's open page)
kept in f16 host memory, in stored form; whole blocks leave it for the quantized pages as they fill.

Attention runs the backend's kernel over the quantized pages and float64 over the tail, merged by
log-sum-exp: exact, since the two key sets are disjoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import formats
from .backend import AttentionBatch, Backend, Pools
from .backend_util import head_mass, merge_lse, softmax
from .errors import UnsupportedError
from .formats.ggml import round_f16
from .seqs import Seq, SeqTable
from .spec import CacheSpec


class TailStore:
    def __init__(self, spec: CacheSpec, backend: Backend, pools: Pools, table: SeqTable) -> None:
        self.spec, self.backend, self.pools, self.table = spec, backend, pools, table

    def store(
        self, s: Seq, layer: int, k: np.ndarray, v: np.ndarray, make_room: Callable[[Seq, int, int], bool] | None = None
    ) -> None:
        """Append stored-form rows to the tail; whole blocks that leave it (all but the last ``tail`` tokens, a
        block at a time) are quantized into the pages from their f16 values. ``make_room(s, layer, n)``: called
        first when those blocks do not fit (it may compact ``s`` itself: its state is read after it)."""
        spec = self.spec
        f16 = formats.get("f16")
        for fmt, x in ((spec.k_fmt, k), (spec.v_fmt, v)):  # finite already (store): one pass for the range
            amax = float(np.abs(x).max()) if x.size else 0.0
            for f in (f16, fmt):
                if amax > f.max_abs and not f.saturates:
                    f.check_values(x)  # raises, with its message
        assert s.paged is not None
        p0 = s.paged[layer]
        p1 = max(p0, self.paged_after(s.lens[layer] + len(k)))
        if make_room is not None and self.table.blocks_needed(s.blocks, p0, p1) > self.table.allocator.n_usable:
            make_room(s, layer, len(k))
        # in f32 holding f16 values (round_f16: numpy's float16 cast is a scalar loop); f16 again in the tail
        ck, cv = round_f16(k), round_f16(v)
        if layer in s.tail_k and len(s.tail_k[layer]):
            ck = np.concatenate([s.tail_k[layer].astype(np.float32), ck])
            cv = np.concatenate([s.tail_v[layer].astype(np.float32), cv])
        total = s.lens[layer] + len(k)
        p0 = s.paged[layer]
        flush = max(0, self.paged_after(total) - p0)
        if flush:  # first: the write is the step that can fail (no room), and then nothing has changed
            kq, vq = self.backend.asarray(ck[:flush], "k"), self.backend.asarray(cv[:flush], "v")
            self.table.write(s, layer, kq, vq, p0)
        sink = spec.sink_tokens
        if s.lens[layer] < sink:  # the sequence's first sink_tokens rows, kept in f16 for good
            for rows, x, n in ((s.sink_k, ck, len(k)), (s.sink_v, cv, len(v))):
                new = x[len(x) - n :][: sink - s.lens[layer]].astype(np.float16)
                rows[layer] = np.concatenate([rows[layer], new]) if layer in rows else new
        s.tail_k[layer], s.tail_v[layer] = ck[flush:].astype(np.float16), cv[flush:].astype(np.float16)
        s.paged[layer] = p0 + flush
        s.lens[layer] = total

    def remove(self, s: Seq, lo: int, hi: int) -> None:
        """seq_rm with a tail: a suffix that lies in the tail only (its rows are dropped there)."""
        paged = max(s.pages(), default=0)
        n = max(s.lens, default=0)
        if lo >= n:  # past every stored row: only token ids recorded ahead of their rows go, as without a tail
            del s.tokens[lo:hi]
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
        t = self.table.share_all(s)
        del t.tokens[hi:]  # ids recorded ahead of the rows past [lo, hi) are not the copy's (as SeqTable.fork)
        return t

    def values(self, s: Seq, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored-form f32 K, V of every position of ``s`` at ``layer`` as attention reads them: the pages dequantized
        by the backend, the f16 sink rows over their pages, then the tail's rows."""
        P, shape = s.pages()[layer], (s.lens[layer], self.spec.n_kv_heads, self.spec.head_dim)
        k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
        if P:
            blocks = np.asarray(s.blocks[: -(-P // self.spec.block_size)], np.int64)
            pk, pv = self.backend.load(self.pools, layer, blocks, P)
            k[:P], v[:P] = self.backend.to_numpy(pk), self.backend.to_numpy(pv)
            S = min(self.spec.sink_tokens, P)
            if S:
                sk, sv = self.sink_rows(s, layer)
                k[:S], v[:S] = sk[:S], sv[:S]
        k[P:], v[P:] = self.rows(s, layer, 0, shape[0] - P)
        return k, v

    def mass(
        self,
        seqs: list[Seq],
        layer: int,
        q: Any,
        batch: AttentionBatch,
        tail: int,
        lse: np.ndarray,
        pages_q: tuple[Any, np.ndarray] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``Backend.attention_mass`` over sinks, pages and tail together, after ``attention`` gave ``lse`` (each
        row's log-sum-exp over all its keys; ``pages_q`` as ``attention`` took it): key ``j`` gets
        ``exp(s_j - lse)``, which needs no other key. Where the backend fuses ``attention_mass`` (and no per-head holes),
        the pages' part is that pass given ``lse`` (the same sub-batches and windows ``attention`` ran the kernel
        on), and only the f16 sink and tail rows are scored here (``_rows_mass``); otherwise ``mass_f64``. The last
        ``tail`` queries are summed apart too."""
        if "attention_mass" not in self.backend.fused or batch.holes is not None:
            return self.mass_f64(seqs, layer, q, batch, tail)
        spec = self.spec
        qh = np.asarray(self.backend.to_numpy(q), np.float32)
        qp = qh if pages_q is None else np.asarray(self.backend.to_numpy(pages_q[0]), np.float32)
        lse_p = lse if pages_q is None else lse - pages_q[1] * batch.scale  # kltq pages leave out q . mu
        out, start = [], 0
        for s, n_q in zip(seqs, batch.q_lens.tolist()):
            L, P = s.lens[layer], s.pages()[layer]
            S, b, a, pages = self.pages(s, layer, n_q, batch.causal, batch.scale)
            pos, split = np.arange(L - n_q, L)[:, None], max(0, n_q - tail)
            rows = slice(start, start + n_q)
            total, window = np.zeros((spec.n_kv_heads, L)), np.zeros((spec.n_kv_heads, L))

            def seen(j0: int, j1: int, at: np.ndarray) -> np.ndarray | None:
                """Which keys ``[j0, j1)`` the queries at positions ``at`` see (None: all)."""
                j = np.arange(j0, j1)[None, :]
                m = (j <= at) if batch.causal else None
                if batch.window is not None:
                    m = (j > at - batch.window) if m is None else m & (j > at - batch.window)
                return m

            if S:
                self._rows_mass(qh[rows], lse[rows], self.sink_rows(s, layer)[0][:S], seen(0, S, pos), batch.scale,
                                split, total[:, :S], window[:, :S])  # fmt: skip
            if P > S:
                # the queries among the pages (the kernel's causal mask and window), then those after them: all
                # at once without a window, else one at a time with the window shortened to their position
                parts = [(b, b + a, True, batch.window)]
                if batch.window is None:
                    parts.append((b + a, n_q, False, None))
                else:
                    parts += [(i, i + 1, False, wi) for i in range(b + a, n_q)
                              if (wi := P - int(pos[i, 0]) + batch.window - 1) >= 1]  # fmt: skip
                for c0, c1, causal, win in parts:
                    if c1 > c0:
                        sub = pages.with_(q_lens=np.array([c1 - c0], np.int32), causal=causal, window=win)
                        r = slice(start + c0, start + c1)
                        [(t, w)] = self.backend.attention_mass(
                            qp[r], self.pools, layer, sub, max(0, c1 - max(c0, split)), lse_p[r]
                        )
                        total[:, S:P] += t
                        window[:, S:P] += w
            if L > P:  # causal: only the queries from position P on see a tail key
                r0 = max(0, P - (L - n_q)) if batch.causal else 0
                r = slice(start + r0, start + n_q)
                self._rows_mass(qh[r], lse[r], self.rows(s, layer, 0, L - P)[0], seen(P, L, pos[r0:]), batch.scale,
                                max(0, split - r0), total[:, P:], window[:, P:])  # fmt: skip
            out.append((total, window))
            start += n_q
        return out

    def pages(self, s: Seq, layer: int, n_q: int, causal: bool, scale: float) -> tuple[int, int, int, AttentionBatch]:
        """Where the last ``n_q`` positions of ``s`` meet the keys the kernel attends at ``layer``, page positions
        ``[S, P)`` (``[0, S)``: the f16 sink rows instead): ``(S, b, a, batch)``, queries ``[0, b)`` precede those
        keys (sink positions), ``[b, b + a)`` sit among them (the kernel's own causal mask), the rest follow them
        (all 0 when not ``causal``: every query sees every key); ``batch`` over them, its ``q_lens`` to set, with
        the part of each KV head's hole (``Seq.holes``) among them."""
        L, P, bs = s.lens[layer], s.pages()[layer], self.spec.block_size
        S = min(self.spec.sink_tokens, P)
        a = max(0, P - max(L - n_q, S)) if causal else 0
        b = max(0, P - (L - n_q)) - a if causal else 0
        table = s.table()[None, S // bs : P // bs]
        holes = None if layer not in s.holes else np.clip(s.holes[layer] - S, 0, P - S).astype(np.int32)[None]
        return S, b, a, AttentionBatch(table, np.array([P - S], np.int32), np.array([0], np.int32), scale, holes=holes)

    @staticmethod
    def _rows_mass(
        q: np.ndarray,
        lse: np.ndarray,
        k: np.ndarray,
        seen: np.ndarray | None,
        scale: float,
        split: int,
        total: np.ndarray,
        window: np.ndarray,
    ) -> None:
        """Add to ``total``/``window`` ``[H, T]`` the mass ``exp(q.k * scale - lse)`` keys ``k [T, H, D]`` got from
        query rows ``q [n_q, Hq, D]`` (``seen [n_q, T]``: which keys each row sees; None: all), summed over each KV
        head's query heads; ``window``: from rows ``split..`` only. ``q.k`` one float32 GEMM per KV head (as the
        pages' pass scores; float64 GEMMs here take ~100x longer), the rest float64."""
        n_q, n_heads, d = q.shape
        H, T = k.shape[1], k.shape[0]
        g = n_heads // H
        qr = q.reshape(n_q, H, g, d).transpose(1, 0, 2, 3).reshape(H, n_q * g, d)
        e = np.matmul(qr, np.ascontiguousarray(k.transpose(1, 2, 0), np.float32)).astype(np.float64) * scale
        e = e.reshape(H, n_q, g, T) - lse.reshape(n_q, H, g).transpose(1, 0, 2)[..., None]
        if seen is not None:
            e = np.where(seen[None, :, None, :], e, -np.inf)
        per_row = np.exp(e).sum(axis=2)  # [H, n_q, T]
        total += per_row.sum(axis=1)
        window += per_row[:, split:].sum(axis=1)

    def mass_f64(
        self, seqs: list[Seq], layer: int, q: Any, batch: AttentionBatch, tail: int, chunk: int = 256
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``mass`` on any backend: a float64 softmax of ``q`` against ``values``' keys, masked as ``attention``
        masks them, in chunks of ``chunk`` queries; the last ``tail`` queries summed apart too."""
        H = self.spec.n_kv_heads
        qh = np.asarray(self.backend.to_numpy(q), np.float64)
        group, d = qh.shape[1] // H, qh.shape[2]
        out, start = [], 0
        for i, (s, n_q) in enumerate(zip(seqs, batch.q_lens.tolist())):
            L = s.lens[layer]
            hidden = batch.hidden(i, L)  # a per-head eviction's holes
            kt = np.ascontiguousarray(self.values(s, layer)[0].astype(np.float64).transpose(1, 2, 0))  # [H, D, L]
            total, window = np.zeros((H, L)), np.zeros((H, L))
            split = max(0, n_q - tail)
            bounds = sorted({*range(0, n_q, chunk), split, n_q})
            for a, b in zip(bounds[:-1], bounds[1:]):
                pos = np.arange(L - n_q + a, L - n_q + b)[:, None]
                k1 = L - n_q + b if batch.causal else L  # the keys some query of the chunk sees: [k0, k1)
                k0 = max(0, L - n_q + a - batch.window + 1) if batch.window is not None else 0
                j = np.arange(k0, k1)[None, :]
                seen = (j <= pos) if batch.causal else np.ones((b - a, k1 - k0), bool)
                if batch.window is not None:
                    seen = seen & (j > pos - batch.window)
                seen = seen[None]  # [1 or H * group, b - a, keys]
                if hidden is not None:
                    seen = seen & ~np.repeat(hidden[:, k0:k1], group, axis=0)[:, None, :]
                rows = qh[start + a : start + b].reshape(b - a, H, group, d).transpose(1, 2, 0, 3)
                scores = np.matmul(rows.reshape(H, group * (b - a), d), kt[:, :, k0:k1])  # one GEMM per KV head
                scores = scores.reshape(H * group, b - a, k1 - k0) * batch.scale
                t, _ = head_mass(softmax(np.where(seen, scores, -np.inf))[0], H, 0)
                total[:, k0:k1] += t
                if a >= split:
                    window[:, k0:k1] += t
            out.append((total, window))
            start += n_q
        return out

    def keep_rows(self, s: Seq, kept: np.ndarray) -> int:
        """``SeqTable.keep_rows`` with a tail: keep only positions ``kept`` (ascending), at positions 0.., laid out
        as a store of them would lay them (``paged_after``): the newest rows in the f16 tail, whole blocks before
        them in the pages. A page row that stays in the pages keeps its bytes; a
        tail row that enters them is quantized from its f16 value; a page row that enters the tail is its
        dequantized value rounded to f16. Per-channel K pages (kivi) are kept byte for byte when a whole page moves
        to a page boundary, otherwise re-quantized from their rows' values (dequantized page rows: quantized twice,
        error at most half a step of each page's scale per channel). All computed before anything changes.
        Returns the blocks freed."""
        n, H = max(s.lens, default=0), self.spec.n_kv_heads
        srcs = [np.broadcast_to(kept[:m], (H, m)) for m in np.searchsorted(kept, s.lens).tolist()]
        freed, first = self._relayout(s, srcs)
        self.table.relabel(s, kept, n, first)
        return freed

    def keep_heads(self, s: Seq, kept: list[list[np.ndarray]]) -> int:
        """``SeqTable.keep_heads`` with a tail: KV head ``h`` of layer ``l`` keeps positions ``kept[l][h]``
        (ascending) at its positions 0..; every layer's length becomes the longest kept set, ``K``, laid out as
        ``keep_rows`` lays ``K`` rows out (pages, sink rows, tail; each row's bytes or values by the same rules, per
        head), and a head that kept fewer leaves a hole ``[len(kept[l][h]), K)`` (``Seq.holes``) whose rows hold a
        copy of that head's last kept row (a per-channel page's range stays its kept rows'). Positions never move
        again, so the hole stays where it is as tail rows flush into the pages. Returns the blocks freed."""
        n, H = max(s.lens, default=0), self.spec.n_kv_heads
        length = max(len(k) for heads in kept for k in heads)
        srcs = []
        for heads in kept:
            src = np.zeros((H, length), np.int64)
            for h, k in enumerate(heads):
                src[h, : len(k)] = k
                src[h, len(k) :] = k[-1] if len(k) else 0
            srcs.append(src)
        freed, _ = self._relayout(s, srcs)
        self.table.relabel_heads(s, kept, n, length)
        return freed

    def _relayout(self, s: Seq, srcs: list[np.ndarray]) -> tuple[int, int]:
        """Per layer, new position ``i`` of KV head ``h`` takes old position ``srcs[l][h, i]``, laid out as
        ``keep_rows`` says. Returns the blocks freed and the first new position whose row moved (in any layer)."""
        spec, table, bs = self.spec, self.table, self.spec.block_size
        if coded := [w for w in "kv" if getattr(spec, f"{w}_fmt").side_data]:
            w = coded[0]
            raise UnsupportedError(
                f"evict with an f16 tail and a {getattr(spec, f'{w}_format')} {w.upper()} format: tail rows entering "
                f"the pages are quantized on the host, which needs the cache's side data; use a spec with tail=0, or "
                f"another {w.upper()} format"
            )
        assert s.paged is not None
        new_lens = [src.shape[1] for src in srcs]
        new_paged = [self.paged_after(m) for m in new_lens]
        moved = [np.flatnonzero((src != np.arange(src.shape[1])).any(axis=0)) for src in srcs]
        first = min((int(m[0]) for m in moved if m.size), default=max(new_lens, default=0))  # rows before stay
        w0 = first // bs * bs  # pages before this block are not written
        heads = np.arange(spec.n_kv_heads)
        writes, tails, sinks = {}, {}, {}
        for layer, (src, P, newP) in enumerate(zip(srcs, s.paged, new_paged)):
            k, v = (round_f16(x) for x in self.values(s, layer))  # page rows in the f16 tail are f16 too
            gk, gv = k[src.T, heads], v[src.T, heads]  # [m, H, D]: the rows at their new positions
            tails[layer] = (gk[newP:].astype(np.float16), gv[newP:].astype(np.float16))
            if spec.sink_tokens:
                S = min(spec.sink_tokens, len(gk))
                sinks[layer] = (gk[:S].astype(np.float16), gv[:S].astype(np.float16))
            if newP > w0:
                writes[layer] = self._page_rows(s, layer, src[:, w0:newP].T, P, gk[w0:newP], gv[w0:newP])
        n_keep = -(-max(new_paged, default=0) // bs)
        touched = list(range(w0 // bs, n_keep)) if writes else []
        table.reserve(table.shared(s, touched))
        free_before = table.allocator.n_free
        table.own(s, touched)
        for layer, (kb, vb) in writes.items():
            table.write_rows(layer, kb, vb, table.slots(s, w0, new_paged[layer]))
        table.release(s.blocks[n_keep:][::-1])
        del s.blocks[n_keep:]
        s.changed()
        s.lens, s.paged = new_lens, new_paged
        for layer, (tk, tv) in tails.items():
            s.tail_k[layer], s.tail_v[layer] = tk, tv
        for layer, (sk, sv) in sinks.items():
            s.sink_k[layer], s.sink_v[layer] = sk, sv
        return table.allocator.n_free - free_before, min(first, *new_paged)  # pages past new_paged hold no rows now

    def paged_after(self, n: int) -> int:
        """The tokens in the pages of a sequence of ``n`` tokens stored at once: whole blocks, all but the last
        ``tail`` tokens (and a per-channel K format's open page)."""
        return max(0, n - self.spec.tail) // self.spec.block_size * self.spec.block_size

    def _page_rows(
        self, s: Seq, layer: int, src: np.ndarray, P: int, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The stored bytes of new page rows (a whole number of pages) whose KV head ``h`` takes old position
        ``src[i, h]`` (``[rows, H]``) with f16 values ``k``/``v`` ``[rows, H, D]``: the old page rows' own bytes where
        they have them (``src < P``), else quantized from ``k``/``v``; a per-channel K page per head: its old bytes
        if it is a whole old page of that head, else quantized from its rows' values."""
        spec, bs = self.spec, self.spec.block_size
        kraw, vraw = self.table.read_rows(s, layer, 0, P)
        rows, H = src.shape
        heads = np.arange(H)
        paged = src < P
        at = np.where(paged, src, 0)
        vb = np.empty((rows, H, spec.v_row_bytes), np.uint8)
        kb = np.empty((rows, H, spec.k_row_bytes), np.uint8)
        if paged.any():
            vb[...], kb[...] = vraw[at, heads], kraw[at, heads]
        vb[~paged] = spec.v_fmt.quantize(v[~paged])
        codec = spec.k_fmt.k_page
        if codec is None:
            kb[~paged] = spec.k_fmt.quantize(k[~paged])
            return kb, vb
        pages = src.reshape(-1, bs, H).transpose(0, 2, 1)  # [pages, H, bs]: old positions per head
        whole = (pages[..., 0] % bs == 0) & (pages[..., -1] < P) & (pages == pages[..., :1] + np.arange(bs)).all(-1)
        p, h = np.nonzero(~whole)  # the others keep their bytes (a page's rows are a reshape of it), gathered above
        if p.size:
            x = np.ascontiguousarray(k.reshape(-1, bs, H, spec.head_dim)[p, :, h])  # [n, bs, D]
            kb.reshape(-1, bs, H, spec.k_row_bytes)[p, :, h] = codec.quantize_page(x).reshape(len(p), bs, -1)
        return kb, vb

    def _tail_part(
        self,
        s: Seq,
        layer: int,
        rows: np.ndarray,
        pos: np.ndarray,
        P: int,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(out, lse) of float64 attention of query ``rows`` (at positions ``pos``) over the tail rows ``[P, L)``:
        only the queries that see a tail key are scored (causal: those at or after ``P``), one GEMM per KV head
        for the group's query heads (no copy of K/V per query head)."""
        n_q, Hq, D = rows.shape
        H = self.spec.n_kv_heads
        g, L = Hq // H, s.lens[layer]
        out, lse = np.zeros(rows.shape, np.float32), np.full((n_q, Hq), -np.inf)
        r0 = int(np.searchsorted(pos, P)) if causal else 0  # earlier queries see no tail key
        m = n_q - r0
        if m <= 0:
            return out, lse
        kt = s.tail_k[layer].astype(np.float64).transpose(1, 2, 0)  # [H, D, T]
        vt = s.tail_v[layer].astype(np.float64).transpose(1, 0, 2)  # [H, T, D]
        qh = rows[r0:].astype(np.float64).reshape(m, H, g, D).transpose(1, 0, 2, 3).reshape(H, m * g, D)
        scores = np.matmul(qh, kt).reshape(H, m, g, L - P) * scale
        j, at = np.arange(P, L)[None, :], pos[r0:, None]
        lo = at - window + 1 if window is not None else np.full((m, 1), P)
        hi = at + 1 if causal else np.full((m, 1), L)
        scores = np.where(((j >= lo) & (j < hi))[None, :, None], scores, -np.inf)
        if layer in s.holes:  # a per-head eviction's hole among the tail rows
            scores = np.where(self.hidden(s, layer, P, L)[:, None, None, :], -np.inf, scores)
        p, lse_t = softmax(scores)  # [H, m, g, T], [H, m, g]
        o = np.matmul(p.reshape(H, m * g, L - P), vt).reshape(H, m, g, D)
        out[r0:] = o.transpose(1, 0, 2, 3).reshape(m, Hq, D)
        lse[r0:] = lse_t.transpose(1, 0, 2).reshape(m, Hq)
        return out, lse

    @staticmethod
    def hidden(s: Seq, layer: int, lo: int, hi: int) -> np.ndarray:
        """Bool ``[n_kv_heads, hi - lo]``: which of positions ``[lo, hi)`` each KV head does not attend (its hole)."""
        j, holes = np.arange(lo, hi)[None, :], s.holes[layer]
        return (j >= holes[:, :1]) & (j < holes[:, 1:])

    def sink_rows(self, s: Seq, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored-form f32 rows of the f16 sink positions ``[0, min(sink_tokens, stored))``."""
        empty = np.zeros((0, self.spec.n_kv_heads, self.spec.head_dim), np.float16)
        return s.sink_k.get(layer, empty).astype(np.float32), s.sink_v.get(layer, empty).astype(np.float32)

    def rows(self, s: Seq, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored-form f32 rows of tail positions ``[lo, hi)`` (counted from the tail's start)."""
        if layer not in s.tail_k:  # a layer not stored yet (an evict reads every layer)
            empty = np.zeros((0, self.spec.n_kv_heads, self.spec.head_dim), np.float32)
            return empty, empty
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
        pages_v: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention over the quantized pages (the backend's kernel) merged with float64 attention over the tail,
        and each query row's log-sum-exp over all the keys it saw (float64 ``[n_q, H]``: what ``mass`` takes).

        ``pages_q``: for a K format scored in its own coefficient space (kltq), the queries the pages take and
        the score term they leave out per query row and head (``q . mu``), added back to their log-sum-exp.
        ``pages_v``: for a V format whose pages' output comes in its coefficient space (kltq), the map of that
        output back to values, applied before the parts are merged (the f16 rows are values)."""
        pools, sink = self.pools, self.spec.sink_tokens
        if sink and window is not None:
            raise UnsupportedError(
                "attention with a window over a cache with f16 sinks (CacheSpec.sinks) is not supported; pass "
                "window=None or sinks=0"
            )
        qh = np.asarray(self.backend.to_numpy(q), np.float32)
        qp, offset = (qh, None) if pages_q is None else (np.asarray(self.backend.to_numpy(pages_q[0]), np.float32),
                                                          pages_q[1] * scale)  # fmt: skip
        group = qh.shape[1] // self.spec.n_kv_heads
        out, lse_all = np.empty(qh.shape, np.float32), np.empty(qh.shape[:2])
        start = 0
        for s, n_q in zip(seqs, q_lens):
            rows, prow = qh[start : start + n_q], qp[start : start + n_q]
            L, P = s.lens[layer], s.pages()[layer]
            pos = np.arange(L - n_q, L)
            S, b, a, pages = self.pages(s, layer, n_q, causal, scale)
            parts = []
            if S:
                ks, vs = self.sink_rows(s, layer)
                kt = np.repeat(ks[:S].astype(np.float64), group, axis=1)
                vt = np.repeat(vs[:S].astype(np.float64), group, axis=1)
                scores = np.einsum("qhd,khd->hqk", rows.astype(np.float64), kt) * scale
                if causal:
                    scores = np.where((np.arange(S)[None, :] <= pos[:, None])[None], scores, -np.inf)
                if layer in s.holes:  # a per-head eviction's hole among the sink rows
                    hidden = np.repeat(self.hidden(s, layer, 0, S), group, axis=0)
                    scores = np.where(hidden[:, None, :], -np.inf, scores)
                p, lse_s = softmax(scores)
                parts.append((np.einsum("hqk,khd->qhd", p, vt).astype(np.float32), lse_s.T))
            if P > S:
                o = np.zeros(rows.shape, np.float32)
                lse = np.full(rows.shape[:2], -np.inf)

                def run(
                    r: np.ndarray, causal_: bool, win: int | None, pages: AttentionBatch = pages
                ) -> tuple[np.ndarray, np.ndarray]:
                    batch = pages.with_(q_lens=np.array([len(r)], np.int32), causal=causal_, window=win)
                    return self.backend.attention_lse(r, pools, layer, batch)

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
                parts.append((o if pages_v is None else pages_v(o), lse))
            if L > P:
                parts.append(self._tail_part(s, layer, rows, pos, P, scale, causal, window))
            out[start : start + n_q], lse_all[start : start + n_q] = merge_lse(parts)
            start += n_q
        return out, lse_all
