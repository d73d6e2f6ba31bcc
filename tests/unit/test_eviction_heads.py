"""Per-head eviction (AdaKV): each (layer, KV head) keeps its own positions inside the sequence's shared pages.

The kept sets are checked against an independent transcription of AdaKV's rule (a greedy pick over all heads
with per-head floors and a ceiling), attention after the eviction against float64 attention over only each
head's kept rows, and the pages against the longest head."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvhal
from kvhal.eviction import H2O, AdaKV, EvictOnFull, Knorm, SinkWindow, SnapKV
from tests.oracle import adakv_transcription, attention_f64

SPEC = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="f32", v_format="f32", block_size=4)
N, WIN, GROUP = 64, 8, 2
# the backends that mask per-head holes in their kernels (the rest refuse AdaKV)
MASKING = [i.name for i in kvhal.backends() if i.name in ("reference", "cpu") and i.available]


def prefilled(backend: str, seed: int = 0) -> tuple[kvhal.KVCache, int, np.ndarray, np.ndarray, np.ndarray]:
    c = kvhal.KVCache(SPEC, 256, backend=backend, observe_window=WIN)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, N, 2, 32), dtype=np.float32)
    v = rng.standard_normal((2, N, 2, 32), dtype=np.float32)
    k[:, :, 1] *= 6  # sharper attention in head 1: the heads' budgets differ
    q = rng.standard_normal((N, 4, 32), dtype=np.float32)
    s = c.new_seq()
    for layer in (0, 1):
        c.store(s, layer, k[layer], v[layer])
        c.attention(layer, q, [s], [N], observe=True)
    return c, s, k, v, q


def window_mass(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """[KV heads, N]: the softmax weights the last WIN queries give each key, summed over each KV head's query
    heads (float64, straight from the definition)."""
    out = np.zeros((2, N))
    for i in range(N - WIN, N):
        for h in range(4):
            s = q[i, h].astype(np.float64) @ k[: i + 1, h // GROUP].astype(np.float64).T / math.sqrt(32)
            p = np.exp(s - s.max())
            out[h // GROUP, : i + 1] += p / p.sum()
    return out


@pytest.mark.parametrize("backend", MASKING)
def test_adakv_keeps_each_heads_own_positions_and_masks_the_rest(backend):
    c, s, k, v, q = prefilled(backend)
    blocks = c.stats().blocks_used
    policy = AdaKV(SnapKV(window=WIN, kernel=3), ceiling=1.25, safeguard=0.75)
    res = c.evict(s, policy, keep_tokens=24)
    assert res.heads is not None
    for layer in (0, 1):
        want = adakv_transcription(window_mass(q, k[layer]), N, 24, WIN, 3, 1.25, 0.75)
        assert [h.tolist() for h in res.heads[layer]] == want
    lens = [len(h) for layer in res.heads for h in layer]
    assert len(set(lens)) > 1 and max(lens) <= 30  # budgets differ per head, none above the ceiling
    assert c.seq_len(s) == res.length == max(lens)
    assert c.stats().blocks_used == math.ceil(max(lens) / 4) == blocks - res.blocks_freed
    # new tokens go after the longest head; each head attends its kept rows and the new ones, nothing else
    rng = np.random.default_rng(1)
    k2, v2 = (rng.standard_normal((2, 3, 2, 32), dtype=np.float32) for _ in range(2))
    q2 = rng.standard_normal((3, 4, 32), dtype=np.float32)
    for layer in (0, 1):
        c.store(s, layer, k2[layer], v2[layer])
        for observe in (False, True):
            out = np.asarray(c.attention(layer, q2, [s], [3], observe=observe))
            for h, kept in enumerate(res.heads[layer]):
                kh = np.concatenate([k[layer][kept, h], k2[layer][:, h]])[:, None]
                vh = np.concatenate([v[layer][kept, h], v2[layer][:, h]])[:, None]
                want = attention_f64(q2[:, GROUP * h : GROUP * h + GROUP], [kh], [vh], [3])
                np.testing.assert_allclose(out[:, GROUP * h : GROUP * h + GROUP], want, atol=1e-5)
        hole = c.seq_table.get(s).mass[layer][:, :]  # observed mass: none for a head's dropped rows
        for h, kept in enumerate(res.heads[layer]):
            assert not hole[h, len(kept) : max(lens)].any()
    with pytest.raises(kvhal.UnsupportedError, match="per-head"):
        c.evict(s, SinkWindow(), keep_tokens=8)
    with pytest.raises(kvhal.UnsupportedError, match="per-head"):
        c.seq_rm(s, 0, 1)


def test_adakv_prefill_chunks_split_around_holes_on_cpu():
    """A long prefill and a decode step after a per-head eviction: the cpu kernel cuts each head's range around its
    hole (q8_0: the integer kernels), against the reference backend's float64 masked attention."""
    if "cpu" not in MASKING:
        pytest.skip("the cpu backend is not available here")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=3, head_dim=64, k_format="q8_0", v_format="q8_0", block_size=16)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((700, 3, 64), dtype=np.float32)
    q = rng.standard_normal((700, 9, 64), dtype=np.float32)
    outs = []
    for backend in ("reference", "cpu"):
        c = kvhal.KVCache(spec, 4096, backend=backend, observe_window=16)
        s = c.new_seq()
        c.store(s, 0, k, k[::-1].copy())
        c.attention(0, q, [s], [700], observe=True)
        c.evict(s, AdaKV(H2O(heavy=200, recent=50), ceiling=1.5), keep_tokens=250)
        c.store(s, 0, k[:300], k[:300])
        outs.append(np.asarray(c.attention(0, q[:300], [s], [300])))
        outs.append(np.asarray(c.attention(0, q[:1], [s], [1])))  # a decode step (the split-KV decode kernels)
    np.testing.assert_allclose(outs[2], outs[0], atol=2e-3)
    np.testing.assert_allclose(outs[3], outs[1], atol=2e-3)


def test_adakv_argument_checks():
    with pytest.raises(kvhal.SpecError, match="compare across heads"):
        AdaKV(SinkWindow())
    with pytest.raises(kvhal.SpecError, match="ceiling"):
        AdaKV(SnapKV(), ceiling=0.9)
    with pytest.raises(kvhal.SpecError, match="safeguard"):
        AdaKV(SnapKV(), safeguard=1.5)
    with pytest.raises(kvhal.SpecError, match="ceiling"):
        AdaKV(SnapKV(), ceiling=10**400)  # past float's range: not a raw OverflowError
    with pytest.raises(kvhal.UnsupportedError, match="same positions"):
        EvictOnFull(AdaKV(SnapKV()), 8)
    c, s, *_ = prefilled("reference")
    with pytest.raises(kvhal.SpecError, match="observe_window=32"):
        c.evict(s, AdaKV(SnapKV(window=32)), keep_tokens=24)
    assert c.seq_len(s) == N and not c.seq_table.get(s).holes  # a refused call changes nothing
    # a huge finite ceiling is no ceiling (ceiling * keep overflows to inf): every head may hold every position
    free = c.evict(s, AdaKV(SnapKV(window=WIN), ceiling=1e308), keep_tokens=24)
    c2, s2, *_ = prefilled("reference")
    capped = c2.evict(s2, AdaKV(SnapKV(window=WIN), ceiling=3.0), keep_tokens=24)  # 3 * 24 >= N
    assert [k.tolist() for layer in free.heads for k in layer] == [k.tolist() for layer in capped.heads for k in layer]


def test_knorm_keeps_the_lowest_norm_keys():
    """kvpress's KnormPress: the keys of lowest L2 norm; no attention scores needed (nothing observed here)."""
    c = kvhal.KVCache(SPEC, 256, backend="reference")
    k = np.random.default_rng(4).standard_normal((2, N, 2, 32), dtype=np.float32)
    k *= np.random.default_rng(5).uniform(0.5, 2, (2, N, 2, 1)).astype(np.float32)
    s = c.new_seq()
    for layer in (0, 1):
        c.store(s, layer, k[layer], k[layer])
    norms = np.sqrt((k.astype(np.float64) ** 2).sum(-1))  # [layers, N, heads]
    total = norms.sum(axis=(0, 2))
    assert c.evict(s, Knorm(), keep_tokens=20).kept.tolist() == sorted(sorted(range(N), key=lambda j: total[j])[:20])
    with pytest.raises(kvhal.SpecError, match="compare across heads"):
        AdaKV(Knorm())  # each head's norms have their own scale


@pytest.mark.parametrize("backend", MASKING)
def test_adakv_over_a_transform_codec(backend):
    """kltq keys: reference masks the holes of its coefficient-space attention; cpu's kltq kernel has no holes,
    so it refuses the eviction before changing anything."""
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=32, k_format="kltq:4", v_format="f32", block_size=4)
    c = kvhal.KVCache(spec, 256, backend=backend, observe_window=WIN)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((N, 2, 32), dtype=np.float32)
    k[:, 1] *= 6
    v = rng.standard_normal((N, 2, 32), dtype=np.float32)
    q = rng.standard_normal((N, 4, 32), dtype=np.float32)
    s = c.new_seq()
    c.store(s, 0, k, v)
    c.attention(0, q, [s], [N], observe=True)
    kd, vd = (np.asarray(x) for x in c.load(s, 0))  # the keys as the codec decodes them
    policy = AdaKV(SnapKV(window=WIN, kernel=3), ceiling=1.25, safeguard=0.75)
    if backend == "cpu":
        with pytest.raises(kvhal.UnsupportedError, match="positions per KV head"):
            c.evict(s, policy, keep_tokens=24)
        assert c.seq_len(s) == N
        return
    res = c.evict(s, policy, keep_tokens=24)
    assert res.heads is not None
    out = np.asarray(c.attention(0, q[-2:], [s], [2], causal=False))
    for h, kept in enumerate(res.heads[0]):
        want = attention_f64(q[-2:, GROUP * h : GROUP * h + GROUP], [kd[kept, h][:, None]], [vd[kept, h][:, None]], [2],
                             causal=False)  # fmt: skip
        np.testing.assert_allclose(out[:, GROUP * h : GROUP * h + GROUP], want, atol=1e-5)


@pytest.mark.parametrize("backend", MASKING)
def test_adakv_hole_among_the_f16_sink_rows(backend):
    """A head that keeps fewer rows than the f16 sink page leaves a hole over sink rows too, masked there as in the
    pages and the tail, also after decode steps flush rows into the pages (f16 pages: every value is its f16 rounding;
    float64 attention over each head's own rows)."""
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=32, k_format="f16", v_format="f16", block_size=4,
                           sinks=4, tail=4)  # fmt: skip
    c = kvhal.KVCache(spec, 256, backend=backend, observe_window=WIN)
    rng = np.random.default_rng(6)
    n = 40
    u = rng.standard_normal(32).astype(np.float32)
    k = rng.standard_normal((n, 2, 32), dtype=np.float32) * 0.1
    k[5, 0] = 2 * u  # head 0 attends to key 5 alone (sharp: a small budget), head 1 near uniformly
    v = rng.standard_normal((n, 2, 32), dtype=np.float32)
    q = np.repeat(u[None, None], n, axis=0).repeat(4, axis=1) + rng.standard_normal((n, 4, 32), dtype=np.float32)
    s = c.new_seq()
    c.store(s, 0, k, v)
    c.attention(0, q, [s], [n], observe=True)
    res = c.evict(s, AdaKV(H2O(heavy=8, recent=0), ceiling=1.9, safeguard=0.0), keep_tokens=8)
    assert res.heads is not None
    kept = res.heads[0]
    assert 5 in kept[0] and len(kept[0]) < spec.sink_tokens < res.length  # head 0's hole starts among the sinks
    f16 = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
    new_k, new_v = (rng.standard_normal((6, 2, 32), dtype=np.float32) for _ in range(2))
    for step in range(2):
        if step:
            c.store(s, 0, new_k, new_v)  # flushes the tail's rows (hole rows of head 0 among them) into pages
        n_q = 2 if step else 1
        qd = rng.standard_normal((n_q, 4, 32), dtype=np.float32)
        out = np.asarray(kvhal.to_numpy(c.attention(0, qd, [s], [n_q])))
        for h, rows in enumerate(kept):
            kh, vh = k[rows, h], v[rows, h]
            if step:
                kh, vh = np.r_[kh, new_k[:, h]], np.r_[vh, new_v[:, h]]
            want = attention_f64(qd[:, GROUP * h : GROUP * h + GROUP], [f16(kh)[:, None]], [f16(vh)[:, None]], [n_q])
            np.testing.assert_allclose(out[:, GROUP * h : GROUP * h + GROUP], want, atol=1e-5)
