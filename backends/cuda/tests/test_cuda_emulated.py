"""kvhal.cu itself, run on the CPU SIMT emulator: bytes against the numpy spec, attention against float64.

The emulator (tests/emu/emu.cpp) executes the kernel source with the same warp-synchronous semantics as
hardware; it does not reproduce the GPU's expf/logf rounding, which only the tolerance sees.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal import formats
from tests.oracle import attention_f64

cuda_emulator = pytest.importorskip("cuda_emulator")
if cuda_emulator.compiler() is None:
    pytest.skip("no C++ compiler for the kernel emulator", allow_module_level=True)

FMTS = sorted(cuda_emulator.EmulatedCudaBackend.formats, key=formats.names().index)


def kv_formats(fmt):
    """(K, V) formats that store ``fmt`` row by row: a per-channel K format (kivi) as V beside f16 K (its K pages:
    the kivi_k tests below)."""
    return ("f16", fmt) if formats.get(fmt).k_page is not None else (fmt, fmt)


def make(fmt_k, fmt_v=None, *, heads=2, dim=64, bs=16, cap=512, n_sm=4, layers=1):
    spec = kvhal.CacheSpec(n_layers=layers, n_kv_heads=heads, head_dim=dim, k_format=fmt_k, v_format=fmt_v or fmt_k,
                           block_size=bs)  # fmt: skip
    backend = cuda_emulator.EmulatedCudaBackend(n_sm=n_sm)
    return kvhal.KVCache(spec, cap, backend=backend), kvhal.KVCache(spec, cap, backend="reference")


def pools(c):
    return [np.asarray(kvhal.to_numpy(x)).view(np.uint8) for x in (c.pools.k[0], c.pools.v[0])]


def hard_blocks(rng, dim=64):
    """Values where a careless kernel differs from the spec: ties, .5 boundaries, zeros, subnormal scales."""
    rows = []
    base = rng.standard_normal(dim).astype(np.float32)
    rows.append(np.zeros(dim, np.float32))
    tie = base.copy()
    tie[5], tie[9] = 2.5, -2.5  # signed absmax: first occurrence wins
    rows.append(tie)
    tie2 = base.copy()
    tie2[5], tie2[9] = -3.0, 3.0
    rows.append(tie2)
    rows.append(np.full(dim, 1e-40, np.float32))  # subnormal d: 1/d overflows, id = 0
    rows.append((np.arange(dim, dtype=np.float32) - 32) * np.float32(0.5))  # x*id on .5 boundaries
    rows.append(np.linspace(-127, 127, dim).astype(np.float32) / np.float32(127) * np.float32(3.3))
    rows.append(np.full(dim, 60000.0, np.float32) * np.sign(base))  # near f16 max
    rows.append(np.nextafter(np.float32(0.5), np.float32(0)) * np.sign(base))  # just below 0.5
    rows.append(base * np.float32(1e-6))
    rows.append(np.full(dim, -7.0, np.float32))  # constant block: d = 0 for the min/max formats
    return np.stack(rows)


@pytest.mark.parametrize("fmt", FMTS)
def test_store_is_bit_exact_on_hard_values(fmt):
    rng = np.random.default_rng(11)
    f = formats.get(fmt)
    x = hard_blocks(rng)
    x = np.clip(x, -f.max_abs, f.max_abs)
    k = np.stack([x, x[::-1]], axis=1)  # [n, 2 heads, 64]
    a, b = make(*kv_formats(fmt))
    for c in (a, b):
        c.store(c.new_seq(), 0, k, -k)
    for got, want in zip(pools(a), pools(b), strict=False):
        np.testing.assert_array_equal(got, want)
    got = kvhal.to_numpy(a.load(0, 0)[1])
    np.testing.assert_array_equal(got, f.dequantize(f.quantize(-k)))


@pytest.mark.parametrize("fmt", FMTS)
def test_store_random_rows_and_f16_input(fmt):
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((45, 2, 64)) * rng.uniform(0.01, 30, (45, 2, 1))).astype(np.float32)
    a, b = make(*kv_formats(fmt))
    for c in (a, b):
        s = c.new_seq()
        c.store(s, 0, k[:20].astype(np.float16), k[:20].astype(np.float16))
        c.store(s, 0, k[20:], k[20:])
    for got, want in zip(pools(a), pools(b), strict=False):
        np.testing.assert_array_equal(got, want)


def rows_of(values, dim=64):
    """A flat value list as [n, 2 heads, dim] rows (padded with zeros), the second head reversed."""
    v = np.asarray(values, np.float32).ravel()
    v = np.concatenate([v, np.zeros(-v.size % dim, np.float32)]).reshape(-1, dim)
    return np.stack([v, v[::-1, ::-1]], axis=1)


def store_both(fmt, k, dim=64):
    a, b = make(*kv_formats(fmt), dim=dim, cap=max(64, -(-k.shape[0] // 16) * 16))
    for c in (a, b):
        c.store(c.new_seq(), 0, k, -k)
    for got, want in zip(pools(a), pools(b), strict=True):
        np.testing.assert_array_equal(got, want)
    return a


@pytest.mark.parametrize("fmt,dtype", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_rounds_every_halfway_point_like_ml_dtypes_and_saturates(fmt, dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f = formats.get(fmt)
    vals = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, dtype)).astype(np.float32)
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0)])  # every finite non-negative value, ascending
    mid = (pos[:-1] + pos[1:]) / 2  # exact in f32: halfway points, round to even
    x = np.concatenate([pos, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), [1e-45, 1e-39, pos[1] / 4]])
    x = np.concatenate([x, -x, [-0.0]]).astype(np.float32)
    k = rows_of(x)
    a = store_both(fmt, k)
    # an independent oracle: ml_dtypes' conversion (every value is in range), zeros' signs included
    want = (-k).astype(getattr(ml_dtypes, dtype)).astype(np.float32)
    got = kvhal.to_numpy(a.load(0, 0)[1])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # beyond the largest finite value: saturate (ml_dtypes gives inf/NaN there)
    big = np.array([f.max_abs * 1.0001, f.max_abs * 1.5, 1e30, 3.4e38], np.float32)
    a = store_both(fmt, rows_of(np.concatenate([big, -big])))
    np.testing.assert_array_equal(kvhal.to_numpy(a.load(0, 0)[1])[0, 0, :8], np.repeat([-f.max_abs, f.max_abs], 4))


def test_mxfp4_exponent_follows_f32_log2_just_below_powers_of_two():
    # amax = 2^k (1 - 2^-24): an f32 log2 rounds to k for most k, the exact floor is k - 1
    blocks = []
    for k in range(-140, 125, 3):
        amax = np.nextafter(np.float32(2.0) ** k if k > -149 else np.float32(1e-45), np.float32(0))
        blk = np.linspace(-1, 1, 32).astype(np.float32) * amax
        blk[7] = amax
        blocks.append(blk)
    store_both("mxfp4", rows_of(np.concatenate(blocks)))


def test_nvfp4_scales_across_the_ue4m3_range():
    rng = np.random.default_rng(12)
    amax = np.concatenate(
        [np.geomspace(1e-4, 3000, 200), 6 * np.array([2.0**-9, 2.0**-7, 0.0155, 255.0, 256.0, 448.0])]
    )
    sub = rng.uniform(-1, 1, (amax.size, 16)).astype(np.float32) * amax[:, None].astype(np.float32)
    sub[:, 3] = amax
    sub[::5] = 0.0
    store_both("nvfp4", rows_of(sub.ravel(), dim=128), dim=128)


def test_copy_slots_overlapping_shift():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((40, 2, 64), dtype=np.float32)
    a, b = make("q4_1", bs=8)
    for c in (a, b):
        s = c.new_seq()
        c.store(s, 0, k, k)
        c.seq_rm(s, 2, 9)  # shifts tokens 9.. down by 7: source and destination rows overlap
    for got, want in zip(pools(a), pools(b), strict=False):
        np.testing.assert_array_equal(got, want)


CASES = [
    # heads, kv heads, dim, fmt k, fmt v, seq lens, q lens, causal, window
    (4, 2, 64, "q8_0", "q4_0", [700], [1], True, None),  # split-KV decode
    (8, 2, 128, "q5_1", "f16", [33, 300, 5], [1, 1, 1], True, None),
    (4, 4, 64, "q4_1", "q5_0", [90, 64], [37, 64], True, None),  # prefill tiles, partial last tile
    (2, 1, 256, "bf16", "q8_0", [70], [20], True, 9),  # largest head_dim: smaller tile geometry
    (3, 1, 40, "f16", "f32", [50, 2], [7, 2], False, None),  # head_dim not a multiple of 32
    (6, 3, 8, "f32", "f16", [19], [19], False, 4),
    (4, 2, 64, "q8_0", "q8_0", [500, 400], [30, 1], True, 100),  # split prefill + decode, window
    (4, 2, 40, "fp8_e4m3", "fp8_e5m2", [300, 7], [1, 7], True, None),  # odd-free but non-32 head_dim
    (4, 1, 128, "nvfp4", "mxfp4", [600, 33], [1, 33], True, None),
    (2, 2, 64, "mxfp4", "kivi2", [90], [40], False, None),
    (4, 2, 128, "fp8_e4m3", "kivi4", [520], [1], True, 64),
    # decode CTAs per KV head (plan.decode_group): 8 heads in one, 8 heads in two of 4, a group of 3 one by one
    (8, 1, 64, "q4_0", "q8_0", [300, 9], [1, 1], True, None),
    (16, 2, 128, "q8_0", "q4_0", [400, 70], [1, 1], True, 50),
    (6, 2, 64, "f16", "q8_0", [300], [1], True, None),
    # decode inner loops (kvhal_attn_decode): K rows too wide to stage read from the pool (f32 as float4, f16),
    # an odd head_dim, odd block counts (q8_0 / q4_0 block pairs), one block per row, eight heads per CTA
    (4, 1, 128, "f32", "fp8_e4m3", [300], [1], True, None),
    (2, 1, 256, "f16", "f16", [100], [1], True, None),
    (3, 1, 33, "f16", "f32", [70, 40], [1, 1], False, None),
    (8, 1, 96, "q8_0", "q4_0", [130], [1], True, None),
    (8, 1, 32, "q4_0", "q8_0", [200], [1], True, 77),
    (16, 2, 64, "q8_0", "f16", [90], [1], True, None),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n_sm", [1, 64])
def test_attention(case, n_sm):
    hq, hkv, d, fk, fv, lens, qls, causal, window = CASES[case]
    rng = np.random.default_rng(case)
    a, _ = make(fk, fv, heads=hkv, dim=d, cap=sum(lens) + 64, n_sm=n_sm)
    ks, vs, seqs = [], [], []
    for n in lens:
        k, v = rng.standard_normal((n, hkv, d), dtype=np.float32), rng.standard_normal((n, hkv, d), dtype=np.float32)
        s = a.new_seq()
        a.store(s, 0, k, v)
        seqs.append(s)
        ks.append(formats.get(fk).dequantize(formats.get(fk).quantize(k)))
        vs.append(formats.get(fv).dequantize(formats.get(fv).quantize(v)))
    q = rng.standard_normal((sum(qls), hq, d), dtype=np.float32)
    rt = a.backend._rt
    rt.launches.clear()
    out = kvhal.to_numpy(a.attention(0, q, seqs, qls, causal=causal, window=window))
    want = attention_f64(q, ks, vs, qls, causal=causal, window=window)
    err = float(np.abs(out - want).max())
    assert err <= 2e-6, err  # well inside the declared attention_tolerance
    names = [name for name, *_ in rt.launches]
    from kvhal_cuda import plan

    assert all(
        g[1] == hq // plan.decode_group(hq, hkv, d) for name, g, *_ in rt.launches if name == "kvhal_attn_decode"
    )
    split = any(g[2] > 1 for name, g, *_ in rt.launches if name != "kvhal_attn_merge")
    assert ("kvhal_attn_merge" in names) == split
    if n_sm == 64 and max(lens) >= 2 * 256:
        assert split, "long context on a wide GPU should split KV"


NAN_CODE = {"fp8_e4m3": (3, b"\x7f"), "q8_0": (0, b"\x00\x7e")}  # (byte offset in the row, bytes): value 3 / block 0


@pytest.mark.parametrize("fk,fv", [("fp8_e4m3", "q8_0"), ("q8_0", "fp8_e4m3")])
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_attention_propagates_nan_codes(fk, fv, side, q_len):
    """A NaN in stored K or V (an fp8 0x7f code, a q8_0 block whose f16 scale is NaN: bytes no store writes but
    write_blocks can) makes decode and prefill outputs NaN exactly where float64 attention over the loaded rows
    is: a NaN score poisons its whole head, a NaN V value its output element."""
    rng = np.random.default_rng(4)
    a, _ = make(fk, fv, heads=2, dim=64, bs=16, cap=640, n_sm=64)  # 600 tokens: split KV, merged
    s = a.new_seq()
    k, v = rng.standard_normal((600, 2, 64), dtype=np.float32), rng.standard_normal((600, 2, 64), dtype=np.float32)
    a.store(s, 0, k, v)
    spec = a.spec
    off, code = NAN_CODE[fk if side == "k" else fv]
    row = spec.k_row_bytes if side == "k" else spec.v_row_bytes
    base = 0 if side == "k" else spec.page_nbytes("k")
    ids = np.arange(a.n_blocks)
    blocks = a.backend.read_blocks(a.pools, ids)
    start = base + (spec.block_size + 5) * row + off  # head 1, offset 5 of every page: tokens 5, 21, ...
    blocks[:, start : start + len(code)] = np.frombuffer(code, np.uint8)
    a.backend.write_blocks(a.pools, ids, blocks)
    kl, vl = (kvhal.to_numpy(x) for x in a.load(s, 0))
    q = rng.standard_normal((q_len, 4, 64), dtype=np.float32)
    rt = a.backend._rt
    rt.launches.clear()
    out = kvhal.to_numpy(a.attention(0, q, [s], [q_len]))
    assert "kvhal_attn_merge" in [name for name, *_ in rt.launches]
    want = attention_f64(q, [kl], [vl], [q_len])
    assert np.isnan(want).any() and not np.isnan(want).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    fin = ~np.isnan(want)
    assert float(np.abs(out[fin] - want[fin]).max()) <= 2e-6


def test_splits_do_not_change_decode_beyond_rounding():
    rng = np.random.default_rng(9)
    outs = []
    k, v = rng.standard_normal((1000, 2, 64), dtype=np.float32), rng.standard_normal((1000, 2, 64), dtype=np.float32)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    for n_sm in (1, 128):
        a, _ = make("q8_0", cap=1024, n_sm=n_sm)
        s = a.new_seq()
        a.store(s, 0, k, v)
        outs.append(kvhal.to_numpy(a.attention(0, q, [s], [1])))
    assert float(np.abs(outs[0] - outs[1]).max()) < 1e-6


def test_raw_block_io_is_one_launch_each_way_and_checks_its_ids():
    rng = np.random.default_rng(3)
    a, ref = make("q4_0", "bf16", heads=3, dim=32, bs=5, cap=60, layers=3)  # 270-byte K pages: 16-bit copies
    k = rng.standard_normal((23, 3, 32), dtype=np.float32)
    for c in (a, ref):
        s = c.new_seq()
        for layer in range(3):
            c.store(s, layer, k * (layer + 1), -k)
    rt = a.backend._rt
    ids = np.array([4, 1, 0], np.int64)
    rt.launches.clear()
    got = a.backend.read_blocks(a.pools, ids)
    assert [name for name, *_ in rt.launches] == ["kvhal_blocks_gather"]
    np.testing.assert_array_equal(got, ref.backend.read_blocks(ref.pools, ids))
    rt.launches.clear()
    a.backend.write_blocks(a.pools, np.array([2, 3, 11]), got)  # block 11: free, past every sequence
    assert [name for name, *_ in rt.launches] == ["kvhal_blocks_scatter"]
    np.testing.assert_array_equal(a.backend.read_blocks(a.pools, np.array([2, 3, 11])), got)
    np.testing.assert_array_equal(a.backend.read_blocks(a.pools, np.array([0, 1])), got[[2, 1]])  # untouched
    assert a.backend.read_blocks(a.pools, np.zeros(0, np.int64)).shape == (0, a.spec.block_nbytes)
    before = a.backend.read_blocks(a.pools, np.arange(a.n_blocks))
    for bad in (np.array([a.n_blocks]), np.array([-1]), np.array([[0]]), np.array([0.0])):
        with pytest.raises(kvhal.PositionError):
            a.backend.read_blocks(a.pools, bad)
        with pytest.raises(kvhal.PositionError):
            a.backend.write_blocks(a.pools, bad, got[:1])
    with pytest.raises(kvhal.ShapeError):
        a.backend.write_blocks(a.pools, ids[:2], got)
    np.testing.assert_array_equal(a.backend.read_blocks(a.pools, np.arange(a.n_blocks)), before)


@pytest.mark.parametrize("fk,fv,dim", [("fp8_e4m3", "fp8_e5m2", 33), ("mxfp4", "q4_0", 32), ("f16", "mxfp4", 96)])
def test_odd_sized_pages_copy_bytewise(fk, fv, dim):
    """fp8 rows of an odd head_dim and mxfp4's 17-byte blocks make odd pages, which start at odd offsets."""
    rng = np.random.default_rng(6)
    a, ref = make(fk, fv, heads=3, dim=dim, bs=5, cap=60, layers=2)
    assert (a.spec.page_nbytes("k") | a.spec.page_nbytes("v")) & 1
    k = rng.standard_normal((23, 3, dim), dtype=np.float32)
    for c in (a, ref):
        s = c.new_seq()
        for layer in range(2):
            c.store(s, layer, k * (layer + 1), -k)
        c.seq_rm(s, 2, 9)  # copy_slots
    ids = np.array([3, 0, 2], np.int64)
    got = a.backend.read_blocks(a.pools, ids)
    np.testing.assert_array_equal(got, ref.backend.read_blocks(ref.pools, ids))
    a.backend.write_blocks(a.pools, np.array([5, 11, 1]), got)
    np.testing.assert_array_equal(a.backend.read_blocks(a.pools, np.array([5, 11, 1])), got)


def test_wide_heads_store_and_load_though_attention_refuses():
    """supports() refuses only attention past head_dim 256; store and load run any width."""
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=320, k_format="q4_1", v_format="f16", block_size=4)
    backend, ref = cuda_emulator.EmulatedCudaBackend(), kvhal.registry.instance("reference")
    assert "head_dim 320" in (backend.supports(spec, "attention") or "") and backend.supports(spec, "store") is None
    x = np.random.default_rng(8).standard_normal((6, 2, 320), dtype=np.float32)
    slots = np.array([9, 10, 11, 0, 1, 2], np.int64)
    got = []
    for b in (backend, ref):
        pools = b.allocate(spec, 3)
        b.store(pools, 0, b.asarray(x, "k"), b.asarray(-x, "v"), slots)
        got.append(
            (b.read_blocks(pools, np.arange(3)), *(b.to_numpy(a) for a in b.load(pools, 0, np.array([2, 0]), 7)))
        )
    for a, r in zip(*got, strict=True):
        np.testing.assert_array_equal(a, r)


# ---- K of kivi4/kivi2: per channel over whole pages (kvhal_store_kpage, k_value, k_kpage) ---------------------


def f16(x):
    return x.astype(np.float16).astype(np.float32)


def kpage_deq(fmt, k, bs):
    """k [pages * bs, H, D] through the numpy page codec, per (page, head)."""
    codec = formats.get(fmt).k_page
    n, h, d = k.shape
    pages = k.reshape(-1, bs, h, d).transpose(0, 2, 1, 3).reshape(-1, bs, d)  # [(page, head), bs, d]
    return (
        codec.dequantize_page(codec.quantize_page(pages), bs)
        .reshape(-1, h, bs, d)
        .transpose(0, 2, 1, 3)
        .reshape(n, h, d)
    )


def kpage_expected(fmt, k, bs):
    """K as the cache holds it: whole pages through the numpy page codec, the open page's tokens as f16 (every
    token passes through the cache's f16 tail first, so the pages quantize f16 values too)."""
    k = f16(k)
    full = k.shape[0] // bs * bs
    return np.concatenate([kpage_deq(fmt, k[:full], bs), k[full:]])


def kpage_bytes(fmt, k, bs):
    """The spec's bytes of the whole pages of k [n, H, D], pool layout [page, head, bs * row]."""
    codec = formats.get(fmt).k_page
    k = f16(k)
    n, h, d = k.shape
    pages = k[: n // bs * bs].reshape(-1, bs, h, d).transpose(0, 2, 1, 3).reshape(-1, bs, d)
    return codec.quantize_page(pages).reshape(-1, h, bs * d * codec.bits // 8 + 4 * d)


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
@pytest.mark.parametrize("bs", [16, 32])
def test_kivi_k_pages_store_bit_exact_and_load(fmt, bs):
    """Pages with the hard values along the channels (ties, zeros, constant and subnormal channels, .5 boundaries,
    near f16 max), stored in two calls, the last page left open in the cache's f16 tail."""
    rng = np.random.default_rng(bs)
    hard = hard_blocks(rng)  # [10, 64]
    n = 3 * bs + 5
    k = (rng.standard_normal((n, 2, 64)) * rng.uniform(0.01, 30, (1, 2, 64))).astype(np.float32)
    k[:10, 0], k[bs : bs + 10, 1] = hard, hard[::-1]  # channels of page 0 head 0, page 1 head 1
    k[2 * bs :, 1, 7] = 3.0  # a constant channel: d = 0
    k[2 * bs : 3 * bs, 0, :5] = 1e-40  # subnormal inputs
    k = np.clip(k, -60000, 60000)
    a, b = make(fmt, "q8_0", bs=bs)
    for c in (a, b):
        s = c.new_seq()
        c.store(s, 0, k[: bs + 3], -k[: bs + 3])
        c.store(s, 0, k[bs + 3 :], -k[bs + 3 :])
    for got, want in zip(pools(a), pools(b), strict=True):
        np.testing.assert_array_equal(got, want)
    blocks = np.asarray(a.block_ids(0)[:3])  # the three whole pages; the fourth is open (f16 tail)
    want = kpage_bytes(fmt, k, bs)  # the spec itself, independent of the reference backend
    np.testing.assert_array_equal(pools(a)[0][blocks].reshape(3, 2, -1), want)
    lk, lv = (kvhal.to_numpy(x) for x in a.load(0, 0))
    np.testing.assert_array_equal(lk, kpage_expected(fmt, k, bs))
    q8 = formats.get("q8_0")
    np.testing.assert_array_equal(lv[: 3 * bs], q8.dequantize(q8.quantize(f16(-k[: 3 * bs]))))
    np.testing.assert_array_equal(lv[3 * bs :], f16(-k[3 * bs :]))  # V of the open page stays f16 too


KPAGE_CASES = [
    # heads, kv heads, dim, fmt k, fmt v, seq lens, q lens, causal, window, block size
    (4, 2, 64, "kivi4", "kivi4", [700], [1], True, None, 16),  # split-KV decode, GQA, open last page
    (8, 2, 128, "kivi2", "kivi2", [96, 300, 5], [1, 1, 1], True, None, 32),  # 4 heads per decode CTA
    (4, 4, 64, "kivi4", "q8_0", [90, 64], [37, 64], True, None, 16),  # prefill tiles
    (6, 2, 96, "kivi2", "f16", [200, 33], [20, 1], True, 40, 16),  # prefill + decode, window, a group of 3
    (2, 1, 256, "kivi4", "kivi2", [130], [1], True, None, 32),  # largest head_dim
]


@pytest.mark.parametrize("case", range(len(KPAGE_CASES)))
@pytest.mark.parametrize("n_sm", [1, 64])
def test_attention_kivi_k(case, n_sm):
    """The attention kernels over per-channel K pages, called as an engine would, on whole pages (the cache
    itself attends its open page on the host): sequence lengths that end inside a page read only its first
    tokens, the page's scales being those of all its bs tokens."""
    hq, hkv, d, fk, fv, lens, qls, causal, window, bs = KPAGE_CASES[case]
    rng = np.random.default_rng(100 + case)
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=hkv, head_dim=d, k_format=fk, v_format=fv, block_size=bs)
    be = cuda_emulator.EmulatedCudaBackend(n_sm=n_sm)
    n_pages = [-(-n // bs) for n in lens]
    pools = be.allocate(spec, sum(n_pages) + 3)
    order = rng.permutation(sum(n_pages) + 3)[: sum(n_pages)]  # pages scattered over the pool
    table = np.zeros((len(lens), max(n_pages)), np.int32)
    ks, vs, start = [], [], 0
    for i, (n, p) in enumerate(zip(lens, n_pages, strict=True)):
        table[i, :p] = order[start : start + p]
        start += p
        k = rng.standard_normal((p * bs, hkv, d), dtype=np.float32)
        v = rng.standard_normal((p * bs, hkv, d), dtype=np.float32)
        slots = (table[i, :p, None].astype(np.int64) * bs + np.arange(bs)).ravel()
        for half in np.array_split(np.arange(p), 2):  # two stores, each of whole pages
            rows = (half[:, None] * bs + np.arange(bs)).ravel()
            be.store(pools, 0, be.asarray(k[rows], "k"), be.asarray(v[rows], "v"), slots[rows])
        ks.append(kpage_deq(fk, k, bs)[:n])
        vs.append(formats.get(fv).dequantize(formats.get(fv).quantize(v))[:n])
    q = rng.standard_normal((sum(qls), hq, d), dtype=np.float32)
    rt = be._rt
    rt.launches.clear()
    scale = float(d) ** -0.5
    batch = kvhal.AttentionBatch(table, np.array(lens, np.int32), np.array(qls, np.int32), scale, causal, window)
    out = be.to_numpy(be.attention(be.asarray(q, "q"), pools, 0, batch))
    want = attention_f64(q, ks, vs, qls, scale=scale, causal=causal, window=window)
    err = float(np.abs(out - want).max())
    assert err <= 2e-6, err
    names = {name for name, *_ in rt.launches}
    assert ("kvhal_attn_decode" in names) == (1 in qls)
    assert ("kvhal_attn_prefill" in names) == (max(qls) > 1)


@pytest.mark.parametrize("case", [0, 2, 3])
@pytest.mark.parametrize("n_sm", [1, 64])
def test_cache_attention_kivi_k_uses_the_kernels_for_its_pages(case, n_sm):
    """Through KVCache: the whole pages by the kernels (attention_lse, the kernels' own log-sum-exp), the open
    page's f16 tail on the host, merged; against float64 over K as the cache holds it."""
    hq, hkv, d, fk, fv, lens, qls, causal, window, bs = KPAGE_CASES[case]
    rng = np.random.default_rng(200 + case)
    a, _ = make(fk, fv, heads=hkv, dim=d, cap=sum(lens) + 4 * bs, n_sm=n_sm, bs=bs)
    ks, vs, seqs = [], [], []
    for n in lens:
        k, v = rng.standard_normal((n, hkv, d), dtype=np.float32), rng.standard_normal((n, hkv, d), dtype=np.float32)
        s = a.new_seq()
        a.store(s, 0, k[: n // 2], v[: n // 2])  # two stores: pages complete across calls
        a.store(s, 0, k[n // 2 :], v[n // 2 :])
        seqs.append(s)
        ks.append(kpage_expected(fk, k, bs))
        full = n // bs * bs  # the open page's V sits in the f16 tail as well
        fvq = formats.get(fv).dequantize(formats.get(fv).quantize(f16(v[:full])))
        vs.append(np.concatenate([fvq, f16(v[full:])]))
    q = rng.standard_normal((sum(qls), hq, d), dtype=np.float32)
    rt = a.backend._rt
    rt.launches.clear()
    out = kvhal.to_numpy(a.attention(0, q, seqs, qls, causal=causal, window=window))
    want = attention_f64(q, ks, vs, qls, causal=causal, window=window)
    err = float(np.abs(out - want).max())
    assert err <= 2e-6, err
    names = {name for name, *_ in rt.launches}
    assert "kvhal_attn_decode" in names or "kvhal_attn_prefill" in names
    assert "kvhal_load" not in names  # not the default attention_lse (float64 over load)


@pytest.mark.parametrize("n", [200, 600])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_lse_matches_float64_over_load(n, q_len):
    """The kernels' log-sum-exp against the default (backend_util.attention_lse: float64 over load): one split
    announced as two (200 tokens) and a sequence split on a wide device (600), merged on the host."""
    from kvhal.backend_util import attention_lse

    rng = np.random.default_rng(7)
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format="q8_0", v_format="q4_0", block_size=16)
    be = cuda_emulator.EmulatedCudaBackend(n_sm=64)
    pools = be.allocate(spec, 40)
    k = rng.standard_normal((n, 2, 64), dtype=np.float32)
    be.store(pools, 0, be.asarray(k, "k"), be.asarray(-k, "v"), np.arange(n, dtype=np.int64))
    table = np.arange(-(-n // 16), dtype=np.int32)[None]
    args = (pools, 0, kvhal.AttentionBatch(table, np.array([n], np.int32), np.array([q_len], np.int32), 0.125, False))
    q = rng.standard_normal((q_len, 4, 64), dtype=np.float32)
    be._rt.launches.clear()
    out, lse = be.attention_lse(be.asarray(q, "q"), *args)
    assert ("kvhal_attn_merge" in [name for name, *_ in be._rt.launches]) == (n > 256)  # MIN_SPLIT_TOKENS
    want_out, want_lse = attention_lse(be, q, *args)
    np.testing.assert_allclose(out, want_out, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=1e-6)
