"""observe=True on every backend: the attention mass it accumulates equals a float64 softmax transcribed here
over the backend's own ``load`` (the bytes as stored), and the attention it returns is the plain call's.

Backends whose kernel returns the log-sum-exp (``"attention_lse"`` in ``fused``) get the mass from one pass against
it: their own where they fuse ``attention_mass`` too (cpu), else ``backend_util.attention_mass_lse``; the rest take
the float64 host path.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvhal


def f64_mass(cache, seqs, q, q_lens, scale, window, tail, layer=0):
    """Per sequence: ``(all queries, last tail queries)`` mass ``[n_kv_heads, n]``, softmax in float64."""
    out, start = [], 0
    group = q.shape[1] // cache.spec.n_kv_heads
    for s, n_q in zip(seqs, q_lens):
        k, _ = cache.load(s, layer)
        k = np.repeat(np.asarray(cache.backend.to_numpy(k), np.float64), group, axis=1)
        n = k.shape[0]
        qs = q[start : start + n_q].astype(np.float64)
        start += n_q
        sc = np.einsum("qhd,khd->hqk", qs, k) * scale
        pos = n - n_q + np.arange(n_q)[:, None]
        j = np.arange(n)[None]
        vis = (j <= pos) & ((j > pos - window) if window else True)
        sc = np.where(vis[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        per_kv = p.reshape(cache.spec.n_kv_heads, group, n_q, n).sum(1)
        out.append((per_kv.sum(1), per_kv[:, max(0, n_q - tail) :].sum(1)))
    return out


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("fmt,rotation", [("q8_0", None), ("q4_0", "hadamard")])
def test_observed_mass_equals_float64_softmax(backend_info, window, fmt, rotation):
    """``rotation``: the backend scores rotated q against rotated K; the oracle, q against the K load gives back."""
    if fmt not in backend_info.formats:
        pytest.skip(f"{backend_info.name} does not claim {fmt}")
    rng = np.random.default_rng(3)
    spec = kvhal.CacheSpec(
        n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=16, k_rotation=rotation
    )
    cache = kvhal.KVCache(spec, 1024, backend=backend_info.name, observe_window=24)
    plain = kvhal.KVCache(spec, 1024, backend=backend_info.name)
    seqs, pseqs, lens, q_lens = (
        [cache.new_seq(), cache.new_seq()],
        [plain.new_seq(), plain.new_seq()],
        [301, 70],
        [301, 9],
    )
    for s, p, n in zip(seqs, pseqs, lens):
        k = rng.standard_normal((n, 2, 64), dtype=np.float32)
        k[:, :, 3] *= 8
        v = rng.standard_normal((n, 2, 64), dtype=np.float32)
        cache.store(s, 0, k, v)
        plain.store(p, 0, k, v)
    q = rng.standard_normal((sum(q_lens), 6, 64), dtype=np.float32)
    out = cache.attention(0, q, seqs=seqs, q_lens=q_lens, window=window, observe=True)
    want_out = plain.attention(0, q, seqs=pseqs, q_lens=q_lens, window=window)
    np.testing.assert_array_equal(cache.backend.to_numpy(out), plain.backend.to_numpy(want_out))
    want = f64_mass(cache, seqs, q, q_lens, 64**-0.5, window, 24)
    for s, (total, last) in zip(seqs, want):
        rec = cache.seq_table.get(s)
        np.testing.assert_allclose(rec.mass[0], total, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rec.window_mass[0], last, rtol=1e-4, atol=1e-5)
        assert rec.mass[0].sum() == pytest.approx(q_lens[seqs.index(s)] * 6, rel=1e-5)  # each row's weights sum to 1


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("tail", [0, 12])
def test_observed_mass_of_kltq_k_equals_float64_softmax(backend_info, window, tail):
    """kltq K (side data; the pages score q in coefficient space, their log-sum-exp leaves out ``q . mu``): the
    mass of a prefill and a decode query against a float64 softmax over the K ``load`` gives back (``mu + S c'``),
    without and with an f16 tail."""
    fmt = "kltq:4.5"
    rng = np.random.default_rng(4)
    spec = kvhal.CacheSpec(1, 2, 64, k_format=fmt, v_format="q8_0", block_size=16, tail=tail)
    if fmt not in backend_info.formats:  # refused with the error naming the backends that run it
        with pytest.raises(kvhal.UnsupportedError, match="reference"):
            kvhal.KVCache(spec, 256, backend=backend_info.name, observe_window=24)
        return
    cache = kvhal.KVCache(spec, 256, backend=backend_info.name, observe_window=24)
    s = cache.new_seq()
    k = rng.standard_normal((150, 2, 64), dtype=np.float32)
    k[:, :, 3] *= 8
    cache.store(s, 0, k, rng.standard_normal((150, 2, 64), dtype=np.float32))
    q = rng.standard_normal((150, 6, 64), dtype=np.float32)
    total = np.zeros((2, 150))
    for q_len in (150, 1):
        cache.attention(0, q[-q_len:], [s], [q_len], window=window, observe=True)
        [(t, last)] = f64_mass(cache, [s], q[-q_len:], [q_len], 64**-0.5, window, 24)
        total += t
    rec = cache.seq_table.get(s)
    np.testing.assert_allclose(rec.mass[0], total, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rec.window_mass[0], last, rtol=1e-4, atol=1e-5)
    assert rec.mass[0].sum() == pytest.approx(151 * 6, rel=1e-5)  # each row's weights sum to 1
