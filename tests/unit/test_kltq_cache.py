"""kltq in the registry and the cache: names and sizes, the spec's side data, calibration on a layer's first
store against the numpy spec (kvhal.formats.kltq), fingerprints and snapshots naming the side data, typed
refusals. Backends' store/load/attention are in tests/contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvhal
from kvhal import CacheSpec, KVCache, formats
from kvhal.errors import FormatError, ShapeError, SpecError, UnsupportedError
from kvhal.formats import kltq
from tests.oracle import attention_f64


def keys(seed: int, n: int = 48, layers: int = 2, heads: int = 2, d: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d)) * np.exp(-np.arange(d) / 8)
    return [(rng.standard_normal((n, heads, d)) @ mix.T).astype(np.float32) for _ in range(layers)]


def spec(**kw) -> CacheSpec:
    return CacheSpec(**{"n_layers": 2, "n_kv_heads": 2, "head_dim": 32, "k_format": "kltq:4.5", "v_format": "q8_0",
                        **kw})  # fmt: skip


def filled(seed: int, **kw) -> tuple[KVCache, int, list[np.ndarray]]:
    c = KVCache(spec(**kw), 128, backend="reference")
    s = c.new_seq()
    ks = keys(seed)
    for layer, k in enumerate(ks):
        c.store(s, layer, k, k[::-1].copy())
    return c, s, ks


def test_every_budget_is_a_registered_name_with_its_bits():
    for name in kltq.names():
        f = formats.get(name)
        assert name in formats.names() and name not in formats.plain_names() and f.side_data
        assert f.bits_per_element == kltq.parse_name(name)
        assert f.row_bytes(64) == kltq.row_bytes(kltq.parse_name(name), 64)
        with pytest.raises(FormatError, match="side data"):
            f.quantize(np.zeros((1, 64), np.float32))


def test_first_store_calibrates_each_layer_as_the_spec_does():
    c, s, ks = filled(1)
    side = c.resolved_spec.k_side
    assert side.digest() == kltq.calibrate(ks, 4.5).digest()
    for layer, k in enumerate(ks):
        rows, _ = c.load_rows(s, layer)
        np.testing.assert_array_equal(rows, kltq.quantize(side, layer, k))
        np.testing.assert_array_equal(kvhal.to_numpy(c.load(s, layer)[0]), kltq.dequantize(side, layer, rows))


def test_side_data_given_in_the_spec_or_a_file_is_used_as_is(tmp_path):
    side = kltq.calibrate(keys(2), 4.5)
    side.save(tmp_path / "side.npz")
    for side_arg in (side, str(tmp_path / "side.npz")):
        c = KVCache(spec(k_side=side_arg), 64, backend="reference")
        s = c.new_seq()
        k = keys(3)[0]
        c.store(s, 0, k[:1], k[:1])  # one token: nothing to calibrate
        assert c.resolved_spec.k_side.digest() == side.digest()
        np.testing.assert_array_equal(c.load_rows(s, 0)[0], kltq.quantize(side, 0, k[:1]))


@pytest.mark.parametrize("backend", [b.name for b in kvhal.backends() if b.available and "kltq:4.5" in b.formats])
def test_side_data_in_wider_dtypes_stores_what_its_digest_names(backend):
    """A Side built from float64/int64 arrays (the same digest) stores the same records on every backend: the cpu
    backend read such buffers as f32/u8. Its arrays are the Side's own read-only copies: a later write to the
    caller's arrays changes nothing the cache reads."""
    side = kltq.calibrate(keys(2), 4.5)
    fields = ("mean", "analysis", "synthesis", "sigma", "alloc", "codebooks")
    wide = {f: getattr(side, f).astype(np.int64 if f == "alloc" else np.float64) for f in fields}
    s64 = kltq.Side(side.bits, side.weighted, **wide)
    assert s64.digest() == side.digest()
    k = keys(3)[0]
    c = KVCache(spec(k_side=s64), 64, backend=backend)
    s = c.new_seq()
    wide["mean"][:] = 100.0  # after the Side was made
    c.store(s, 0, k, k)
    np.testing.assert_array_equal(c.load_rows(s, 0)[0], kltq.quantize(side, 0, k))
    with pytest.raises(ValueError, match="read-only"):
        s64.mean[0, 0, 0] = 1.0


def test_spec_refusals_are_typed():
    side = kltq.calibrate(keys(2), 4.5)
    with pytest.raises(SpecError, match="v_side"):
        spec(v_side=side)  # V is q8_0
    with pytest.raises(SpecError, match="v_rotation"):
        spec(v_format="kltq:4.5", v_rotation="hadamard")
    with pytest.raises(SpecError, match="v_scale"):
        spec(v_format="kltq:4.5", v_scale=2.0)
    with pytest.raises(SpecError, match="v_side.*shape"):
        spec(v_format="kltq:5", v_side=side)
    with pytest.raises(SpecError, match="v_side.*Side"):
        spec(v_format="kltq:4.5", v_side=[side])
    with pytest.raises(SpecError, match="k_side"):
        spec(k_format="q8_0", k_side=side)
    with pytest.raises(SpecError, match="k_rotation"):
        spec(k_rotation="hadamard")
    with pytest.raises(SpecError, match="shape"):
        spec(k_format="kltq:5", k_side=side)  # another budget
    with pytest.raises(SpecError, match="shape"):
        spec(n_layers=3, k_side=side)
    with pytest.raises(SpecError, match="Side"):
        spec(k_side=3)


def test_a_first_store_too_short_to_calibrate_changes_nothing():
    c = KVCache(spec(), 64, backend="reference")
    s = c.new_seq()
    k = keys(4)[0]
    with pytest.raises(ShapeError, match="prefill"):
        c.store(s, 0, k[:1], k[:1])
    assert c.seq_len(s) == 0 and c.codec.sides == [None, None] and c.resolved_spec.k_side is None


@pytest.mark.parametrize("formats_kv", [("kltq:4", "f16"), ("f16", "kltq:4")])
def test_loading_a_layer_before_its_first_store_is_empty(formats_kv):
    """A layer with no side data yet holds no rows: load returns them (none), it does not ask for side data."""
    c = KVCache(spec(k_format=formats_kv[0], v_format=formats_kv[1]), 64, backend="reference")
    s = c.new_seq()
    k = keys(5)[0]
    c.store(s, 0, k, k)
    for kw in ({}, {"dtype": "float16"}):
        got = [kvhal.to_numpy(x) for x in c.load(s, 1, **kw)]
        assert [x.shape for x in got] == [(0, 2, 32)] * 2
    out = (np.empty((0, 2, 32), np.float32), np.empty((0, 2, 32), np.float32))
    got = c.load(s, 1, out=out)
    assert got[0] is out[0] and got[1] is out[1]


def test_the_fingerprint_and_snapshots_name_the_side_data(tmp_path):
    a, s, _ = filled(5)
    b, _, _ = filled(6)
    assert a.root_hash != b.root_hash  # same spec, other side data
    path = tmp_path / "a.kvs"
    a.save(path)
    with pytest.raises(kvhal.errors.FingerprintMismatchError):
        b.restore(path)
    fresh = KVCache(spec(), 128, backend="reference")  # not calibrated yet: takes the snapshot's side data
    (got,) = fresh.restore(path)
    assert fresh.root_hash == a.root_hash
    np.testing.assert_array_equal(kvhal.to_numpy(fresh.load(got, 1)[0]), kvhal.to_numpy(a.load(s, 1)[0]))
    c, ids = KVCache.from_snapshot(path, "reference")
    assert c.resolved_spec.k_side.digest() == a.resolved_spec.k_side.digest() and c.root_hash == a.root_hash
    for layer in range(2):
        np.testing.assert_array_equal(kvhal.to_numpy(c.load(ids[0], layer)[0]), kvhal.to_numpy(a.load(s, layer)[0]))


def test_a_backend_without_kltq_refuses_naming_those_that_run_it():
    class Plain(kvhal.reference.ReferenceBackend):
        name = "plain"
        formats = frozenset(formats.plain_names())

    with pytest.raises(UnsupportedError, match="reference"):
        KVCache(spec(), 64, backend=Plain())


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(kltq.names()),
    heads=st.integers(1, 3),
    dim=st.sampled_from([16, 32, 48]),
    n=st.integers(3, 40),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from([b.name for b in kvhal.backends() if b.available and "kltq:4.5" in b.formats]),
)
def test_any_budget_and_shape_stores_the_numpy_spec(name, heads, dim, n, seed, backend):
    """Property: on every backend that runs kltq, a cache's records are the numpy spec's (kltq.quantize with
    the side data kltq.calibrate gives for the same first store) and load is their synthesis."""
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((n, heads, dim)) * np.exp(-np.arange(dim) / 6)).astype(np.float32)
    c = KVCache(CacheSpec(1, heads, dim, k_format=name, v_format="f16"), 64, backend=backend)
    s = c.new_seq()
    c.store(s, 0, k, k)
    side = c.resolved_spec.k_side
    assert side.digest() == kltq.calibrate([k], kltq.parse_name(name)).digest()
    rows, _ = c.load_rows(s, 0)
    np.testing.assert_array_equal(rows, kltq.quantize(side, 0, k))
    np.testing.assert_allclose(kvhal.to_numpy(c.load(s, 0)[0]), kltq.dequantize(side, 0, rows), atol=1e-5)


# -- kltq V ---------------------------------------------------------------------------------------------


def values(seed: int, n: int = 48, layers: int = 2, heads: int = 2, d: int = 32) -> list[np.ndarray]:
    """Values with a decaying spectrum and a mean away from 0 (what mean removal and the basis are for)."""
    return [x + 2.0 for x in keys(seed + 1000, n, layers, heads, d)]


def test_v_first_store_calibrates_as_the_spec_and_load_is_its_synthesis():
    for k_format, sinks in (("kltq:4.5", 0), ("q8_0", 16)):
        c = KVCache(spec(k_format=k_format, v_format="kltq:3.5", sinks=sinks), 128, backend="reference")
        s = c.new_seq()
        ks, vs = keys(7), values(7)
        for layer in range(2):
            c.store(s, layer, ks[layer], vs[layer])
        side = c.resolved_spec.v_side
        assert side.digest() == kltq.calibrate(vs, 3.5, skip=c.spec.sink_tokens).digest() and not side.weighted
        for layer in range(2):
            v = kvhal.to_numpy(c.load(s, layer)[1])
            stored = vs[layer].astype(np.float16).astype(np.float32) if sinks else vs[layer]  # an f16 tail rounds
            want = kltq.dequantize(side, layer, kltq.quantize(side, layer, stored))
            if sinks:  # sink rows are f16
                np.testing.assert_array_equal(v[:16], vs[layer][:16].astype(np.float16))
                np.testing.assert_array_equal(v[16:32], want[16:32])
            else:
                np.testing.assert_array_equal(c.load_rows(s, layer)[1], kltq.quantize(side, layer, vs[layer]))
                np.testing.assert_array_equal(v, want)


def test_v_given_side_data_is_used_and_a_short_first_store_changes_nothing(tmp_path):
    side = kltq.calibrate(values(3), 4.5)
    side.save(tmp_path / "v.npz")
    c = KVCache(spec(k_format="q8_0", v_format="kltq:4.5", v_side=str(tmp_path / "v.npz")), 64, backend="reference")
    s = c.new_seq()
    v = values(4)[0]
    c.store(s, 0, v[:1], v[:1])  # one token: nothing to calibrate
    np.testing.assert_array_equal(c.load_rows(s, 0)[1], kltq.quantize(side, 0, v[:1]))
    c = KVCache(spec(k_format="q8_0", v_format="kltq:4.5"), 64, backend="reference")
    s = c.new_seq()
    with pytest.raises(ShapeError, match="v_side"):
        c.store(s, 0, v[:1], v[:1])
    assert c.seq_len(s) == 0 and c.codec.v_sides == [None, None] and c.resolved_spec.v_side is None


def test_v_snapshot_carries_the_side_data_and_refuses_other_side_data(tmp_path):
    def cache(seed: int | None) -> tuple[KVCache, int]:
        c = KVCache(spec(v_format="kltq:4.5"), 128, backend="reference")
        s = c.new_seq()
        if seed is not None:
            for layer, (k, v) in enumerate(zip(keys(seed), values(seed))):
                c.store(s, layer, k, v)
        return c, s

    a, s = cache(8)
    path = tmp_path / "a.kvs"
    a.save(path)
    b, _ = cache(9)
    assert a.root_hash != b.root_hash
    with pytest.raises(kvhal.errors.FingerprintMismatchError):
        b.restore(path)
    # same K side data, other V side data: refused too
    other_v = KVCache(spec(v_format="kltq:4.5", k_side=a.resolved_spec.k_side), 128, backend="reference")
    o = other_v.new_seq()
    for layer, (k, v) in enumerate(zip(keys(8), values(9))):
        other_v.store(o, layer, k, v)
    with pytest.raises(kvhal.errors.FingerprintMismatchError):
        other_v.restore(path)
    fresh, _ = cache(None)  # not calibrated yet: takes the snapshot's side data, K and V
    (got,) = fresh.restore(path)
    assert fresh.root_hash == a.root_hash
    assert fresh.resolved_spec.v_side.digest() == a.resolved_spec.v_side.digest()
    q = np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(kvhal.to_numpy(fresh.load(got, layer)[1]), kvhal.to_numpy(a.load(s, layer)[1]))
        np.testing.assert_array_equal(
            kvhal.to_numpy(fresh.attention(layer, q, [got], [2])), kvhal.to_numpy(a.attention(layer, q, [s], [2]))
        )
    c, ids = KVCache.from_snapshot(path, "reference")
    assert c.resolved_spec.v_side.digest() == a.resolved_spec.v_side.digest() and c.root_hash == a.root_hash


def test_a_backend_without_kltq_v_refuses_naming_those_that_run_it():
    class Plain(kvhal.reference.ReferenceBackend):
        name = "plain"
        formats = frozenset(formats.plain_names())

    with pytest.raises(UnsupportedError, match="reference"):
        KVCache(spec(k_format="q8_0", v_format="kltq:4.5"), 64, backend=Plain())


@pytest.mark.parametrize("backend", [b.name for b in kvhal.backends() if b.available and "kltq:4.5" in b.formats])
@settings(max_examples=8, deadline=None)
@given(
    k_format=st.sampled_from(["kltq:4.5", "q8_0", "f16"]),
    v_format=st.sampled_from(["kltq:3", "kltq:4.5", "kltq:6"]),
    heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    sinks=st.sampled_from([0, 4]),
    tail=st.sampled_from([0, 5]),
    seed=st.integers(0, 2**16),
)
def test_v_attention_is_float64_attention_over_the_decoded_values(
    k_format, v_format, heads, group, sinks, tail, seed, backend
):
    """Property: with kltq V (any K format; f16 sinks and tail, GQA, a batch of two sequences), attention is
    float64 attention over what load returns (mean + S c' for the pages, the f16 rows as stored), within the
    backend's tolerance: the pages' output over V's coefficients mapped back before the f16 rows are merged.
    Without f16 rows, the stored V records are the numpy spec's, byte for byte."""
    rng = np.random.default_rng(seed)
    d, bs = 32, 4
    sp = CacheSpec(1, heads, d, k_format=k_format, v_format=v_format, block_size=bs, sinks=sinks, tail=tail)
    c = KVCache(sp, 128, backend=backend)
    mix = rng.standard_normal((d, d)) * np.exp(-np.arange(d) / 6)
    seqs, ks, vs, q_lens, given_v = [], [], [], [], []
    for n, n_q in ((int(rng.integers(12, 30)), 1), (int(rng.integers(12, 30)), 3)):
        k = (rng.standard_normal((n, heads, d)) @ mix.T).astype(np.float32)
        v = (rng.standard_normal((n, heads, d)) @ mix.T + 1.5).astype(np.float32)
        s = c.new_seq()
        c.store(s, 0, k[: n - 2], v[: n - 2])
        c.store(s, 0, k[n - 2 :], v[n - 2 :])
        kl, vl = (kvhal.to_numpy(x) for x in c.load(s, 0))
        seqs.append(s), ks.append(kl), vs.append(vl), q_lens.append(n_q), given_v.append(v)
    side = c.resolved_spec.v_side
    if not (sinks or tail):  # the pages hold every row: the spec's records, load their synthesis
        for s, v, v_in in zip(seqs, vs, given_v):
            rows = c.load_rows(s, 0)[1]
            np.testing.assert_array_equal(rows, kltq.quantize(side, 0, v_in))
            np.testing.assert_allclose(v, kltq.dequantize(side, 0, rows), atol=1e-5)
    q = rng.standard_normal((sum(q_lens), heads * group, d)).astype(np.float32)
    got = kvhal.to_numpy(c.attention(0, q, seqs, q_lens))
    want = attention_f64(q, ks, vs, q_lens)
    assert float(np.abs(got - want).max()) <= c.backend.tolerance(max(q_lens)) * (1 + np.abs(want).max()) + 1e-5


@pytest.mark.parametrize("k_format", ["kltq:4.5", "q8_0"])
def test_v_observe_and_streamed_attention_match_resident_attention(k_format):
    """observe=True (float64 over load, V's coefficients weighted) and attention over an offloaded sequence
    (arena parts merged in coefficient space, mapped back once) give the resident kernel's output."""
    c = KVCache(spec(n_layers=1, k_format=k_format, v_format="kltq:4.5"), 128, backend="reference",
                stream_arena_tokens=32)  # fmt: skip
    s = c.new_seq()
    k, v = keys(10, n=70, layers=1)[0], values(10, n=70, layers=1)[0]
    c.store(s, 0, k, v)
    q = np.random.default_rng(1).standard_normal((1, 4, 32)).astype(np.float32)
    resident = kvhal.to_numpy(c.attention(0, q, [s], [1]))
    kl, vl = (kvhal.to_numpy(x) for x in c.load(s, 0))
    np.testing.assert_allclose(resident, attention_f64(q, [kl], [vl], [1]), atol=1e-5)
    np.testing.assert_allclose(kvhal.to_numpy(c.attention(0, q, [s], [1], observe=True)), resident, atol=1e-5)
    c.offload(s, keep_tokens=16)
    np.testing.assert_allclose(kvhal.to_numpy(c.attention(0, q, [s], [1])), resident, atol=1e-5)


def test_adopt_side_takes_matching_side_data_before_any_store_only():
    """``adopt_side`` (what a restore into a fresh kltq cache calls) takes a Side that fits the spec, for a format
    that uses one and no side data yet; anything else is a SpecError that leaves the cache as it was."""
    side = kltq.calibrate(keys(3), 4.5)
    c = KVCache(spec(), 128, backend="reference")
    root = c.root_hash
    other = kltq.calibrate(keys(3, layers=3), 4.5)  # another model's layer count
    for args, match in (((side, "q"), "'k' or 'v'"), ((side, True), "'k' or 'v'"), (("x",), "Side"), ((None,), "Side"),
                        ((side, "v"), "takes no side data"), ((other,), "shape")):  # fmt: skip
        with pytest.raises(SpecError, match=match):
            c.adopt_side(*args)
        assert c.root_hash == root and c.codec.side_list("k") == [None, None]
    c.adopt_side(side)
    assert c.root_hash == KVCache(spec(k_side=side), 128, backend="reference").root_hash
    with pytest.raises(SpecError, match="already"):
        c.adopt_side(side)
    filled_cache, _, _ = filled(4)
    with pytest.raises(SpecError, match="already"):  # calibrated by its first stores
        filled_cache.adopt_side(side)
