"""Scoring and eviction with an f16 tail (``tail > 0``, per-channel K formats) on every backend.

The observed mass is checked against a float64 softmax over ``load`` (pages and tail together); after ``evict``
each kept row is checked against a transcription of the documented layout: the newest rows in the f16 tail,
whole pages before them, page rows that stay paged keep their values, tail rows that enter the pages are
quantized from f16 by the numpy format reference, per-channel K pages not moved whole are re-quantized from their
rows' f16 values, page rows that enter the tail are their values rounded to f16. A per-head eviction (AdaKV)
lays each head's kept rows out by the same rules, its hole rows copies of its last kept row; attention is checked
against float64 attention over each head's own rows, also after decode steps flush hole rows into the pages.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal import formats
from kvhal.eviction import H2O, AdaKV, Knorm, SinkWindow, SnapKV
from tests.contract.test_observe import f64_mass
from tests.oracle import adakv_transcription, attention_f64


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def tail_specs(info: kvhal.BackendInfo) -> list[kvhal.CacheSpec]:
    """A per-token format with ``tail=12``, and a per-channel K format (its open page in the tail) where the
    backend runs one as K."""
    plain = [f for f in ("q4_0", "q8_0", "f16") if f in info.formats]
    if not plain:
        pytest.skip(f"{info.name} claims none of q4_0, q8_0, f16")
    base = dict(n_layers=2, n_kv_heads=2, head_dim=64, block_size=8, v_format=plain[0])
    specs = [kvhal.CacheSpec(k_format=plain[-1], tail=12, **base)]
    for fk in ("kivi4", "kivi2"):
        if fk in info.formats:
            spec = kvhal.CacheSpec(k_format=fk, **base)
            try:
                kvhal.KVCache(spec, 64, backend=info.name)
            except kvhal.UnsupportedError:  # the backend runs it as V only
                continue
            specs.append(spec)
            break
    return specs


def filled(info: kvhal.BackendInfo, spec: kvhal.CacheSpec, n: int, seed: int, cap: int = 512, **kw):
    rng = np.random.default_rng(seed)
    c = kvhal.KVCache(spec, cap, backend=info.name, **kw)
    s = c.new_seq()
    for layer in range(spec.n_layers):
        k = rng.standard_normal((n, 2, 64), dtype=np.float32)
        k[:, :, 3] *= 8  # an outlier channel, as real keys have
        c.store(s, layer, k, rng.standard_normal((n, 2, 64), dtype=np.float32))
    return c, s


def held(c: kvhal.KVCache, s: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    k, v = c.load(s, layer)
    return np.asarray(kvhal.to_numpy(k), np.float32), np.asarray(kvhal.to_numpy(v), np.float32)


def after_evict(spec: kvhal.CacheSpec, k: np.ndarray, v: np.ndarray, paged: int, kept: np.ndarray):
    """K, V that ``load`` returns after ``evict`` kept old positions ``kept`` of rows held as ``k``/``v``, of which
    the first ``paged`` were in the pages: the transcription of the layout in the module docstring."""
    bs, m = spec.block_size, len(kept)
    new_paged = max(0, m - spec.tail) // bs * bs
    src = kept[:new_paged]
    was_paged = (src < paged)[:, None, None]
    fk, fv = formats.get(spec.k_format), formats.get(spec.v_format)
    ek, ev = f16(k[kept]), f16(v[kept])
    ev[:new_paged] = np.where(was_paged, v[src], fv.dequantize(fv.quantize(f16(v[src]))))
    if fk.k_page is None:
        ek[:new_paged] = np.where(was_paged, k[src], fk.dequantize(fk.quantize(f16(k[src]))))
        return ek, ev
    for a in range(0, new_paged, bs):
        rows = src[a : a + bs]
        if rows[0] % bs == 0 and rows[-1] < paged and np.array_equal(rows, np.arange(rows[0], rows[0] + bs)):
            ek[a : a + bs] = k[rows]  # a whole page moved: its bytes
        else:
            x = f16(k[rows]).transpose(1, 0, 2)  # [H, bs, D]
            page = fk.k_page.dequantize_page(fk.k_page.quantize_page(np.ascontiguousarray(x)), bs)
            ek[a : a + bs] = page.reshape(x.shape).transpose(1, 0, 2)
    return ek, ev


@pytest.mark.parametrize("window", [None, 37])
def test_observed_mass_with_a_tail_equals_float64_softmax(backend_info, window, monkeypatch):
    """A prefill then a decode query, with and without a window: the mass against a float64 softmax over ``load``,
    from the backend's fused pass over the pages where it has one (with the window too), else the host's."""
    for spec in tail_specs(backend_info):
        c, s = filled(backend_info, spec, 75, seed=1, observe_window=24)
        plain, p = filled(backend_info, spec, 75, seed=1)
        calls: list[int | None] = []

        def spy(*args, real=c.backend.attention_mass, calls=calls):
            calls.append(args[3].window)
            return real(*args)

        monkeypatch.setattr(c.backend, "attention_mass", spy)
        q = np.random.default_rng(2).standard_normal((75, 4, 64), dtype=np.float32)
        total = [np.zeros((2, 75)), np.zeros((2, 75))]
        for layer in (0, 1):
            for q_len in (75, 1):  # a prefill, then a decode query (the mass accumulates)
                out = c.attention(layer, q[-q_len:], [s], [q_len], window=window, observe=True)
                want_out = plain.attention(layer, q[-q_len:], [p], [q_len], window=window)
                np.testing.assert_array_equal(kvhal.to_numpy(out), kvhal.to_numpy(want_out))
                [(t, w)] = f64_mass(c, [s], q[-q_len:], [q_len], 64**-0.5, window, 24, layer)
                total[layer] += t
            rec = c.seq_table.get(s)
            tol = fused_tol(c)
            np.testing.assert_allclose(rec.mass[layer], total[layer], **tol)
            np.testing.assert_allclose(rec.window_mass[layer], w, **tol)  # the last call's window
            assert rec.mass[layer].sum() == pytest.approx(76 * 4, rel=tol["rtol"])  # each row's weights sum to 1
        if "attention_mass" in c.backend.fused:  # the pages' part is the backend's pass, given the window
            assert calls and all((w is not None) == (window is not None) for w in calls)
        else:
            assert calls == []


def fused_tol(c: kvhal.KVCache) -> dict[str, float]:
    """The float64 host path is exact to rounding; a backend's fused mass pass scores in float32 (test_observe)."""
    fused = "attention_mass" in c.backend.fused
    return dict(rtol=1e-4, atol=1e-5) if fused else dict(rtol=1e-9, atol=1e-12)


def test_the_tail_mass_takes_the_fused_pass_for_the_pages(backend_info, monkeypatch):
    """With sinks and a tail, two sequences in one call: a whole prefill (queries before, among and after the
    pages), a chunk straddling the pages' end, and a decode query. Where the backend fuses ``attention_mass``, the
    pages' part is that pass given the rows' log-sum-exp over all their keys, and only the f16 rows are scored on
    the host; either way the mass is the float64 softmax over ``load``."""
    fmt = next((f for f in ("q8_0", "q4_0") if f in backend_info.formats), None)
    if fmt is None:
        pytest.skip(f"{backend_info.name} claims neither q8_0 nor q4_0")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=8, sinks=5,
                           tail=12)  # fmt: skip
    c = kvhal.KVCache(spec, 128, backend=backend_info.name, observe_window=7)
    calls = []
    real = c.backend.attention_mass

    def spy(q, pools, layer, batch, tail, lse=None):
        calls.append((len(q), int(batch.seq_lens[0]), bool(batch.causal), tail, lse is not None))
        return real(q, pools, layer, batch, tail, lse)

    monkeypatch.setattr(c.backend, "attention_mass", spy)
    rng = np.random.default_rng(7)
    s, t = c.new_seq(), c.new_seq()
    kv = {x: [rng.standard_normal((n, 2, 64), dtype=np.float32) for _ in "kv"] for x, n in ((s, 61), (t, 45))}
    c.store(t, 0, kv[t][0][:30], kv[t][1][:30])
    total = {s: np.zeros((2, 61)), t: np.zeros((2, 45))}
    for step, (seqs, q_lens) in enumerate((([s, t], [61, 30]), ([t], [15]), ([s, t], [1, 1]))):
        if step == 0:
            c.store(s, 0, *kv[s])
        elif step == 1:
            c.store(t, 0, kv[t][0][30:], kv[t][1][30:])
        q = rng.standard_normal((sum(q_lens), 4, 64), dtype=np.float32)
        c.attention(0, q, seqs, q_lens, observe=True)
        for x, (m, w) in zip(seqs, f64_mass(c, seqs, q, q_lens, 64**-0.5, None, 7)):
            total[x][:, : m.shape[1]] += m
            rec = c.seq_table.get(x)
            np.testing.assert_allclose(rec.mass[0], total[x][:, : m.shape[1]], **fused_tol(c))
            np.testing.assert_allclose(rec.window_mass[0], w, **fused_tol(c))
    if "attention_mass" not in c.backend.fused:
        assert calls == []  # the float64 host path
        return
    # (queries, page keys, causal, window queries, lse given): s has 61 tokens, 48 paged (the first 8 sinks): its
    # prefill's queries 0..7 see no page key, 8..47 sit among them (causal), 48..60 follow them (the last 7 the
    # window); t has 30 tokens (16 paged), then 45 (32 paged: its queries at 30, 31 sit among them)
    assert calls == [
        (40, 40, True, 0, True),
        (13, 40, False, 7, True),
        (8, 8, True, 0, True),
        (14, 8, False, 7, True),
        (2, 24, True, 0, True),
        (13, 24, False, 7, True),
        (1, 40, False, 1, True),
        (1, 24, False, 1, True),
    ]


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "knorm", "sink_window", "window"])
def test_evict_with_a_tail_keeps_the_policy_rows_as_documented(backend_info, policy):
    n, keep = 61, 29 if policy == "window" else 27  # "window": whole pages move to page boundaries
    for spec in tail_specs(backend_info):
        c, s = filled(backend_info, spec, n, seed=3, observe_window=16)
        q = np.random.default_rng(4).standard_normal((n, 4, 64), dtype=np.float32)
        before = [held(c, s, layer) for layer in (0, 1)]
        paged = list(c.seq_table.get(s).pages())
        scores = np.zeros(n)
        for layer in (0, 1):
            c.attention(layer, q, [s], [n], observe=True)
            [(t, w)] = f64_mass(c, [s], q, [n], 64**-0.5, None, 16, layer)
            scores += (t if policy == "h2o" else w).sum(axis=0)
        if policy == "h2o":
            pol, recent = H2O(heavy=keep - 9, recent=9), 9
            want = sorted(sorted(range(n - recent), key=lambda j: (-scores[j], j))[: keep - recent])
            want += list(range(n - recent, n))
        elif policy == "snapkv":
            pol, win = SnapKV(window=16, kernel=5), 16
            pooled = np.convolve(np.pad(scores[: n - win], 2), np.ones(5) / 5, "valid")  # avg_pool1d, pad counted
            want = sorted(sorted(range(n - win), key=lambda j: (-pooled[j], j))[: keep - win]) + list(range(n - win, n))
        elif policy == "knorm":
            pol = Knorm()
            norm = sum(np.linalg.norm(k.astype(np.float64), axis=-1).sum(axis=1) for k, _ in before)
            want = sorted(sorted(range(n), key=lambda j: (norm[j], j))[:keep])
        else:
            sinks = 4 if policy == "sink_window" else 0
            pol, want = SinkWindow(sinks=sinks), list(range(sinks)) + list(range(n - keep + sinks, n))
        blocks_before = len(c.block_ids(s))
        res = c.evict(s, pol, keep_tokens=keep)
        assert res.kept.tolist() == want, spec
        kept = res.kept
        rec = c.seq_table.get(s)
        new_paged = max(0, keep - spec.tail) // spec.block_size * spec.block_size
        assert rec.pages() == [new_paged] * 2 and c.seq_len(s) == keep
        assert res.blocks_freed == blocks_before - new_paged // spec.block_size == blocks_before - len(c.block_ids(s))
        rng = np.random.default_rng(5)
        for layer in (0, 1):
            ek, ev = after_evict(spec, *before[layer], paged[layer], kept)
            gk, gv = held(c, s, layer)
            np.testing.assert_array_equal(gk, ek)
            np.testing.assert_array_equal(gv, ev)
            # decode after the eviction: one more token (its store pages a tail block, as a store does: the same
            # transcription, every row kept), attended as over those rows
            x = rng.standard_normal((2, 1, 2, 64), dtype=np.float32)
            c.store(s, layer, x[0], x[1])
            ek, ev = after_evict(spec, np.r_[ek, f16(x[0])], np.r_[ev, f16(x[1])], new_paged, np.arange(keep + 1))
            for got, want in zip(held(c, s, layer), (ek, ev)):
                np.testing.assert_array_equal(got, want)
            qd = rng.standard_normal((1, 4, 64), dtype=np.float32)
            got = kvhal.to_numpy(c.attention(layer, qd, [s], [1]))
            np.testing.assert_allclose(got, attention_f64(qd, [ek], [ev], [1]), atol=c.backend.attention_tolerance)


def test_evict_with_a_tail_that_fails_changes_nothing(backend_info):
    for spec in tail_specs(backend_info):
        cap = 64  # 8 blocks: the 61 tokens' pages and a copy sharing all of them leave none free
        c, s = filled(backend_info, spec, 61, seed=6, cap=cap)
        c.seq_cp(s)
        fill = np.ones((c.stats().blocks_free * spec.block_size + spec.tail, 2, 64), np.float32)
        c.store(c.new_seq(), 0, fill, fill)  # pages every free block (its last spec.tail rows stay in the tail)
        assert c.stats().blocks_free == 0
        before = [held(c, s, layer) for layer in (0, 1)]
        ids, st = c.block_ids(s), c.stats()
        with pytest.raises(kvhal.CapacityError):  # moving rows needs a private copy of a shared page
            c.evict(s, SinkWindow(sinks=4), keep_tokens=30)
        assert c.block_ids(s) == ids and c.stats() == st
        for layer in (0, 1):
            c.attention(layer, np.ones((61, 4, 64), np.float32), [s], [61], observe=True)
        rec = c.seq_table.get(s)
        mass = [m.copy() for m in rec.mass.values()]
        # per head (AdaKV): the same; a backend that cannot mask a head's rows refuses first
        error = kvhal.CapacityError if c.backend.masks_heads_of(spec) else kvhal.UnsupportedError
        with pytest.raises(error):
            c.evict(s, AdaKV(H2O(heavy=20, recent=10)), keep_tokens=30)
        assert c.block_ids(s) == ids and c.stats() == st and not rec.holes and rec.lens == [61, 61]
        assert all(np.array_equal(a, b) for a, b in zip(rec.mass.values(), mass))
        for layer in (0, 1):
            for x, y in zip(held(c, s, layer), before[layer]):
                np.testing.assert_array_equal(x, y)


def test_evict_with_a_tail_before_every_layer_is_stored(backend_info):
    """A layer not stored yet holds nothing to keep: evict compacts the stored ones, as without a tail."""
    for spec in tail_specs(backend_info):
        rng = np.random.default_rng(7)
        c = kvhal.KVCache(spec, 256, backend=backend_info.name)
        s = c.new_seq()
        k, v = (rng.standard_normal((40, 2, 64), dtype=np.float32) for _ in range(2))
        c.store(s, 0, k, v)
        res = c.evict(s, SinkWindow(sinks=4), keep_tokens=20)
        assert res.kept.tolist() == [*range(4), *range(24, 40)]
        assert [c.seq_len(s, layer) for layer in (0, 1)] == [20, 0]
        c.store(s, 1, k[:3], v[:3])  # the layer fills as a fresh one would
        np.testing.assert_array_equal(held(c, s, 1)[1], f16(v[:3]))


def head_specs(info: kvhal.BackendInfo) -> list[kvhal.CacheSpec]:
    """A per-token format with ``tail=32`` and 4 f16 sinks (a page of them), and ``tail_specs``' per-channel K."""
    fmt = next((f for f in ("q8_0", "q4_0", "f16") if f in info.formats), None)
    if fmt is None:
        pytest.skip(f"{info.name} claims none of q8_0, q4_0, f16")
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=16, tail=32,
                           sinks=4)  # fmt: skip
    return [spec, *tail_specs(info)[1:]]


def test_adakv_with_a_tail_masks_each_heads_rows_through_flushes(backend_info):
    """AdaKV(SnapKV) over sinks, pages and tail: each head's kept set is AdaKV's rule over the observed window mass,
    its rows are laid out as ``after_evict`` transcribes them (per head; the f16 sink page over the pages), and
    attention (observed too) equals float64 attention over each head's own rows, after the eviction and after
    decode chunks whose stores flush hole rows from the tail into the pages. A backend that cannot mask a head's
    rows refuses before changing anything."""
    n, keep, win = 150, 60, 16
    policy = AdaKV(SnapKV(window=win, kernel=3), ceiling=1.25, safeguard=0.5)
    for spec in head_specs(backend_info):
        c, s = filled(backend_info, spec, n, seed=8, observe_window=win)
        rng = np.random.default_rng(9)
        q = rng.standard_normal((n, 4, 64), dtype=np.float32)
        for layer in (0, 1):
            c.attention(layer, q, [s], [n], observe=True)
        before = [held(c, s, layer) for layer in (0, 1)]
        rec = c.seq_table.get(s)
        paged, wm = list(rec.pages()), [rec.window_mass[layer].copy() for layer in (0, 1)]
        blocks = len(c.block_ids(s))
        if not c.backend.masks_heads_of(spec):
            with pytest.raises(kvhal.UnsupportedError, match="positions per KV head"):
                c.evict(s, policy, keep_tokens=keep)
            assert c.seq_len(s) == n and len(c.block_ids(s)) == blocks and not rec.holes
            for layer in (0, 1):
                for x, y in zip(held(c, s, layer), before[layer]):
                    np.testing.assert_array_equal(x, y)
            continue
        res = c.evict(s, policy, keep_tokens=keep)
        assert res.heads is not None
        length, bs = res.length, spec.block_size
        new_paged = max(0, length - spec.tail) // bs * bs
        assert rec.pages() == [new_paged] * 2 and c.seq_len(s) == length
        assert res.blocks_freed == blocks - new_paged // bs == blocks - len(c.block_ids(s))
        want: list[list[tuple[int, np.ndarray, np.ndarray]]] = []  # per layer, per head: (kept, K, V) as held
        for layer in (0, 1):
            assert [h.tolist() for h in res.heads[layer]] == adakv_transcription(wm[layer], n, keep, win, 3, 1.25, 0.5)
            heads = []
            for h, kept in enumerate(res.heads[layer]):
                src = np.r_[kept, np.full(length - len(kept), kept[-1])]  # the hole: copies of the last kept row
                ek, ev = (x[:, h] for x in after_evict(spec, *before[layer], paged[layer], src))
                S = min(spec.sink_tokens, length)
                ek[:S], ev[:S] = f16(before[layer][0][src[:S], h]), f16(before[layer][1][src[:S], h])
                heads.append((len(kept), ek, ev))
            want.append(heads)
        for step in range(5):  # then decode chunks of 12 tokens: the tail flushes pages holding hole rows
            for layer in (0, 1) if step else ():
                x = rng.standard_normal((2, 12, 2, 64), dtype=np.float32)
                p0 = rec.pages()[layer]
                c.store(s, layer, x[0], x[1])
                for h, (m, ek, ev) in enumerate(want[layer]):  # rows from p0 on paged as a store pages them
                    k1, v1 = np.r_[ek, f16(x[0, :, h])][:, None], np.r_[ev, f16(x[1, :, h])][:, None]
                    ek, ev = (y[:, 0] for y in after_evict(spec, k1, v1, p0, np.arange(len(k1))))
                    want[layer][h] = (m, ek, ev)
            n_q = 2 if step else 1  # (right after the eviction the last positions are some heads' hole)
            for layer in (0, 1):
                qd = rng.standard_normal((n_q, 4, 64), dtype=np.float32)
                got = kvhal.to_numpy(c.attention(layer, qd, [s], [n_q], observe=bool(step % 2)))
                for h, (m, ek, ev) in enumerate(want[layer]):
                    rows = np.r_[np.arange(m), np.arange(length, len(ek))]  # the hole [m, length) unseen
                    exp = attention_f64(qd[:, 2 * h : 2 * h + 2], [ek[rows, None]], [ev[rows, None]], [n_q])
                    np.testing.assert_allclose(got[:, 2 * h : 2 * h + 2], exp, atol=c.backend.attention_tolerance)
                    if step % 2:
                        assert not rec.mass[layer][h, m:length].any()  # observed: nothing for the hole
        assert min(rec.pages()) >= length > new_paged  # every hole row was flushed into the pages


@pytest.mark.parametrize("tail", [0, 12])
def test_a_store_that_does_not_fit_leaves_sinks_and_tail_as_they_were(backend_info, tail):
    """With f16 sink rows (and a tail) a store refused for room changes nothing: the sink rows of the refused
    rows never reach the sequence, so the next store's rows are what ``load`` returns."""
    fmt = next((f for f in ("q8_0", "q4_0") if f in backend_info.formats), None)
    if fmt is None:
        pytest.skip(f"{backend_info.name} claims neither q8_0 nor q4_0")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=8, sinks=4,
                           tail=tail)  # fmt: skip
    for first in (0, 2):  # an empty sequence, and one with part of its sink rows
        c = kvhal.KVCache(spec, 64, backend=backend_info.name)
        s = c.new_seq()
        rng = np.random.default_rng(first)
        k, v = rng.standard_normal((2, first + 20, 2, 64), dtype=np.float32)
        if first:
            c.store(s, 0, k[:first], v[:first])
        before = c.load(s, 0)
        with pytest.raises(kvhal.CapacityError):
            c.store(s, 0, rng.standard_normal((400, 2, 64), dtype=np.float32), np.ones((400, 2, 64), np.float32))
        after = c.load(s, 0)
        assert all(np.array_equal(a, b) for a, b in zip(before, after)) and c.seq_len(s) == first
        c.store(s, 0, k[first:], v[first:])
        np.testing.assert_array_equal(c.load(s, 0)[0][:4], np.float16(k[:4]).astype(np.float32))  # the f16 sinks


@pytest.mark.parametrize("tail", [0, 12])
def test_seq_rm_past_the_stored_rows_drops_the_token_ids_recorded_ahead(backend_info, tail):
    """An engine records a step's token ids, its store is refused, it rolls back with seq_rm(s, n, -1): the ids
    past the stored rows go with or without an f16 tail, so the sequence never names tokens it does not hold."""
    fmt = next((f for f in ("q8_0", "q4_0") if f in backend_info.formats), None)
    if fmt is None:
        pytest.skip(f"{backend_info.name} claims neither q8_0 nor q4_0")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=8,
                           tail=tail)  # fmt: skip
    c = kvhal.KVCache(spec, 64, backend=backend_info.name)
    s = c.new_seq()
    k = np.random.default_rng(3).standard_normal((12, 2, 64), dtype=np.float32)
    c.store(s, 0, k, k)
    c.append_tokens(s, list(range(15)))
    c.seq_rm(s, 12, -1)
    assert c.tokens(s) == list(range(12)) and c.seq_len(s) == 12
