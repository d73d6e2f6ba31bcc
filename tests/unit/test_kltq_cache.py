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


def test_spec_refusals_are_typed():
    side = kltq.calibrate(keys(2), 4.5)
    with pytest.raises(SpecError, match="K format"):
        spec(v_format="kltq:4.5")
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
