"""Eviction policies against independent transcriptions of their published rules, and full-cache modes."""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal.eviction import H2O, AdaKV, EvictOnFull, SinkWindow, SnapKV
from tests.oracle import attention_f64

SPEC = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="f32", v_format="f32", block_size=4)


def filled(n: int, cap: int = 256, seed: int = 0, **kw) -> tuple[kvhal.KVCache, int, np.ndarray, np.ndarray]:
    c = kvhal.KVCache(SPEC, cap, backend="reference", **kw)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, 2, 32), dtype=np.float32)
    v = rng.standard_normal((n, 2, 32), dtype=np.float32)
    s = c.new_seq()
    for layer in (0, 1):
        c.store(s, layer, k, v)
    return c, s, k, v


def mass_f64(q: np.ndarray, k: np.ndarray, q_len: int, n: int) -> np.ndarray:
    """Softmax weight each key gets, summed over queries and the query heads of each KV head (float64)."""
    group = q.shape[1] // k.shape[1]
    out = np.zeros((k.shape[1], n))
    for i in range(q_len):
        pos = n - q_len + i
        for h in range(q.shape[1]):
            s = (q[i, h].astype(np.float64) @ k[: pos + 1, h // group].astype(np.float64).T) / np.sqrt(32)
            p = np.exp(s - s.max())
            out[h // group, : pos + 1] += p / p.sum()
    return out


def test_sink_window_is_streaming_llm():
    c, s, k, _ = filled(40)
    res = c.evict(s, SinkWindow(sinks=4, window=10), keep_tokens=20)
    want = list(range(4)) + list(range(30, 40))  # sinks + the window (it fits in keep_tokens)
    assert res.kept.tolist() == want and res.dropped.tolist() == list(range(4, 30))
    np.testing.assert_array_equal(c.load(s, 1)[0], k[want])
    assert res.blocks_freed == 10 - 4 and res.bytes_freed == res.blocks_freed * SPEC.block_nbytes
    st = c.stats()
    assert (st.evictions, st.evicted_tokens_called, st.tokens) == (1, 26, 14)
    c2, s2, _, _ = filled(40)
    assert c2.evict(s2, SinkWindow(sinks=4), keep_tokens=8).kept.tolist() == [0, 1, 2, 3, 36, 37, 38, 39]
    assert c2.evict(s2, SinkWindow(), keep_tokens=100).dropped.size == 0  # already short enough


def test_h2o_keeps_heavy_hitters_by_observed_mass():
    c, s, k, v = filled(30)
    rng = np.random.default_rng(5)
    total = np.zeros((2, 30))
    for step in range(3):  # three observed calls: a prefill-like one and two decode-like ones
        q_len = 6 if step == 0 else 1
        q = rng.standard_normal((q_len, 4, 32), dtype=np.float32)
        out = c.attention(0, q, [s], [q_len], observe=True)
        np.testing.assert_allclose(out, attention_f64(q, [k], [v], [q_len]), atol=1e-6)
        total += mass_f64(q, k, q_len, 30)
    np.testing.assert_allclose(c.seq_table.get(s).mass[0], total, rtol=1e-9, atol=1e-12)
    with pytest.raises(kvhal.ShapeError, match="once per call"):  # whose queries would the window mass hold?
        c.attention(0, rng.standard_normal((2, 4, 32), dtype=np.float32), [s, s], [1, 1], observe=True)
    np.testing.assert_allclose(c.seq_table.get(s).mass[0], total, rtol=1e-9, atol=1e-12)
    score = total.sum(axis=0)  # one set of positions for every head: heads summed
    heavy = sorted(sorted(range(30 - 5), key=lambda j: (-score[j], j))[:7])
    res = c.evict(s, H2O(heavy=7, recent=5), keep_tokens=12)
    assert res.kept.tolist() == heavy + list(range(25, 30))
    np.testing.assert_allclose(c.seq_table.get(s).mass[0], total[:, res.kept], rtol=1e-12)  # scores follow their keys
    c2, s2, _, _ = filled(30)
    with pytest.raises(kvhal.SpecError, match="observe=True"):
        c2.evict(s2, H2O(heavy=4, recent=4), keep_tokens=8)
    assert c2.seq_len(s2) == 30


def test_snapkv_matches_the_published_rule_with_torch_pooling():
    torch = pytest.importorskip("torch")
    c, s, k, _ = filled(64, observe_window=8)
    q = np.random.default_rng(9).standard_normal((64, 4, 32), dtype=np.float32)
    c.attention(0, q, [s], [64], observe=True)  # the prefill
    c.attention(1, q, [s], [64], observe=True)
    window_q = q[-8:]
    per_layer = [mass_f64(window_q, k, 8, 64) for _ in (0, 1)]  # both layers store the same K here
    attn = sum(m.sum(axis=0) for m in per_layer)[: 64 - 8]
    pooled = torch.nn.functional.avg_pool1d(torch.tensor(attn)[None, None], kernel_size=5, padding=2, stride=1)[0, 0]
    top = torch.topk(pooled, 20 - 8).indices.sort().values.tolist()
    res = c.evict(s, SnapKV(window=8, kernel=5, pool="avg"), keep_tokens=20)
    assert res.kept.tolist() == top + list(range(56, 64))
    c2, s2, _, _ = filled(16)
    c2.attention(0, q[:16], [s2], [16], observe=True)
    with pytest.raises(kvhal.SpecError, match="observe_window=8"):
        c2.evict(s2, SnapKV(window=8), keep_tokens=10)
    for bad in ({"kernel": 4}, {"pool": "sum"}, {"pool": np.array(["avg", "max"])}, {"window": 0}, {"window": True}):
        with pytest.raises(kvhal.SpecError):
            SnapKV(**bad)


def test_on_full_evicts_the_longest_sequence_with_a_record():
    seen = []
    c = kvhal.KVCache(
        SPEC, 32, backend="reference", on_full=EvictOnFull(SinkWindow(sinks=4), keep_tokens=12), on_evict=seen.append
    )
    rng = np.random.default_rng(0)
    a, b = c.new_seq(), c.new_seq()
    big = rng.standard_normal((24, 2, 32), dtype=np.float32)
    small = rng.standard_normal((8, 2, 32), dtype=np.float32)
    for layer in (0, 1):
        c.store(a, layer, big, big)
        c.store(b, layer, small, small)
    assert c.stats().blocks_free == 0
    for layer in (0, 1):
        c.store(b, layer, small[:4], small[:4])  # no free block: a (the longest) is cut to 12 tokens
    assert c.seq_len(a) == 12 and c.seq_len(b) == 12
    [r] = seen
    assert (r.seq, r.cause, r.policy) == (a, "on_full", "sink_window")
    assert r.kept.tolist() == [0, 1, 2, 3] + list(range(16, 24)) and len(r.dropped) == 12
    np.testing.assert_array_equal(c.load(a, 0)[0], big[r.kept])
    st = c.stats()
    assert (st.evictions, st.evicted_tokens_on_full, st.evicted_tokens_called) == (1, 12, 0)
    plain = kvhal.KVCache(SPEC, 32, backend="reference")
    x = plain.new_seq()
    plain.store(x, 0, big, big)
    plain.store(x, 0, small, small)
    with pytest.raises(kvhal.CapacityError):
        plain.store(x, 0, small[:1], small[:1])
    assert plain.stats().evictions == 0


def test_raise_mode_keeps_cached_prefixes():
    c = kvhal.KVCache(SPEC, 16, backend="reference", on_full="raise")
    rng = np.random.default_rng(0)
    s = c.new_seq()
    kv = rng.standard_normal((16, 2, 32), dtype=np.float32)
    c.append_tokens(s, list(range(16)))
    for layer in (0, 1):
        c.store(s, layer, kv, kv)
    c.free_seq(s)
    t = c.new_seq()
    with pytest.raises(kvhal.CapacityError, match="cached prefixes"):
        c.store(t, 0, kv[:1], kv[:1])
    assert c.match_prefix(list(range(17)))[1] == 16
    lru = kvhal.KVCache(SPEC, 16, backend="reference")  # the default reuses them, counted
    s = lru.new_seq()
    lru.append_tokens(s, list(range(16)))
    for layer in (0, 1):
        lru.store(s, layer, kv, kv)
    lru.free_seq(s)
    lru.store(lru.new_seq(), 0, kv[:1], kv[:1])
    assert lru.stats().prefix_evicted_blocks == 1


def test_eviction_argument_validation():
    c, s, _, _ = filled(10)
    before = c.stats()
    for policy, keep, err in (
        (None, 4, kvhal.SpecError),
        (SinkWindow(), 4.0, kvhal.PositionError),
        (SinkWindow(), True, kvhal.PositionError),
        (SinkWindow(), -1, kvhal.PositionError),
    ):
        with pytest.raises(err):
            c.evict(s, policy, keep)
    with pytest.raises(kvhal.SequenceError):
        c.evict(99, SinkWindow(), 4)
    with pytest.raises(kvhal.ShapeError):
        c.attention(0, np.zeros((1, 4, 32), np.float32), [s], observe="yes")
    for bad in ({"on_full": "drop"}, {"on_evict": 3}, {"observe_window": 0}):
        with pytest.raises(kvhal.SpecError):
            kvhal.KVCache(SPEC, 16, backend="reference", **bad)
    with pytest.raises(kvhal.SpecError):
        EvictOnFull(SinkWindow(), keep_tokens=-1)
    with pytest.raises(kvhal.SpecError):
        SinkWindow(sinks=-1)
    assert c.stats() == before


@pytest.mark.parametrize("kw", [{"k_format": "q8_0", "tail": 8}, {"k_format": "kivi4"}])
def test_on_full_with_a_tail_evicts_during_decode(kw):
    """A decode whose tail flush finds no free block evicts the longest sequence, itself included, laid out as
    ``evict`` lays it out (the transcription in tests/contract/test_evict_tail.py); the decode then goes on."""
    from tests.contract.test_evict_tail import after_evict

    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, v_format="q4_0", block_size=8, **kw)
    seen = []
    policy = EvictOnFull(SinkWindow(sinks=4), keep_tokens=20)
    c = kvhal.KVCache(spec, 64, backend="reference", on_full=policy, on_evict=seen.append)
    rng = np.random.default_rng(0)
    a, b = c.new_seq(), c.new_seq()
    for s, n in ((a, 52), (b, 20)):
        for layer in (0, 1):
            x = rng.standard_normal((2, n, 2, 32), dtype=np.float32)
            c.store(s, layer, x[0], x[1])
    free = c.stats().blocks_free
    held = {layer: [np.asarray(x) for x in c.load(a, layer)] for layer in (0, 1)}
    paged = list(c.seq_table.get(a).pages())
    steps = 0
    while not seen:  # decode b until a flush of its tail needs a block that is not there
        steps += 1
        for layer in (0, 1):
            x = rng.standard_normal((2, 1, 2, 32), dtype=np.float32)
            c.store(b, layer, x[0], x[1])
    assert steps > free * 8 - 8  # no eviction while blocks were free
    [r] = seen
    assert (r.seq, r.cause) == (a, "on_full") and r.kept.tolist() == [0, 1, 2, 3, *range(36, 52)]
    for layer in (0, 1):
        for got, want in zip(c.load(a, layer), after_evict(spec, *held[layer], paged[layer], r.kept)):
            np.testing.assert_array_equal(got, want)
    assert c.seq_len(b) == 20 + steps and c.seq_len(a) == 20
    assert c.stats().evicted_tokens_on_full == 32


def test_expected_queries_undo_rope_and_carry_the_mean_future_rotation():
    """``expected_queries`` against rotation matrices built position by position (RoPE's definition)."""
    from kvhal.eviction import ExpectedAttention, expected_queries

    rng = np.random.default_rng(1)
    n, heads, d = 30, 3, 8
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    pos = np.arange(5, 5 + n)

    def rot(p: float) -> np.ndarray:  # transformers' rotate-half: channel i pairs with i + d/2
        r = np.zeros((d, d))
        for i, f in enumerate(inv_freq):
            c, s = np.cos(p * f), np.sin(p * f)
            r[i, i], r[i, i + d // 2], r[i + d // 2, i], r[i + d // 2, i + d // 2] = c, -s, s, c
        return r

    pre = rng.standard_normal((n, heads, d))
    post = np.stack([pre[i] @ rot(p).T * 1.5 for i, p in enumerate(pos)])  # rope_scale 1.5 on cos and sin
    mean, cov = expected_queries(post, pos, inv_freq, 1.5, n_sink=8, n_future=16)
    used = pre[pos >= 8]
    r = np.mean([rot(t) for t in range(pos[-1] + 1, pos[-1] + 17)], axis=0) * 1.5
    want_cov = np.stack([r @ np.cov(used[:, h].T, bias=True) @ r.T for h in range(heads)])
    np.testing.assert_allclose(mean, used.mean(axis=0) @ r.T, atol=1e-12)
    np.testing.assert_allclose(cov, want_cov, atol=1e-12)
    for bad in ((post[:, :, :7], pos, inv_freq), (post, pos[:-1], inv_freq), (post, pos, inv_freq[:2])):
        with pytest.raises(kvhal.SpecError, match="expected_queries takes"):
            expected_queries(*bad)
    with pytest.raises(kvhal.SpecError, match="n_sink"):
        expected_queries(post, pos, inv_freq, n_sink=100)
    # not numbers, positions that are not ints, a rope_scale of 0 (NaN statistics): typed, not raw or accepted
    for bad, what in (
        (("q", pos, inv_freq), "real arrays"),
        ((post, pos + 0.5, inv_freq), "integer positions"),
        ((post, pos.astype(str), inv_freq), "integer positions"),
        ((post, pos, inv_freq, 0.0), "rope_scale"),
        ((post, pos, inv_freq, 10**400), "rope_scale"),
    ):
        with pytest.raises(kvhal.SpecError, match=what):
            expected_queries(*bad)
    bad_kw = ({"n_future": 0}, {"n_sink": -1}, {"covariance": 1}, {"epsilon": -1.0}, {"queries": ((mean,),)})
    for kw in (*bad_kw, {"queries": 1}):  # an int, not pairs: typed, not "not iterable"
        with pytest.raises(kvhal.SpecError):
            ExpectedAttention(**kw)
    c, s, _, _ = filled(20)
    with pytest.raises(kvhal.SpecError, match="query statistics"):
        c.evict(s, ExpectedAttention(), 10)
    for bad in (5, [(mean,)], [("a", "b")]):
        with pytest.raises(kvhal.SpecError, match="ExpectedAttention"):
            ExpectedAttention().with_queries(bad)
    with pytest.raises(kvhal.SpecError, match="takes no query statistics"):
        SinkWindow().with_queries([(mean, cov)])
    # a direct evict with the statistics: every layer's (4 query heads over the cache's 2 KV heads, head_dim 32)
    q = rng.standard_normal((20, 4, 32))
    stats = [expected_queries(q, np.arange(20), 1.0 / 10000 ** (np.arange(0, 32, 2) / 32)) for _ in (0, 1)]
    # statistics for another layer count than the cache's 2: refused (3 raised a raw IndexError, 1 was taken)
    for wrong in (stats[:1], stats * 2):
        for policy in (ExpectedAttention().with_queries(wrong), AdaKV(ExpectedAttention()).with_queries(wrong)):
            with pytest.raises(kvhal.SpecError, match=f"for {len(wrong)} layers but the cache has 2"):
                c.evict(s, policy, 10)
    assert c.seq_len(s) == 20
    # statistics of no heads: refused like any other head count (a raw ValueError from a reshape)
    none = [(np.zeros((0, 32)), np.zeros((0, 32, 32)))] * 2
    for policy in (ExpectedAttention().with_queries(none), AdaKV(ExpectedAttention()).with_queries(none)):
        with pytest.raises(kvhal.SpecError, match="has 0 heads"):
            c.evict(s, policy, 10)
    # a sequence no longer than n_sink: every position is a sink, the first keep_tokens are kept (the softmax over
    # no key raised a raw ValueError)
    c2, s2, _, _ = filled(6)
    assert c2.evict(s2, ExpectedAttention(n_sink=8).with_queries(stats), 3).kept.tolist() == [0, 1, 2]
    c3, s3, _, _ = filled(6)
    res = c3.evict(s3, AdaKV(ExpectedAttention(n_sink=8)).with_queries(stats), 3)
    assert [k.tolist() for layer in res.heads for k in layer] == [[0, 1, 2]] * 4
    res = c.evict(s, ExpectedAttention().with_queries(stats), 10)
    assert len(res.kept) == 10 and res.kept[:4].tolist() == [0, 1, 2, 3] and c.seq_len(s) == 10  # sinks kept


def test_evict_with_a_tail_of_a_sequence_not_stored_at_every_layer():
    """A layer never stored has no f16 tail yet: evict reads it as empty (it raised a raw KeyError)."""
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="f32", v_format="f32", block_size=4, tail=3)
    c = kvhal.KVCache(spec, 64, backend="reference")
    x = np.random.default_rng(0).standard_normal((2, 10, 2, 32)).astype(np.float16).astype(np.float32)
    s, empty = c.new_seq(), c.new_seq()
    c.store(s, 1, x[0], x[1])
    r = c.evict(s, SinkWindow(sinks=2), keep_tokens=6)
    assert r.kept.tolist() == [0, 1, 6, 7, 8, 9] and c.seq_len(s, 0) == 0 and c.seq_len(s, 1) == 6
    for got, want in zip(c.load(s, 1), x):
        np.testing.assert_array_equal(got, want[r.kept])
    assert c.evict(empty, SinkWindow(), keep_tokens=0).kept.size == 0
