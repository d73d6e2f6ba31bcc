"""The contract every backend meets, checked against the reference backend and float64 oracles.

Parametrized over every available backend (``KVHAL_TEST_BACKENDS`` narrows it). For each format a
backend claims: its pools are byte-identical to the reference's, load equals the reference
dequantization, attention matches float64 attention on the dequantized K/V within the backend's
declared ``attention_tolerance``, and sequence operations leave identical pools.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal import formats
from tests.oracle import attention_f64

ALL_FORMATS = formats.names()


def make_cache(name: str, fmt_k: str, fmt_v: str | None = None, *, layers: int = 1, heads: int = 2,
               dim: int = 64, bs: int = 16, cap: int = 512) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(n_layers=layers, n_kv_heads=heads, head_dim=dim, k_format=fmt_k,
                           v_format=fmt_v or fmt_k, block_size=bs)
    return kvhal.KVCache(spec, cap, backend=name)


def pool_bytes(cache: kvhal.KVCache, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    n = cache.n_blocks
    p = cache.pools[layer]
    k = np.asarray(cache.backend.to_numpy(p.k)).view(np.uint8).reshape(cache.spec.pool_shape(n, "k"))
    v = np.asarray(cache.backend.to_numpy(p.v)).view(np.uint8).reshape(cache.spec.pool_shape(n, "v"))
    return k, v


def kv(rng: np.random.Generator, n: int, heads: int = 2, dim: int = 64) -> tuple[np.ndarray, np.ndarray]:
    k = rng.standard_normal((n, heads, dim), dtype=np.float32)
    v = rng.standard_normal((n, heads, dim), dtype=np.float32)
    k[:, :, 3] *= 8  # an outlier channel, as real keys have
    return k, v


def claimed(info: kvhal.BackendInfo) -> list[str]:
    return [f for f in ALL_FORMATS if all(info.supports(f, op) for op in ("store", "load", "attention"))]


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_claims_at_least_f16(backend_info: kvhal.BackendInfo) -> None:
    assert "f16" in claimed(backend_info)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_store_load_bytes_match_reference(backend_info, fmt, rng):
    if fmt not in claimed(backend_info):
        with pytest.raises(kvhal.UnsupportedError):
            make_cache(backend_info.name, fmt)
        return
    k, v = kv(rng, 37)
    caches = [make_cache(backend_info.name, fmt, bs=16), make_cache("reference", fmt, bs=16)]
    for c in caches:
        s = c.new_seq()
        c.store(s, 0, k[:1], v[:1])  # decode-sized store
        c.store(s, 0, k[1:], v[1:])  # prefill-sized store across page boundaries
    got, want = pool_bytes(caches[0]), pool_bytes(caches[1])
    np.testing.assert_array_equal(got[0], want[0], err_msg="K pool bytes differ from the reference")
    np.testing.assert_array_equal(got[1], want[1], err_msg="V pool bytes differ from the reference")
    f = formats.get(fmt)
    k2, v2 = (kvhal.to_numpy(x) for x in caches[0].load(0, 0))
    np.testing.assert_allclose(k2, f.dequantize(f.quantize(k)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v2, f.dequantize(f.quantize(v)), rtol=1e-6, atol=1e-6)
    k3, _ = (kvhal.to_numpy(x) for x in caches[0].load(0, 0, 5, 21))
    np.testing.assert_allclose(k3, k2[5:21], rtol=0, atol=0)


def adversarial_rows(rng: np.random.Generator, dim: int = 64) -> np.ndarray:
    """Rows [n, 2 heads, dim] that hit every rounding and sign rule of the ggml quantizers."""
    def tile(values: np.ndarray) -> np.ndarray:
        return np.resize(np.asarray(values, np.float32), dim)

    rows = [
        tile(np.r_[-0.0, np.zeros(31)]), tile(np.full(32, -0.0)),  # signed zeros
        tile(np.r_[-0.0, 0.0, rng.uniform(0.1, 1, 30)]), tile(np.r_[rng.uniform(-1, -0.1, 30), 0.0, -0.0]),
        tile(np.r_[2.0, -2.0, rng.uniform(-1, 1, 30)]), tile(np.r_[-2.0, 2.0, rng.uniform(-1, 1, 30)]),  # ties
        tile((np.arange(32) - 15.5) / 4), tile(np.arange(32) * 0.5 - 8),  # grid points and exact halves
        tile(np.r_[127.0, 0.49999997, -0.49999997, 0.5, -0.5, 1.5, -2.5, 126.5, np.zeros(24)]),  # roundf edges
        tile(np.r_[rng.standard_normal(31) * 1e-3, 600.0]), tile(rng.uniform(-65000, 65000, 32)),  # range
        tile(np.r_[np.full(16, 1e-41), np.full(16, -1e-42)]), tile(rng.standard_normal(32) * 1e-30),  # tiny
        tile(np.full(32, 3.0)), tile(np.full(32, -3.0)),  # constant blocks
    ]
    x = np.stack(rows)
    return np.stack([x, x[::-1]], axis=1).astype(np.float32)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_adversarial_bytes_match_reference(backend_info, fmt, rng):
    if fmt not in claimed(backend_info):
        pytest.skip(f"{backend_info.name} does not claim {fmt}")
    x = adversarial_rows(rng)
    caches = [make_cache(backend_info.name, fmt), make_cache("reference", fmt)]
    for c in caches:
        c.store(c.new_seq(), 0, x, x[::-1].copy())
    for got, want, which in zip(pool_bytes(caches[0]), pool_bytes(caches[1]), "KV"):
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{which} pool differs from the reference at [block, head, slot, byte] {bad[:5].tolist()}"


def test_mixed_k_v_formats(backend_info, rng):
    fmts = claimed(backend_info)
    fk, fv = fmts[-1], fmts[0]
    k, v = kv(rng, 20)
    a, b = make_cache(backend_info.name, fk, fv), make_cache("reference", fk, fv)
    for c in (a, b):
        c.store(c.new_seq(), 0, k, v)
    for x, y in zip(pool_bytes(a), pool_bytes(b)):
        np.testing.assert_array_equal(x, y)


CASES = {
    # name: (n_heads, n_kv_heads, dim, seq lens, q lens, causal, window)
    "decode": (4, 2, 64, [40], [1], True, None),
    "decode-batch-ragged": (8, 2, 64, [1, 17, 70], [1, 1, 1], True, None),
    "prefill-causal": (4, 2, 64, [33], [33], True, None),
    "chunked-prefill-mixed": (4, 4, 64, [50, 9, 16], [10, 1, 16], True, None),
    "mqa-dim128": (8, 1, 128, [45], [3], True, None),
    "window": (4, 2, 64, [60, 20], [4, 2], True, 7),
    "non-causal": (4, 2, 64, [25], [5], False, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_attention_matches_float64(backend_info, fmt, case, rng):
    if fmt not in claimed(backend_info):
        pytest.skip(f"{backend_info.name} does not claim {fmt}")
    n_heads, n_kv, dim, lens, q_lens, causal, window = CASES[case]
    cache = make_cache(backend_info.name, fmt, heads=n_kv, dim=dim, cap=sum(lens) + 64)
    f = formats.get(fmt)
    seqs, ks, vs = [], [], []
    for n in lens:
        k, v = kv(rng, n, n_kv, dim)
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        seqs.append(s)
        ks.append(f.dequantize(f.quantize(k)))
        vs.append(f.dequantize(f.quantize(v)))
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
    out = kvhal.to_numpy(cache.attention(0, q, seqs, q_lens, causal=causal, window=window))
    want = attention_f64(q, ks, vs, q_lens, causal=causal, window=window)
    assert out.shape == q.shape and out.dtype == np.float32
    err = float(np.abs(out - want).max())
    assert err <= cache.backend.attention_tolerance, f"max error {err:.3g} > {cache.backend.attention_tolerance}"


def test_attention_scale_and_long_context(backend_info, rng):
    fmt = "q8_0" if "q8_0" in claimed(backend_info) else "f16"
    cache = make_cache(backend_info.name, fmt, heads=2, dim=64, cap=4096)
    k, v = kv(rng, 3000)
    s = cache.new_seq()
    cache.store(s, 0, k, v)
    f = formats.get(fmt)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    out = kvhal.to_numpy(cache.attention(0, q, [s], [1], scale=0.3))
    want = attention_f64(q, [f.dequantize(f.quantize(k))], [f.dequantize(f.quantize(v))], [1], scale=0.3)
    assert float(np.abs(out - want).max()) <= cache.backend.attention_tolerance


def test_sequence_ops_match_reference(backend_info, rng):
    """Shared pages, copy-on-write, middle removal and unaligned copies leave reference-identical pools."""
    fmt = claimed(backend_info)[-1]
    k, v = kv(rng, 120)
    caches = [make_cache(backend_info.name, fmt, layers=2, bs=8, cap=256),
              make_cache("reference", fmt, layers=2, bs=8, cap=256)]
    for c in caches:
        a = c.new_seq()
        for layer in (0, 1):
            c.store(a, layer, k[:30], v[:30])
        b = c.seq_cp(a, 0, 21)  # shares pages 0..2, page 2 partly
        for layer in (0, 1):
            c.store(b, layer, k[30:40], v[30:40])  # copy-on-write of page 2
        t = c.seq_cp(a, 5, 27)  # unaligned: copied rows
        c.seq_rm(a, 3, 11)  # middle removal shifts the rest down
        c.store(a, 0, k[40:44], v[40:44])
        c.seq_rm(t, 10, -1)
        c.store(t, 1, k[50:53], v[50:53])
    for layer in (0, 1):
        for x, y in zip(pool_bytes(caches[0], layer), pool_bytes(caches[1], layer)):
            np.testing.assert_array_equal(x, y)
    for sid in caches[1].seqs:
        for layer in (0, 1):
            got = kvhal.to_numpy(caches[0].load(sid, layer)[0])
            want = kvhal.to_numpy(caches[1].load(sid, layer)[0])
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    same = {"backend": "", "bytes_allocated": 0}  # backends may pad their allocations
    assert caches[0].stats().as_dict() | same == caches[1].stats().as_dict() | same


def test_typed_errors_and_atomic_store(backend_info, rng):
    fmt = claimed(backend_info)[-1]
    cache = make_cache(backend_info.name, fmt, cap=32)
    s = cache.new_seq()
    k, v = kv(rng, 20)
    cache.store(s, 0, k, v)
    before = [x.copy() for x in pool_bytes(cache)], cache.stats()
    bad = k.copy()
    bad[3, 1, 7] = np.nan
    with pytest.raises(kvhal.NonFiniteError):
        cache.store(s, 0, bad[:4], v[:4])
    with pytest.raises(kvhal.DTypeError):
        cache.store(s, 0, k[:4].astype(np.float64), v[:4])
    with pytest.raises(kvhal.ShapeError):
        cache.store(s, 0, k[:4, :1], v[:4, :1])
    with pytest.raises(kvhal.CapacityError):
        cache.store(s, 0, *kv(rng, 13))  # 33 tokens > 32
    with pytest.raises(kvhal.SequenceError):
        cache.store(s + 100, 0, k[:1], v[:1])
    with pytest.raises(kvhal.PositionError):
        cache.attention(0, rng.standard_normal((21, 2, 64), dtype=np.float32), [s], [21])
    after = pool_bytes(cache), cache.stats()
    for x, y in zip(before[0], after[0]):
        np.testing.assert_array_equal(x, y)
    assert before[1] == after[1]
    assert kvhal.to_numpy(cache.load(s, 0)[0]).shape == (20, 2, 64)
