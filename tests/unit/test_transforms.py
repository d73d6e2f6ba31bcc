"""Cache transforms (scales, Hadamard rotation, f16 tail, KIVI K) against float64 numpy oracles."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import kvhal
from kvhal import formats, transforms
from tests.oracle import attention_f64

BS = 16


def hadamard_matrix(n: int) -> np.ndarray:
    """R = W D built independently: Sylvester's construction and the signs recomputed from sha256."""
    w = np.ones((1, 1))
    while w.shape[0] < n:
        w = np.block([[w, w], [w, -w]])
    digest = hashlib.sha256(f"kvhal-hadamard-signs\0{n}\0{0}".encode()).digest()
    bits = [(digest[i // 8] >> (i % 8)) & 1 for i in range(n)]
    return (w / np.sqrt(n)) @ np.diag([-1.0 if b else 1.0 for b in bits])


def pools(cache: kvhal.KVCache, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    p, n = cache.pools, cache.n_blocks
    k = np.asarray(cache.backend.to_numpy(p.k[layer])).view(np.uint8).reshape(cache.spec.pool_shape(n, "k"))
    v = np.asarray(cache.backend.to_numpy(p.v[layer])).view(np.uint8).reshape(cache.spec.pool_shape(n, "v"))
    return k, v


def rows(pool: np.ndarray, blocks: list[int], n: int) -> np.ndarray:
    """Pool rows of positions [0, n) of a sequence with page list ``blocks``: [n, H, row_bytes]."""
    x = pool[blocks]
    return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:n]


def dq(fmt: str, x: np.ndarray) -> np.ndarray:
    f = formats.get(fmt)
    return f.dequantize(f.quantize(x)).astype(np.float64)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def test_rotation_is_the_fixed_orthogonal_matrix(rng):
    for n in (32, 64, 128):
        r = hadamard_matrix(n)
        np.testing.assert_allclose(r @ r.T, np.eye(n), atol=1e-12)
        x = rng.standard_normal((5, 3, n))
        np.testing.assert_allclose(transforms.rotate(x), x @ r.T, atol=1e-12)
        np.testing.assert_allclose(transforms.unrotate(transforms.rotate(x)), x, atol=1e-12)
    # a misspelt rotation or side is refused, not run as the default one
    for fn in (transforms.rotate, transforms.unrotate):
        for mode, which in (("hadamard_llama", "k"), ("Hadamard", "k"), (None, "k"), ("hadamard-llama", "q")):
            with pytest.raises(kvhal.SpecError):
                fn(rng.standard_normal((2, 64)), mode, which)
    code = "from kvhal import transforms; print(transforms.signs(64).tolist())"
    outs = set()
    for seed in ("0", "123"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert len(outs) == 1 and str(transforms.signs(64).tolist()) in outs.pop()


def test_spec_validation_is_typed():
    bad = [
        {"k_scale": True}, {"k_scale": 0.0}, {"k_scale": -2.0}, {"k_scale": float("nan")}, {"v_scale": float("inf")},
        {"k_scale": (1.0,)}, {"k_scale": (1.0, True)}, {"k_scale": "calibrated"}, {"k_scale": b"x"},
        {"k_rotation": "hadamrd"}, {"v_rotation": 1}, {"tail": -1}, {"tail": True}, {"tail": 2.0},
        {"k_scale": np.bool_(True)}, {"k_scale": np.float32("nan")},
    ]  # fmt: skip
    for kw in bad:
        with pytest.raises(kvhal.SpecError):
            kvhal.CacheSpec(1, 2, 64, **kw)
    with pytest.raises(kvhal.SpecError, match="power of two"):
        kvhal.CacheSpec(1, 2, 96, k_rotation="hadamard")
    spec = kvhal.CacheSpec(1, 2, 64, k_scale=[0.5, 2.0], v_scale="calibrate", tail=3)
    assert spec.k_scale == (0.5, 2.0) and hash(spec)
    # numpy scalars are numbers: stored as plain floats, so they name the same bytes as the Python float
    spec_np = kvhal.CacheSpec(1, 2, 64, k_scale=(np.float32(0.5), np.int64(2)), v_scale=np.float32(3))
    assert spec_np.k_scale == (0.5, 2.0) and type(spec_np.v_scale) is float and spec_np.v_scale == 3.0


def test_scale_reaches_the_kernel_fp8(rng):
    """Values beyond e4m3's 448 saturate at scale 1 but store exactly at scale 4: stored = x / 4."""
    grid = formats.get("fp8_e4m3").dequantize(np.arange(256, dtype=np.uint8).reshape(-1, 1)).ravel()
    grid = grid[np.isfinite(grid)]
    k = rng.choice(grid, (20, 2, 64)).astype(np.float32) * 4  # up to 1792
    v = rng.choice(grid, (20, 2, 64)).astype(np.float32) * 4
    out = {}
    for scale in (None, 4.0):
        spec = kvhal.CacheSpec(1, 2, 64, "fp8_e4m3", "fp8_e4m3", BS, k_scale=scale, v_scale=scale)
        c = kvhal.KVCache(spec, 64, backend="reference")
        s = c.new_seq()
        c.store(s, 0, k, v)
        kp, vp = pools(c)
        sc = 1.0 if scale is None else scale
        f = formats.get("fp8_e4m3")
        np.testing.assert_array_equal(rows(kp, c.seq_table.get(s).blocks, 20), f.quantize(k / sc))
        np.testing.assert_array_equal(rows(vp, c.seq_table.get(s).blocks, 20), f.quantize(v / sc))
        k2, v2 = (kvhal.to_numpy(x) for x in c.load(s, 0))
        q = rng.standard_normal((3, 4, 64)).astype(np.float32) / 100
        out[scale] = (k2, v2, kvhal.to_numpy(c.attention(0, q, [s])), q)
    k2, v2, att, q = out[4.0]
    np.testing.assert_array_equal(k2, k)  # exact: x / 4 is on the e4m3 grid
    np.testing.assert_array_equal(v2, v)
    np.testing.assert_allclose(att, attention_f64(q, [k], [v], [3]), atol=1e-4)
    assert np.abs(out[None][0]).max() == 448  # the same values saturate without the scale


def fp8_calibrated(x: np.ndarray) -> np.ndarray:
    """The spec of fp8_e4m3 calibration by brute force on the format's own quantizer: per head, the power of
    two taking max |x| to at most 448 times 2**(i/16), i < 16, whichever reads x back closest (x small
    enough that every value is sampled)."""
    x64 = x.astype(np.float64)
    out = []
    for h in range(x.shape[1]):
        base = 2.0 ** np.ceil(np.log2(np.abs(x64[:, h]).max() / 448.0))
        cands = [base * 2.0 ** (i / 16) for i in range(16)]
        errs = [((dq("fp8_e4m3", (x64[:, h] / s).astype(np.float32)) * s - x64[:, h]) ** 2).sum() for s in cands]
        out.append(cands[int(np.argmin(errs))])
    return np.array(out)


def test_calibrated_fp8_scale_reads_back_closer_than_scale_one(rng):
    """The searched scale never reads a store back worse than scale 1 (or its power of two)."""
    x = (rng.standard_normal((256, 4, 64)) * np.array([0.3, 3.0, 30.0, 300.0])[None, :, None]).astype(np.float32)
    spec = kvhal.CacheSpec(1, 4, 64, "fp8_e4m3", "f16", BS, k_scale="calibrate")
    c = kvhal.KVCache(spec, 512, backend="reference")
    s = c.new_seq()
    c.store(s, 0, x, x)
    sc = np.asarray(c.scales()["k"][0])
    k2 = kvhal.to_numpy(c.load(s, 0)[0]).astype(np.float64)
    unit = dq("fp8_e4m3", x).astype(np.float64)
    for h in range(4):
        err = ((k2[:, h] - x[:, h]) ** 2).sum()
        assert err <= ((unit[:, h] - x[:, h]) ** 2).sum(), (h, sc[h])
    np.testing.assert_allclose(sc, fp8_calibrated(x))


def test_per_head_and_calibrated_scales(rng):
    k = rng.standard_normal((24, 2, 64)).astype(np.float32) * np.array([1.0, 1000.0], np.float32)[None, :, None]
    v = rng.standard_normal((24, 2, 64)).astype(np.float32)
    spec = kvhal.CacheSpec(1, 2, 64, "fp8_e4m3", "nvfp4", BS, k_scale="calibrate", v_scale=(0.5, 0.25))
    c = kvhal.KVCache(spec, 64, backend="reference")
    root = c.root_hash
    assert c.scales()["k"] == (None,)
    s = c.new_seq()
    c.store(s, 0, k[:10], v[:10])
    want = fp8_calibrated(k[:10])
    np.testing.assert_allclose(c.scales()["k"][0], want)
    assert not np.allclose(np.log2(want), np.round(np.log2(want)))  # a fraction of a power of two here
    assert c.root_hash != root  # calibrated scales name the cache's bytes
    c.store(s, 0, k[10:], v[10:])  # fixed after the first store
    np.testing.assert_allclose(c.scales()["k"][0], want)
    kp, vp = pools(c)
    sk = want[None, :, None]
    sv = np.array([0.5, 0.25])[None, :, None]
    np.testing.assert_array_equal(rows(kp, c.seq_table.get(s).blocks, 24), formats.get("fp8_e4m3").quantize(k / sk))
    np.testing.assert_array_equal(rows(vp, c.seq_table.get(s).blocks, 24), formats.get("nvfp4").quantize(v / sv))
    q = rng.standard_normal((2, 4, 64)).astype(np.float32) / 300
    ks = dq("fp8_e4m3", (k / sk).astype(np.float32)) * sk
    vs = dq("nvfp4", (v / sv).astype(np.float32)) * sv
    got = kvhal.to_numpy(c.attention(0, q, [s]))
    np.testing.assert_allclose(got, attention_f64(q, [ks], [vs], [2]), atol=1e-5)
    k2, v2 = (kvhal.to_numpy(x) for x in c.load(s, 0, 3, 20))
    np.testing.assert_allclose(k2, ks[3:20], rtol=1e-6)
    np.testing.assert_allclose(v2, vs[3:20], rtol=1e-6, atol=1e-7)


def test_calibration_is_per_layer(rng, tmp_path):
    """Each layer's first store fixes that layer's scales: a later layer with larger keys does not saturate."""
    small = rng.standard_normal((20, 2, 64)).astype(np.float32)
    big = small * np.float32(100.0)
    spec = kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", "f16", BS, k_scale="calibrate")
    c = kvhal.KVCache(spec, 64, backend="reference")
    s = c.new_seq()
    c.store(s, 0, small, small)
    assert c.calibrating() and c.scales()["k"][1] is None
    with pytest.raises(kvhal.UnsupportedError, match="every layer"):
        c.save(tmp_path / "partial.kvs")
    c.store(s, 1, big, big)
    assert not c.calibrating()
    for layer, x in ((0, small), (1, big)):
        want = fp8_calibrated(x)
        np.testing.assert_allclose(c.scales()["k"][layer], want)
        sk = want[None, :, None]
        kp, _ = pools(c, layer)
        np.testing.assert_array_equal(rows(kp, c.seq_table.get(s).blocks, 20), formats.get("fp8_e4m3").quantize(x / sk))
    resolved = c.resolved_spec.k_scale
    assert isinstance(resolved, tuple) and len(resolved) == 2 and resolved[1] == c.scales()["k"][1]
    # the same bytes from a spec that names the per-layer scales
    given = kvhal.KVCache(kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", "f16", BS, k_scale=resolved), 64, backend="reference")
    s2 = given.new_seq()
    given.store(s2, 0, small, small)
    given.store(s2, 1, big, big)
    for layer in (0, 1):
        np.testing.assert_array_equal(pools(given, layer)[0], pools(c, layer)[0])


@pytest.mark.parametrize(
    "bad", [((1.0, 1.0),), ((1.0, 1.0), (1.0,)), ((1.0, 1.0), (1.0, 0.0)), ((1.0, 1.0), (1.0, True))]
)
def test_per_layer_scale_is_validated(bad):
    with pytest.raises(kvhal.SpecError, match="per-layer scale"):
        kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", k_scale=bad)


def test_calibration_failure_changes_nothing(rng):
    spec = kvhal.CacheSpec(1, 2, 64, "fp8_e4m3", k_scale="calibrate", v_scale="calibrate")
    c = kvhal.KVCache(spec, 16, backend="reference")
    s = c.new_seq()
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    with pytest.raises(kvhal.CapacityError):
        c.store(s, 0, k, k)
    assert c.scales() == {"k": (None,), "v": (None,)} and c.seq_len(s) == 0
    bad = k[:4].copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(kvhal.NonFiniteError):
        c.store(s, 0, bad, k[:4])
    assert c.scales() == {"k": (None,), "v": (None,)}


@pytest.mark.parametrize("rot", [("hadamard", None), (None, "hadamard"), ("hadamard", "hadamard")])
def test_rotation_with_q4_0(rng, rot):
    kr, vr = rot
    n, dim = 37, 64
    r = hadamard_matrix(dim)
    k = rng.standard_normal((n, 2, dim)).astype(np.float32)
    k[:, :, 5] *= 20  # an outlier channel: what the rotation spreads
    v = rng.standard_normal((n, 2, dim)).astype(np.float32)
    spec = kvhal.CacheSpec(1, 2, dim, "q4_0", "q4_0", BS, k_rotation=kr, v_rotation=vr)
    c = kvhal.KVCache(spec, 64, backend="reference")
    s = c.new_seq()
    c.store(s, 0, k[:1], v[:1])
    c.store(s, 0, k[1:], v[1:])
    hk = (k.astype(np.float64) @ r.T).astype(np.float32) if kr else k
    hv = (v.astype(np.float64) @ r.T).astype(np.float32) if vr else v
    kp, vp = pools(c)
    np.testing.assert_array_equal(rows(kp, c.seq_table.get(s).blocks, n), formats.get("q4_0").quantize(hk))
    np.testing.assert_array_equal(rows(vp, c.seq_table.get(s).blocks, n), formats.get("q4_0").quantize(hv))
    q = rng.standard_normal((5, 4, dim)).astype(np.float32)
    hq = q.astype(np.float64) @ r.T if kr else q.astype(np.float64)
    att = attention_f64(hq, [dq("q4_0", hk)], [dq("q4_0", hv)], [5])  # in the rotated space
    want = att @ r if vr else att  # un-rotate the output: R^T applied to each row
    got = kvhal.to_numpy(c.attention(0, q, [s]))
    np.testing.assert_allclose(got, want, atol=2e-5)
    k2, v2 = (kvhal.to_numpy(x) for x in c.load(s, 0))
    np.testing.assert_allclose(k2, dq("q4_0", hk) @ r if kr else dq("q4_0", hk), atol=2e-5)
    np.testing.assert_allclose(v2, dq("q4_0", hv) @ r if vr else dq("q4_0", hv), atol=2e-5)


CASES = {
    # q_len per step, causal, window
    "prefill": ([50], True, None),
    "chunked": ([7, 20, 1, 1, 30], True, None),
    "window": ([45, 1, 1], True, 9),
    "non-causal": ([40, 3], False, None),
    "non-causal-window": ([40, 3], False, 12),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fk,fv,tail", [("q8_0", "q4_0", 20), ("kivi4", "q8_0", 0), ("kivi2", "kivi4", 5)])
def test_tail_attention_merges_pages_and_f16(rng, case, fk, fv, tail):
    """Attention = attention over [dequantized whole pages ++ the f16 tail], at every step."""
    steps, causal, window = CASES[case]
    spec = kvhal.CacheSpec(1, 2, 64, fk, fv, BS, tail=tail)
    c = kvhal.KVCache(spec, 256, backend="reference")
    s = c.new_seq()
    total = sum(steps)
    k = rng.standard_normal((total, 2, 64)).astype(np.float32)
    k[:, :, 3] *= 8
    v = rng.standard_normal((total, 2, 64)).astype(np.float32)
    done = 0
    for n in steps:
        c.store(s, 0, k[done : done + n], v[done : done + n])
        done += n
        paged = max(0, done - tail) // BS * BS
        assert c.seq_table.get(s).pages() == [paged]
        kf, vf = f16(k[:done]), f16(v[:done])
        if formats.get(fk).k_page is not None and paged:
            codec = formats.get(fk).k_page
            pages = kf[:paged].reshape(-1, BS, 2, 64).transpose(0, 2, 1, 3).reshape(-1, BS, 64).astype(np.float32)
            kq = codec.dequantize_page(codec.quantize_page(pages), BS).reshape(-1, 2, BS, 64).transpose(0, 2, 1, 3)
            kq = kq.reshape(paged, 2, 64)
            kp, _ = pools(c)
            got = kp[c.seq_table.get(s).blocks].reshape(len(c.seq_table.get(s).blocks) * 2, -1)
            np.testing.assert_array_equal(got, codec.quantize_page(pages))  # the pool holds the page codec's bytes
        else:
            kq = dq(fk, kf[:paged].astype(np.float32))
        ks = np.concatenate([kq, kf[paged:]])
        vs = np.concatenate([dq(fv, vf[:paged].astype(np.float32)), vf[paged:]])
        q = rng.standard_normal((n, 4, 64)).astype(np.float32)
        got = kvhal.to_numpy(c.attention(0, q, [s], causal=causal, window=window))
        want = attention_f64(q, [ks], [vs], [n], causal=causal, window=window)
        np.testing.assert_allclose(got, want, atol=1e-5)
        k2, v2 = (kvhal.to_numpy(x) for x in c.load(s, 0))
        np.testing.assert_allclose(k2, ks, atol=1e-6)
        np.testing.assert_allclose(v2, vs, atol=1e-6)


def test_tail_batch_and_transforms_together(rng):
    spec = kvhal.CacheSpec(2, 2, 64, "kivi4", "fp8_e4m3", BS, tail=4, k_rotation="hadamard", v_scale=0.5)
    c = kvhal.KVCache(spec, 256, backend="reference")
    r = hadamard_matrix(64)
    seqs, ks, vs = [], [], []
    for n in (3, 21, 40):
        k = rng.standard_normal((n, 2, 64)).astype(np.float32)
        v = rng.standard_normal((n, 2, 64)).astype(np.float32)
        s = c.new_seq()
        for layer in (0, 1):
            c.store(s, layer, k, v)
        seqs.append(s)
        k2, v2 = (kvhal.to_numpy(x) for x in c.load(s, 1))
        ks.append(k2)
        vs.append(v2)
        paged = max(0, n - 4) // BS * BS
        np.testing.assert_allclose(k2[paged:], f16(k @ r.T)[paged:] @ r, atol=1e-5)  # tail rows: f16 of R k
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    got = kvhal.to_numpy(c.attention(1, q, seqs, [1, 1, 1]))
    np.testing.assert_allclose(got, attention_f64(q, ks, vs, [1, 1, 1]), atol=2e-5)


def test_tail_lifecycle(rng, tmp_path):
    spec = kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", "q8_0", BS, tail=8, k_scale="calibrate", v_rotation="hadamard")
    fp = kvhal.Fingerprint("m")
    c = kvhal.KVCache(spec, 256, backend="reference", fingerprint=fp)
    k = rng.standard_normal((45, 2, 64)).astype(np.float32)
    v = rng.standard_normal((45, 2, 64)).astype(np.float32)
    s = c.new_seq()
    ids = list(range(100, 145))
    c.append_tokens(s, ids)
    for layer in (0, 1):
        c.store(s, layer, k, v)
    assert c.seq_table.get(s).pages() == [32, 32] and len(c.seq_table.get(s).hashes) == 2
    st = c.stats()
    assert st.tail_tokens == 13 and st.tail_bytes == 2 * 2 * 13 * 2 * 64 * 2  # layers, K+V, tokens, heads, dim, f16
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    want = kvhal.to_numpy(c.attention(1, q, [s]))
    # the prefix cache shares whole quantized blocks only, as many as a prefill of the query would quantize
    t, n = c.match_prefix(ids[:40])
    assert n == 32 and c.seq_table.get(t).pages() == [32, 32]
    t2, n2 = c.match_prefix(ids[:30])
    assert n2 == 16
    for x in (t, t2):
        c.free_seq(x)
    # whole-sequence copy and a suffix removal within the tail; other ranges are refused and change nothing
    cp = c.seq_cp(s)
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(1, q, [cp])), want)
    c.seq_rm(cp, 40, -1)
    assert c.seq_len(cp) == 40 and c.seq_len(s) == 45
    for call in (lambda: c.seq_rm(cp, 10, 20), lambda: c.seq_rm(cp, 30, -1), lambda: c.seq_cp(s, 16, 32)):
        with pytest.raises(kvhal.UnsupportedError):
            call()
    assert c.seq_len(cp) == 40
    # scoring and eviction through the transforms: the kept rows as they were (those leaving the pages for the
    # f16 tail rounded to f16 in the stored, transformed form), attention over them
    before = [np.asarray(kvhal.to_numpy(x)) for x in c.load(cp, 1)]
    c.attention(1, rng.standard_normal((40, 2, 64)).astype(np.float32), [cp], observe=True)
    kept = c.evict(cp, kvhal.eviction.H2O(heavy=12, recent=8), 20).kept
    assert len(kept) == 20 and c.seq_table.get(cp).pages() == [0, 0] and c.seq_len(cp) == 20
    after = [np.asarray(kvhal.to_numpy(x)) for x in c.load(cp, 1)]
    for x, y in zip(after, before):
        np.testing.assert_allclose(x, y[kept], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(kvhal.to_numpy(c.attention(1, q, [cp])), attention_f64(q, [after[0]], [after[1]], [1]),
                               atol=2e-5)  # fmt: skip
    c.free_seq(cp)
    # snapshots keep the tail and the calibrated scales; a fresh "calibrate" cache adopts them
    c.save(tmp_path / "a.kvs", [s])
    fresh = kvhal.KVCache(spec, 256, backend="reference", fingerprint=fp)
    [r] = fresh.restore(tmp_path / "a.kvs")
    assert fresh.scales() == c.scales() and fresh.root_hash == c.root_hash
    np.testing.assert_array_equal(kvhal.to_numpy(fresh.attention(1, q, [r])), want)
    other = kvhal.KVCache(spec, 256, backend="reference", fingerprint=fp)
    other.store(other.new_seq(), 0, k[:2] * 3, v[:2])  # calibrated differently
    with pytest.raises(kvhal.FingerprintMismatchError):
        other.restore(tmp_path / "a.kvs")
    import dataclasses

    for change in ({"tail": 9}, {"v_rotation": None}, {"k_scale": 1.0}):
        with pytest.raises(kvhal.FingerprintMismatchError):
            kvhal.KVCache(dataclasses.replace(spec, **change), 256, backend="reference", fingerprint=fp).restore(
                tmp_path / "a.kvs"
            )


def test_tail_copy_of_a_range_keeps_only_its_token_ids():
    """seq_cp [0, n) with a tail, of a sequence whose token ids run ahead of its rows, takes the ids of [0, n) only
    (it took them all: the copy's own rows at n.. were then hashed under the original's ids, and a match_prefix of
    those ids was served the copy's rows)."""
    spec = kvhal.CacheSpec(1, 1, 32, "f32", "f32", 4, tail=2)
    c = kvhal.KVCache(spec, 64, backend="reference")
    s = c.new_seq()
    c.append_tokens(s, list(range(16)))
    ones = np.ones((8, 1, 32), np.float32)
    c.store(s, 0, ones, ones)
    t = c.seq_cp(s, 0, 8)
    assert c.tokens(t) == list(range(8))
    c.append_tokens(t, list(range(20, 26)))
    c.store(t, 0, 5 * ones[:6], 5 * ones[:6])  # positions 8..13: blocks 0-2 paged and hashed
    assert c.tokens(t) == [*range(8), *range(20, 26)]
    m, n = c.match_prefix(list(range(16)))
    assert n == 8  # the third block is t's tokens 20..23, not 8..11


def test_transforms_enter_the_fingerprint():
    base = kvhal.CacheSpec(1, 2, 64, "q8_0")
    fp = kvhal.Fingerprint("m")
    import dataclasses

    digests = {fp.digest(base)}
    for change in ({"k_scale": 2.0}, {"v_scale": 2.0}, {"k_scale": (1.0, 2.0)}, {"k_scale": "calibrate"},
                   {"k_rotation": "hadamard"}, {"v_rotation": "hadamard"}, {"tail": 16}):  # fmt: skip
        digests.add(fp.digest(dataclasses.replace(base, **change)))
    assert len(digests) == 8
    assert fp.digest(dataclasses.replace(base, k_scale=None)) == fp.digest(base)
    assert fp.digest(dataclasses.replace(base, k_scale=2)) == fp.digest(dataclasses.replace(base, k_scale=2.0))
    assert dataclasses.replace(base, v_scale=(1, 2)).v_scale == (1.0, 2.0)
    assert "k_scale" not in fp.as_dict(base)["spec"]  # identity transforms keep the digests caches had before


def test_kivi_k_with_backends_that_lack_it_is_refused():
    spec = kvhal.CacheSpec(1, 2, 64, "kivi4", "q8_0", BS)
    infos = [i for i in kvhal.backends() if i.available and "kivi4" not in i.formats]
    for info in infos:
        with pytest.raises(kvhal.UnsupportedError):
            kvhal.KVCache(spec, 64, backend=info.name)


def test_adopt_scales_takes_checked_scales_whole_or_none(rng, tmp_path):
    """``adopt_scales`` is what a restore into a fresh "calibrate" cache calls: scales it takes store exactly as a
    spec that names them; anything else is a SpecError that leaves the cache as it was."""
    spec = kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", "f16", BS, k_scale="calibrate")
    c = kvhal.KVCache(spec, 64, backend="reference")
    root = c.root_hash
    ones = [np.ones(2)] * 2
    bad = [None, 1, {}, {"q": ones}, {"k": "x"}, {"k": ones[:1]}, {"k": [np.ones(3)] * 2}, {"k": [np.array([-1.0, 1])] * 2},
           {"k": [["1", "2"]] * 2}, {"k": [[True, 1.0]] * 2}, {"k": [1.0, 2.0]}, {"k": [[np.inf, 1.0]] * 2},
           {"k": ones, "v": ones}]  # fmt: skip
    for x in bad:
        with pytest.raises(kvhal.SpecError):
            c.adopt_scales(x)
        assert c.scales()["k"] == (None, None) and c.root_hash == root
    scales = [np.array([0.5, 2.0]), [1, 3]]
    c.adopt_scales({"k": scales})
    want = ((0.5, 2.0), (1.0, 3.0))
    assert c.scales()["k"] == want and not c.calibrating()
    given = kvhal.KVCache(kvhal.CacheSpec(2, 2, 64, "fp8_e4m3", "f16", BS, k_scale=want), 64, backend="reference")
    assert c.root_hash == given.root_hash
    k = rng.standard_normal((20, 2, 64)).astype(np.float32)
    for cache in (c, given):
        cache.store(cache.new_seq(), 0, k, k)
    np.testing.assert_array_equal(pools(c, 0)[0], pools(given, 0)[0])
    with pytest.raises(kvhal.SpecError, match="fixed already"):
        c.adopt_scales({"k": ones})
    assert c.scales()["k"] == want
