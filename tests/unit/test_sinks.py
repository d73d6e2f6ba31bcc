"""CacheSpec(sinks=N): each sequence's first N tokens (whole pages) kept in f16 and attended in f16, against
float64 attention over what the cache loads, with the f16 rows checked bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal.errors import SpecError, UnsupportedError
from kvhal.formats.ggml import round_f16


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    n, nq = len(k), len(q)
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k.astype(np.float64), g, 1), np.repeat(v.astype(np.float64), g, 1)
    sc = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * scale
    if causal:
        sc = np.where((np.arange(n)[None] <= np.arange(n - nq, n)[:, None])[None], sc, -np.inf)
    sc -= sc.max(-1, keepdims=True)
    p = np.exp(sc)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("sinks", [1, 5, 8, 12])
@pytest.mark.parametrize("tail", [0, 8])
@pytest.mark.parametrize("chunks", [[40], [3, 1, 30, 7], [1] * 20])
@pytest.mark.parametrize("causal", [True, False])
def test_sinks_attend_in_f16_as_loaded(sinks, tail, chunks, causal):
    rng = np.random.default_rng(sinks + 10 * tail + len(chunks))
    spec = kvhal.CacheSpec(1, 2, 32, "q4_0", "q4_0", block_size=8, sinks=sinks, tail=tail)
    assert spec.sink_tokens == -(-sinks // 8) * 8 and spec.uses_tail
    cache = kvhal.KVCache(spec, 128, backend="reference")
    s = cache.new_seq()
    n = sum(chunks)
    k = rng.standard_normal((n, 2, 32)).astype(np.float32)
    v = rng.standard_normal((n, 2, 32)).astype(np.float32)
    k[0] *= 30  # an attention sink
    t = 0
    for m in chunks:
        cache.store(s, 0, k[t : t + m], v[t : t + m])
        t += m
        kd, vd = cache.load(s, 0)
        f16 = min(spec.sink_tokens, t)
        assert np.array_equal(kd[:f16], round_f16(k[:f16])) and np.array_equal(vd[:f16], round_f16(v[:f16]))
        q = rng.standard_normal((m, 4, 32)).astype(np.float32)
        out = np.asarray(cache.attention(0, q, [s], causal=causal))
        assert np.abs(out - oracle(q, kd, vd, 32**-0.5, causal)).max() < 1e-5
    assert np.array_equal(cache.load(s, 0, 2, 9)[0], cache.load(s, 0)[0][2:9])


def test_sinks_lower_the_error_of_a_large_first_key():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((64, 1, 32)).astype(np.float32)
    k[0] = 40 * np.abs(k[0])
    v = rng.standard_normal((64, 1, 32)).astype(np.float32)
    q = (k[:1] / 4 + rng.standard_normal((64, 1, 32))).astype(np.float32)
    errs = []
    for sinks in (0, 1):
        cache = kvhal.KVCache(kvhal.CacheSpec(1, 1, 32, "q4_0", "q4_0", sinks=sinks), 64, backend="reference")
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        errs.append(np.abs(np.asarray(cache.attention(0, q, [s])) - oracle(q, k, v, 32**-0.5, True)).mean())
    assert errs[1] < errs[0]


def test_sinks_in_snapshots_fingerprints_and_forks(tmp_path):
    rng = np.random.default_rng(2)
    spec = kvhal.CacheSpec(2, 2, 32, "q4_0", "q8_0", block_size=8, sinks=3, tail=4)
    cache = kvhal.KVCache(spec, 128, backend="reference")
    s = cache.new_seq()
    for layer in range(2):
        kv = rng.standard_normal((2, 30, 2, 32)).astype(np.float32)
        cache.store(s, layer, kv[0], kv[1])
    path = tmp_path / "s.kvs"
    cache.save(path)
    again = kvhal.KVCache(spec, 128, backend="reference")
    [t] = again.restore(path)
    for layer in range(2):
        assert all(np.array_equal(a, b) for a, b in zip(cache.load(s, layer), again.load(t, layer)))
    other = kvhal.KVCache(kvhal.CacheSpec(2, 2, 32, "q4_0", "q8_0", block_size=8, tail=4), 128, backend="reference")
    with pytest.raises(kvhal.KVHalError):
        other.restore(path)
    fork = cache.seq_cp(s)
    assert np.array_equal(cache.load(fork, 1)[0], cache.load(s, 1)[0])
    cache.seq_rm(s, 28)
    assert cache.seq_len(s) == 28
    # specs without sinks keep their fingerprints
    fp = kvhal.Fingerprint("m")
    assert fp.digest(kvhal.CacheSpec(1, 1, 32)) == fp.digest(kvhal.CacheSpec(1, 1, 32, sinks=0))
    assert fp.digest(kvhal.CacheSpec(1, 1, 32)) != fp.digest(kvhal.CacheSpec(1, 1, 32, sinks=1))


def test_sinks_are_validated_and_refuse_a_window():
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(SpecError, match="sinks"):
            kvhal.CacheSpec(1, 1, 32, sinks=bad)  # type: ignore[arg-type]
    cache = kvhal.KVCache(kvhal.CacheSpec(1, 1, 32, "q4_0", "q4_0", sinks=1), 64, backend="reference")
    s = cache.new_seq()
    cache.store(s, 0, np.ones((20, 1, 32), np.float32), np.ones((20, 1, 32), np.float32))
    with pytest.raises(UnsupportedError, match="sinks"):
        cache.attention(0, np.ones((1, 1, 32), np.float32), [s], window=4)
