"""cpu backend: every ISA level this machine runs, against the reference bytes and the float64 oracle.

The contract suite runs the default ISA; these tests force each level (``isa=`` option, the same
switch as ``KVHAL_CPU_ISA``), vary threads and KV splits, and cover the dispatch/env plumbing.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvhal
from kvhal import formats
from kvhal.backend_util import format_table
from tests.oracle import attention_f64

kvhal_cpu = pytest.importorskip("kvhal_cpu")
_abi = pytest.importorskip("kvhal_cpu._abi")
_cgen = pytest.importorskip("kvhal_cpu._cgen")
CpuBackend = kvhal_cpu.CpuBackend
ISAS = kvhal_cpu.available_isas()
# (isa, tile): AVX-512 has a 64- and a 128-token build, both forced here (which one tile 0 takes is
# test_tile_auto_picks_by_format_for_cache_resident_calls); the other ISAs have one
PATHS = [(isa, 0) for isa in ISAS if isa != "avx512"] + ([("avx512", 64), ("avx512", 128)] if "avx512" in ISAS else [])
PATH_IDS = [f"{isa}-tile{tile}" if tile else isa for isa, tile in PATHS]
FORMATS = sorted((f for f in CpuBackend.formats if not formats.get(f).side_data), key=formats.names().index)  # block kernels
F32_PATH_TOL = 1e-5  # scalar/avx2/neon and float formats dequantize to f32 and use FMA
INT_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # the AVX-512 integer kernels' formats
# the formats of the AVX-512 decode path's integer kernels (kern_avx512_decode.h: one query position,
# head_dim 128, a multiple of 4 query heads per KV head, pages of a multiple of 16 rows, K and V both of these;
# kivi K as its pages, V as rows: kivi4's are q4_1's)
DECODE_INT_FORMATS = ("q8_0", "q4_0", "q4_1", "mxfp4", "nvfp4", "kivi4", "kivi2")


def k_of(fmt: str) -> str:
    """The K format a test pairs with ``fmt`` as V: itself, or f16 where ``fmt`` stores K per channel
    over whole pages (kivi), whose pages test_paged_k_pages_and_attention covers."""
    return "f16" if formats.get(fmt).k_page is not None else fmt


def awkward(rng: np.random.Generator, n: int, heads: int, dim: int) -> np.ndarray:
    """Random rows plus blocks that hit the quantizers' edge cases."""
    x = rng.standard_normal((n, heads, dim), dtype=np.float32)
    x[:, :, 3] *= 8
    flat = x.reshape(-1, 32)
    flat[0] = 0.0  # d = 0
    flat[1] = np.float32(1e-41) * np.arange(32)  # subnormal d: 1/d overflows, ggml gives id = 0
    flat[2] = np.linspace(-127, 127, 32).round() + 0.5  # q8_0 ties once d = 1
    flat[2, 0] = 127.0
    flat[3] = np.arange(32) - 8.0  # q4_0 d = -8/-8 = 1: exact x*id + 8.5 ties
    flat[4] = np.float32(60000.0) * np.linspace(-1, 1, 32)  # near the fp16 limit
    flat[5] = 1.0  # min == max
    return x


def cache(
    fmt: str,
    backend: kvhal.Backend | str,
    heads: int = 2,
    dim: int = 64,
    bs: int = 16,
    cap: int = 256,
    vfmt: str | None = None,
) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(
        n_layers=1, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=vfmt or fmt, block_size=bs
    )
    return kvhal.KVCache(spec, cap, backend=backend)


def pools(c: kvhal.KVCache) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(c.pools.k[0]).view(np.uint8), np.asarray(c.pools.v[0]).view(np.uint8)


def takes_decode_path(n_heads: int, n_kv: int, dim: int, q_lens: list[int], bs: int) -> bool:
    """Whether some item of such a call (a sequence with one query) meets the AVX-512 decode path's shape,
    its formats aside."""
    return 1 in q_lens and dim == 128 and (n_heads // n_kv) % 4 == 0 and bs % 16 == 0


def path_tolerance(isa: str, kf: str, vf: str, decode_path: bool = False) -> float:
    """The integer kernels run on AVX-512 when K or V is quantized (``decode_path``: a call the decode
    path takes, where mxfp4/nvfp4 run them too); every other path computes in f32."""
    quantized = kf in INT_FORMATS or vf in INT_FORMATS or vf == "kivi4"  # kivi4 V rows are q4_1's bytes and kernels
    quantized |= decode_path and kf in DECODE_INT_FORMATS and vf in DECODE_INT_FORMATS
    return CpuBackend.INT_TOLERANCE if isa in ("avx512", "amx") and quantized else F32_PATH_TOL


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_load_bytes_identical_per_isa(isa, fmt):
    rng = np.random.default_rng(7)
    k, v = awkward(rng, 41, 2, 64), awkward(rng, 41, 2, 64)[::-1].copy()
    kf = k_of(fmt)
    ours, ref = cache(kf, CpuBackend(isa=isa), vfmt=fmt), cache(kf, "reference", vfmt=fmt)
    for c in (ours, ref):
        s = c.new_seq()
        c.store(s, 0, k[:1], v[:1])
        c.store(s, 0, k[1:], v[1:])
    for got, want in zip(pools(ours), pools(ref), strict=True):
        np.testing.assert_array_equal(got, want)
    f, fk = formats.get(fmt), formats.get(kf)
    k2, v2 = ours.load(0, 0)
    np.testing.assert_array_equal(k2, fk.dequantize(fk.quantize(k)))
    np.testing.assert_array_equal(v2, f.dequantize(f.quantize(v)))


def make_kv(
    rng: np.random.Generator, fmt: str, lens: list[int], heads: int, dim: int, c: kvhal.KVCache, vfmt: str | None = None
):
    fk, fv = formats.get(fmt), formats.get(vfmt or fmt)
    seqs, ks, vs = [], [], []
    for n in lens:
        k = rng.standard_normal((n, heads, dim), dtype=np.float32)
        v = rng.standard_normal((n, heads, dim), dtype=np.float32)
        k[:, :, 3] *= 8
        s = c.new_seq()
        c.store(s, 0, k, v)
        seqs.append(s)
        ks.append(fk.dequantize(fk.quantize(k)))
        vs.append(fv.dequantize(fv.quantize(v)))
    return seqs, ks, vs


# (n_heads, n_kv_heads, dim, seq lens, q lens, causal, window, block_size)
SHAPES = {
    "decode-gqa8-d128": (64, 8, 128, [300], [1], True, None, 16),
    "decode-gqa4-d128-bench-shape": (32, 8, 128, [333, 64], [1, 1], True, None, 16),  # the fused decode kernels
    # the AVX-512 decode fast path (kern_avx512_decode.h): a window that starts mid-group, pages of
    # 32 and 64 rows, lengths around the 16-row groups and 64-token tiles
    "decode-d128-window-mid-group": (32, 8, 128, [300, 77], [1, 1], True, 45, 16),
    "decode-d128-gqa8-bs32": (16, 2, 128, [129, 1, 16], [1, 1, 1], True, None, 32),
    "decode-d128-bs64-edges": (8, 2, 128, [65, 15, 64, 200], [1, 1, 1, 1], True, None, 64),
    "prefill-gqa4-d128": (8, 2, 128, [90], [20], True, None, 16),
    "12-kv-heads-two-groups": (24, 12, 64, [150, 3], [2, 1], True, 100, 4),  # items split the heads 6 + 6
    "prefill-chunks-window": (8, 2, 64, [150, 40], [70, 40], True, 33, 8),
    "ragged-mqa-d256": (4, 1, 256, [5, 97, 1], [1, 2, 1], True, None, 32),
    "non-causal-bs7": (6, 3, 96, [61], [9], False, None, 7),
}


@pytest.mark.parametrize("isa,tile", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_per_isa(isa, tile, fmt, shape):
    n_heads, n_kv, dim, lens, q_lens, causal, window, bs = SHAPES[shape]
    if dim % formats.get(fmt).block_len:
        pytest.skip(f"{fmt} needs head_dim % {formats.get(fmt).block_len} == 0")
    rng = np.random.default_rng(11)
    kf = k_of(fmt)
    # small splits (times 2-4 for the prefill items' rows): the merge runs in every shape
    be = CpuBackend(isa=isa, kv_split=32, tile=tile)
    c = cache(kf, be, heads=n_kv, dim=dim, bs=bs, cap=sum(lens) + bs * len(lens), vfmt=fmt)
    seqs, ks, vs = make_kv(rng, kf, lens, n_kv, dim, c, vfmt=fmt)
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
    out = c.attention(0, q, seqs, q_lens, causal=causal, window=window)
    want = attention_f64(q, ks, vs, q_lens, causal=causal, window=window)
    decode_path = takes_decode_path(n_heads, n_kv, dim, q_lens, bs)
    assert float(np.abs(out - want).max()) <= path_tolerance(isa, kf, fmt, decode_path)


@pytest.mark.parametrize("kf,vf", [("q8_0", "f16"), ("bf16", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "q8_0")])
def test_mixed_formats_all_isas(kf, vf):
    rng = np.random.default_rng(3)
    for isa in ISAS:
        c = cache(kf, CpuBackend(isa=isa), heads=2, dim=64, cap=256, vfmt=vf)
        seqs, ks, vs = make_kv(rng, kf, [90], 2, 64, c, vfmt=vf)
        q = rng.standard_normal((3, 8, 64), dtype=np.float32)
        err = np.abs(c.attention(0, q, seqs, [3]) - attention_f64(q, ks, vs, [3])).max()
        assert err <= path_tolerance(isa, kf, vf), isa


@pytest.mark.parametrize("kf", ["kltq:4.5", "kltq:7", "q4_0"])
def test_kltq_v_all_isas(kf):
    """kltq V (beside kltq K, whose heads at 7 bits take the key-at-a-time kernel, or block K) on every ISA
    level: V records byte for byte the reference's, and attention (decode and 3 causal rows, 4 query heads per
    KV head) over the loaded K/V within the level's tolerance of float64. V's spectrum decays so its widths span
    0 to over 5 (both level lookups of the AVX-512 V decode)."""
    rng = np.random.default_rng(11)
    d = 128
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    k = ((rng.standard_normal((100, 2, d)) * 8 * np.exp(-np.arange(d) / 16)) @ basis.T).astype(np.float32)
    v = ((rng.standard_normal((100, 2, d)) * 4 * np.exp(-np.arange(d) / 24)) @ basis.T + 1).astype(np.float32)
    spec = kvhal.CacheSpec(1, 2, d, k_format=kf, v_format="kltq:5")
    ref = kvhal.KVCache(spec, 128, backend="reference")
    s = ref.new_seq()
    ref.store(s, 0, k, v)
    alloc = ref.resolved_spec.v_side.alloc
    assert int(alloc.min()) == 0 and int(alloc.max()) > 5
    calibrated = ref.resolved_spec  # the same side data (calibrated once): the cpu's records must match byte for byte
    for isa in ISAS:
        c = kvhal.KVCache(calibrated, 128, backend=CpuBackend(isa=isa))
        t = c.new_seq()
        c.store(t, 0, k, v)
        np.testing.assert_array_equal(c.load_rows(t, 0)[1], ref.load_rows(s, 0)[1])
        kl, vl = (kvhal.to_numpy(x) for x in c.load(t, 0))
        for n_q in (1, 3):
            q = rng.standard_normal((n_q, 8, d), dtype=np.float32)
            err = np.abs(kvhal.to_numpy(c.attention(0, q, [t])) - attention_f64(q, [kl], [vl], [n_q])).max()
            assert err <= c.backend.tolerance(n_q) + 1e-5, isa


@pytest.mark.parametrize(
    "kf,vf",
    [
        ("q8_0", "q4_0"),
        ("q4_0", "q8_0"),
        ("mxfp4", "nvfp4"),
        ("nvfp4", "q8_0"),
        ("q4_0", "mxfp4"),
        ("q4_0", "q4_1"),
        ("q4_1", "q4_1"),
        ("q4_1", "nvfp4"),
    ],
)
@pytest.mark.parametrize("split", [0, 100])
def test_decode_fast_path_mixed_formats(kf, vf, split):
    """Decode with head_dim 128 and GQA 4 (the AVX-512 fast path where it runs), K and V in different
    formats, slices that start mid-group (split 100), against float64 and the AVX2 kernels."""
    rng = np.random.default_rng(21)
    q = rng.standard_normal((4, 16, 128), dtype=np.float32)
    outs = {}
    for isa, tile in PATHS:
        c = cache(kf, CpuBackend(isa=isa, kv_split=split, tile=tile), heads=4, dim=128, cap=1400, vfmt=vf)
        seqs, ks, vs = make_kv(np.random.default_rng(4), kf, [700, 1, 17, 450], 4, 128, c, vfmt=vf)
        outs[isa, tile] = c.attention(0, q, seqs, [1, 1, 1, 1], window=None if split else 300)
        want = attention_f64(q, ks, vs, [1, 1, 1, 1], window=None if split else 300)
        assert float(np.abs(outs[isa, tile] - want).max()) <= c.backend.attention_tolerance, (isa, tile)
    for path, out in outs.items():
        assert float(np.abs(out - outs[PATHS[0]]).max()) <= 2 * CpuBackend.INT_TOLERANCE, path


@pytest.mark.parametrize("isa,tile", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(
    "kf,vf", [("kivi4", "kivi4"), ("kivi4", "q8_0"), ("kivi4", "nvfp4"), ("kivi4", "f16"), ("kivi2", "kivi2"),
              ("kivi2", "q4_0"), ("kivi4", "kivi2"), ("q8_0", "kivi2")]
)  # fmt: skip
@pytest.mark.parametrize("shape", [name for name in SHAPES if name.startswith("decode")])
@pytest.mark.parametrize("seed", [12, 13, 14])  # 13: the worst case over 12 seeds (2.7e-4); 14: an uncentred prep 3.7e-4
def test_kivi_k_decode(isa, tile, kf, vf, shape, seed):
    """kivi4/kivi2 K (per-channel pages, the AVX-512 decode path where it runs: q times each page's d, one
    integer sum per token) against float64 over the values load gives, the open page's f16 tail included:
    pages of 16-64 rows, GQA 4 and 8, windows starting mid-group, V of every decode-path kind (kivi4's
    is q4_1's; kivi2's 2-bit rows, also under q8_0 K) and f16 (the general kernels). The integer path keeps
    ~1e-4 of the f32 result as the other formats' (edge-case blocks near the fp16 limit are
    test_paged_k_pages_and_attention's)."""
    n_heads, n_kv, dim, lens, q_lens, causal, window, bs = SHAPES[shape]
    rng = np.random.default_rng(seed)
    be = CpuBackend(isa=isa, kv_split=32, tile=tile)
    c = cache(kf, be, heads=n_kv, dim=dim, bs=bs, cap=sum(lens) + bs * len(lens), vfmt=vf)
    seqs = []
    for n in lens:
        k = rng.standard_normal((n, n_kv, dim), dtype=np.float32)
        k[:, :, 3] *= 8  # an outlier channel (a large d in its block) and an offset one (a large m)
        k[:, :, 70] += 20
        seqs.append(c.new_seq())
        c.store(seqs[-1], 0, k, rng.standard_normal((n, n_kv, dim), dtype=np.float32))
    kv = [tuple(kvhal.to_numpy(x) for x in c.load(s, 0)) for s in seqs]
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
    want = attention_f64(q, [k for k, _ in kv], [v for _, v in kv], q_lens, causal=causal, window=window)
    out = c.attention(0, q, seqs, q_lens, causal=causal, window=window)
    assert float(np.abs(out - want).max()) <= c.backend.attention_tolerance


@pytest.mark.skipif("avx512" not in ISAS, reason="only the AVX-512 kernels have two tile sizes")
@pytest.mark.parametrize(
    "kf,vf,auto", [("q4_0", "q4_0", 128), ("q8_0", "q5_1", 128), ("f16", "f16", 64), ("q8_0", "bf16", 64)]
)
def test_tile_auto_picks_by_format_for_cache_resident_calls(kf, vf, auto):
    """tile 0 picks the 128-token build for quantized K and V when K/V fits in a third of the L3 (every
    call here does), else 64: the same bits as that tile, and within tolerance of the other one."""
    q = np.random.default_rng(6).standard_normal((2, 32, 128), dtype=np.float32)
    outs = {}
    for tile in (0, 64, 128):
        c = cache(kf, CpuBackend(isa="avx512", tile=tile), heads=8, dim=128, cap=1200, vfmt=vf)
        seqs, ks, vs = make_kv(np.random.default_rng(8), kf, [900, 200], 8, 128, c, vfmt=vf)
        outs[tile] = c.attention(0, q, seqs, [1, 1])
    np.testing.assert_array_equal(outs[0], outs[auto])
    assert 0 < float(np.abs(outs[64] - outs[128]).max()) <= CpuBackend.INT_TOLERANCE


@pytest.mark.skipif("avx512" not in ISAS, reason="only the AVX-512 kernels have two tile sizes")
def test_tile_auto_picks_128_for_quantized_prefill():
    """Calls with prefill items (more than 128 query rows) take the 128-token build for quantized K and V
    even when what the items read outgrows a third of the L3 (4 query chunks x 2000 tokens x 17 KB here,
    17 MB), where decode takes 64: the same bits as tile 128."""
    q = np.random.default_rng(12).standard_normal((128, 32, 128), dtype=np.float32)
    outs = {}
    for tile in (0, 64, 128):
        c = cache("q8_0", CpuBackend(isa="avx512", tile=tile), heads=8, dim=128, cap=2100)
        seqs, _, _ = make_kv(np.random.default_rng(8), "q8_0", [2000], 8, 128, c)
        outs[tile] = c.attention(0, q, seqs, [128])
    np.testing.assert_array_equal(outs[0], outs[128])
    assert 0 < float(np.abs(outs[64] - outs[128]).max()) <= CpuBackend.INT_TOLERANCE


def test_tile_option_is_checked(monkeypatch):
    for bad in (32, 256, -1):
        with pytest.raises(kvhal.SpecError, match="option tile=.* must be one of 0, 64, 128"):
            CpuBackend(tile=bad)
    for bad in (True, 64.0, "64"):
        with pytest.raises(kvhal.SpecError, match="option tile must be int"):
            CpuBackend(tile=bad)
    monkeypatch.setenv("KVHAL_CPU_TILE", "64")
    assert CpuBackend().tile == 64 and CpuBackend(tile=128).tile == 128
    monkeypatch.setenv("KVHAL_CPU_TILE", "big")
    with pytest.raises(kvhal.SpecError, match="KVHAL_CPU_TILE"):
        CpuBackend()


@pytest.mark.parametrize(
    "options,match",
    [
        ({"thread": 2}, "no option thread; the options it takes: isa, kv_split, threads, tile"),
        ({"threads": -1}, "threads=-1 must be >= 0"),
        ({"threads": 2.0}, "threads must be int"),
        ({"threads": 2**32 + 1}, "threads=4294967297 must be below 2\\*\\*31"),  # not 1 thread: kv_args is int32
        ({"kv_split": 2**31}, "kv_split=2147483648 must be below 2\\*\\*31"),
        ({"kv_split": "big"}, "kv_split must be int"),
        ({"isa": "sse9"}, "isa='sse9' must be one of auto, scalar, avx2, avx512, neon, amx"),
        ({"isa": 2}, "isa must be str"),
    ],
)
def test_bad_options_are_spec_errors_naming_the_option(options, match):
    with pytest.raises(kvhal.SpecError, match=match):
        CpuBackend(**options)
    with pytest.raises(kvhal.SpecError, match=match):  # the same through KVCache
        kvhal.KVCache(kvhal.CacheSpec(1, 2, 64, "q8_0", "q8_0"), 64, backend="cpu", backend_options=options)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "f16"])
def test_thread_count_does_not_change_results(fmt):
    """Slices depend on shapes only, so any thread count gives the same bits."""
    q = np.random.default_rng(5).standard_normal((3, 16, 128), dtype=np.float32)
    outs = []
    for threads in (1, 2, 3, 5):
        c = cache(fmt, CpuBackend(threads=threads, kv_split=128), heads=4, dim=128, cap=1200)
        seqs, _, _ = make_kv(np.random.default_rng(9), fmt, [700, 300, 33], 4, 128, c)
        outs.append(c.attention(0, q, seqs, [1, 1, 1]))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("n_heads", [12, 32])  # GQA 3 (row blocks of 4 end part-full) and 4
def test_float_prefill_matches_float64_at_any_thread_count(isa, fmt, n_heads):
    """Prefill of the float formats (AVX-512: rows converted into L1 once for more than 8 rows per KV
    head, straight from the page for fewer) against the float64 oracle, the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(21)
    lens, q_lens = [300, 70], [40, 3]
    q = rng.standard_normal((sum(q_lens), n_heads, 128), dtype=np.float32)
    outs = []
    for threads in (1, 2):
        c = cache(fmt, CpuBackend(isa=isa, threads=threads), heads=4, dim=128, bs=16, cap=420)
        seqs, ks, vs = make_kv(np.random.default_rng(3), fmt, lens, 4, 128, c)
        outs.append(c.attention(0, q, seqs, q_lens))
    np.testing.assert_array_equal(outs[1], outs[0])
    want = attention_f64(q, ks, vs, q_lens, causal=True, window=None)
    assert float(np.abs(outs[0] - want).max()) <= path_tolerance(isa, fmt, fmt)


@pytest.mark.parametrize("k_format", ["q8_0", "kltq:4.5"])
def test_a_window_past_int32_is_no_window(k_format):
    """kvhal takes windows up to 2**62; the kernels' window is an int32, so a larger one must cover every key, not
    wrap (2**32 + 1 read as 1), also through observe's attention mass and csrc/kltq.c."""
    rng = np.random.default_rng(4)
    c = kvhal.KVCache(kvhal.CacheSpec(1, 2, 64, k_format=k_format, v_format="q8_0"), 64, backend=CpuBackend())
    s = c.new_seq()
    c.store(s, 0, *(rng.standard_normal((40, 2, 64), dtype=np.float32) for _ in range(2)))
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    want = c.attention(0, q, [s])
    for window in (2**31, 2**32 + 1, 2**62):
        np.testing.assert_array_equal(c.attention(0, q, [s], window=window), want)
        np.testing.assert_array_equal(c.attention(0, q, [s], window=window, observe=True), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "bf16"])
def test_split_kv_merge_matches_unsplit(isa, fmt):
    rng = np.random.default_rng(13)
    q = rng.standard_normal((5, 8, 64), dtype=np.float32)
    res = {}
    for split in (0, 32, 100, 1024):
        c = cache(fmt, CpuBackend(isa=isa, kv_split=split), heads=2, dim=64, cap=2200)
        seqs, ks, vs = make_kv(np.random.default_rng(2), fmt, [2000, 64], 2, 64, c)
        res[split] = c.attention(0, q, seqs, [4, 1], window=1500)
    want = attention_f64(q, ks, vs, [4, 1], window=1500)
    tol = path_tolerance(isa, fmt, fmt)
    for split, out in res.items():
        assert float(np.abs(out - want).max()) <= tol, split
        assert float(np.abs(out - res[0]).max()) <= tol, split


def mass_f64(q, ks, q_lens, scale, causal, window, holes, tail):
    """Per sequence, the float64 softmax weight each key received, summed over each KV head's query heads:
    ``(all queries, the last tail)``, each ``[n_kv_heads, n]``; ``holes[s, h]``: keys KV head h does not attend."""
    out, start = [], 0
    for s, (k, n_q) in enumerate(zip(ks, q_lens)):
        n, heads = k.shape[:2]
        group = q.shape[1] // heads
        qs = q[start : start + n_q].astype(np.float64)
        start += n_q
        sc = np.einsum("qhd,khd->hqk", qs, np.repeat(k.astype(np.float64), group, axis=1)) * scale
        pos, j = n - n_q + np.arange(n_q)[:, None], np.arange(n)[None]
        vis = np.broadcast_to((j <= pos) if causal else np.ones((n_q, n), bool), (len(sc), n_q, n)).copy()
        if window:
            vis &= j > pos - window
        if holes is not None:
            for h in range(len(sc)):
                vis[h] &= ~((j >= holes[s, h // group, 0]) & (j < holes[s, h // group, 1]))
        sc = np.where(vis, sc, -np.inf)
        m = sc.max(-1, keepdims=True)
        p = np.exp(sc - np.where(np.isfinite(m), m, 0.0))
        p = np.divide(p, p.sum(-1, keepdims=True), out=np.zeros_like(p), where=p.sum(-1, keepdims=True) > 0)
        per_kv = p.reshape(heads, group, n_q, n).sum(1)
        out.append((per_kv.sum(1), per_kv[:, max(0, n_q - tail) :].sum(1)))
    return out

def check_mass_against_f64(be, q, pools, batch, tail, ks, shape):
    """The backend's fused mass (its own lse passed in) against ``mass_f64`` over the keys ``ks``, per sequence,
    to 1e-4; returns (got, want)."""
    _, lse = be.attention_lse(q, pools, 0, batch)
    got = be.attention_mass(q, pools, 0, batch, tail, lse)
    want = mass_f64(q, ks, list(batch.q_lens), batch.scale, batch.causal, batch.window, batch.holes, tail)
    for (total, last), (want_total, want_last) in zip(got, want, strict=True):
        np.testing.assert_allclose(total, want_total, rtol=1e-4, atol=1e-5, err_msg=shape)
        np.testing.assert_allclose(last, want_last, rtol=1e-4, atol=1e-5, err_msg=shape)
    return got, want


# (n_heads, n_kv_heads, dim, seq lens, q lens, causal, window, block_size, tail, holes [n_seqs][n_kv_heads] or None)
MASS_SHAPES = {
    "prefill-and-chunk-gqa3": (6, 2, 64, [301, 70], [301, 9], True, None, 16, 24, None),
    "window-tail-past-q": (8, 2, 64, [150, 40], [70, 40], True, 33, 8, 50, None),
    "non-causal-bs7-d96": (6, 3, 96, [61], [9], False, None, 7, 4, None),
    # a hole over a whole 64-key tile and parts of others; a row whose window lies in its head's hole sees nothing
    "holes-window": (8, 2, 64, [200, 90], [50, 90], True, 30, 16, 16, [[[10, 150], [0, 0]], [[0, 0], [50, 90]]]),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_mass_matches_float64_softmax(isa, fmt):
    """The fused mass (kvc_attention_mass, from the kernel's own lse) against a float64 softmax over the
    dequantized K, in every mask, GQA ratio, batch and hole case; each query row's weights sum to 1."""
    kf = k_of(fmt)
    for shape, (n_heads, n_kv, dim, lens, q_lens, causal, window, bs, tail, holes) in MASS_SHAPES.items():
        if dim % formats.get(fmt).block_len:
            continue
        rng = np.random.default_rng(5)
        be = CpuBackend(isa=isa, threads=2)
        c = cache(kf, be, heads=n_kv, dim=dim, bs=bs, cap=sum(lens) + bs * len(lens), vfmt=fmt)
        seqs, ks, _ = make_kv(rng, kf, lens, n_kv, dim, c, vfmt=fmt)
        objs = [c.seq_table.get(s) for s in seqs]
        table = c.seq_table.batch_table(objs, [-(-n // bs) for n in lens])
        hole_arr = None if holes is None else np.asarray(holes, np.int32)
        batch = kvhal.AttentionBatch(table, np.array(lens), np.array(q_lens), dim**-0.5, causal, window, hole_arr)
        q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
        got, want = check_mass_against_f64(be, q, c.pools, batch, tail, ks, shape)
        assert got[0][0].sum() == pytest.approx(want[0][0].sum(), rel=1e-5)
        if holes is None:  # without holes every row sees a key: its weights sum to 1
            assert sum(t.sum() for t, _ in got) == pytest.approx(sum(q_lens) * n_heads, rel=1e-5)
        # lse=None: the call runs the kernel for it
        np.testing.assert_array_equal(be.attention_mass(q, c.pools, 0, batch, tail)[0][0], got[0][0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if formats.get(f).k_page is not None])
def test_attention_mass_of_kivi_k_pages_matches_float64_softmax(isa, fmt):
    """The fused mass over per-channel K pages (kivi; kpage_rows as attention reads them) against a float64
    softmax over the reference backend's dequantized pages, in the MASS_SHAPES masks over each sequence's
    whole pages (the open page is the cache's f16 tail, not the pool's)."""
    for shape, (n_heads, n_kv, dim, lens, q_lens, causal, window, bs, tail, holes) in MASS_SHAPES.items():
        rng = np.random.default_rng(5)
        bs = bs if 4 * dim % bs == 0 else 8  # a kivi page's block_size divides 4 * head_dim
        pages = [n // bs * bs for n in lens]
        q_lens = [min(m, p) for m, p in zip(q_lens, pages)]
        spec = kvhal.CacheSpec(1, n_kv, dim, fmt, "q8_0", bs)
        cap = sum(lens) + bs * len(lens)
        ours, ref = (kvhal.KVCache(spec, cap, backend=b) for b in (CpuBackend(isa=isa), "reference"))
        ks = []
        for n in lens:
            k, v = rng.standard_normal((2, n, n_kv, dim), dtype=np.float32)
            k[:, :, 3] *= 8
            for c in (ours, ref):
                s = c.new_seq()
                c.store(s, 0, k, v)
            ks.append(kvhal.to_numpy(ref.load(s, 0, 0, n // bs * bs)[0]))
        objs = [ours.seq_table.get(s) for s in range(len(lens))]
        table = ours.seq_table.batch_table(objs, [p // bs for p in pages])
        hole_arr = None if holes is None else np.asarray(holes, np.int32)
        batch = kvhal.AttentionBatch(table, np.array(pages), np.array(q_lens), dim**-0.5, causal, window, hole_arr)
        q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
        check_mass_against_f64(ours.backend, q, ours.pools, batch, tail, ks, shape)


def test_attention_mass_checks_lse_shape():
    be = CpuBackend()
    c = cache("q8_0", be)
    s = c.new_seq()
    c.store(s, 0, np.ones((20, 2, 64), np.float32), np.ones((20, 2, 64), np.float32))
    batch = kvhal.AttentionBatch(
        c.seq_table.batch_table([c.seq_table.get(s)], [2]), np.array([20]), np.array([3]), 0.125
    )
    with pytest.raises(kvhal.ShapeError, match="attention_lse"):
        be.attention_mass(np.ones((3, 4, 64), np.float32), c.pools, 0, batch, 2, np.zeros((3, 2)))


def test_probe_scores_above_reference_and_wins_auto():
    infos = {i.name: i for i in kvhal.backends()}
    assert infos["cpu"].available and infos["cpu"].score == 50 > infos["reference"].score
    c = kvhal.KVCache(kvhal.CacheSpec(1, 2, 64, "q8_0", "q8_0"), 64)
    assert c.backend.name == "cpu"


def test_env_isa_and_threads(monkeypatch):
    monkeypatch.setenv("KVHAL_CPU_THREADS", "3")
    monkeypatch.setenv("KVHAL_CPU_ISA", "scalar")
    be = CpuBackend()
    assert be.threads == 3 and be.isa == "scalar"
    assert CpuBackend(threads=2, isa=ISAS[-1]).threads == 2  # an argument beats its variable
    monkeypatch.setenv("KVHAL_CPU_ISA", "sse9")
    probe = CpuBackend.probe()
    assert probe.score is None and "sse9" in probe.reason and "KVHAL_CPU_ISA" in probe.reason and probe.misconfigured
    with pytest.raises(kvhal.SpecError, match="sse9"):
        CpuBackend()
    spec = kvhal.CacheSpec(1, 2, 64, "q8_0", "q8_0")
    for var, value in (("KVHAL_CPU_ISA", "sse9"), ("KVHAL_CPU_THREADS", "many"), ("KVHAL_CPU_ISA", "neon")):
        if value == "neon" and "neon" in ISAS:
            continue
        with monkeypatch.context() as m:  # "auto" does not fall to the reference backend without a word
            m.setenv(var, value)
            if var != "KVHAL_CPU_ISA":
                m.setenv("KVHAL_CPU_ISA", "auto")
            with pytest.raises(kvhal.SpecError, match=f"set up wrongly.*{var}"):
                kvhal.KVCache(spec, 64)
    assert kvhal.KVCache(spec, 64, backend="reference").backend.name == "reference"  # named: it runs
    missing = [i for i in kvhal_cpu.ISAS if i not in ISAS]
    if missing:
        with pytest.raises(kvhal.BackendUnavailableError, match="runs only"):
            CpuBackend(isa=missing[0])
    monkeypatch.setenv("KVHAL_CPU_ISA", "auto")
    monkeypatch.setenv("KVHAL_CPU_THREADS", "many")
    with pytest.raises(kvhal.SpecError, match="KVHAL_CPU_THREADS"):
        CpuBackend()
    monkeypatch.setenv("KVHAL_CPU_THREADS", "0")  # 0: every core
    assert CpuBackend().threads == (os.cpu_count() or 1)


@pytest.mark.parametrize("isa", ISAS)
def test_env_isa_selects_each_level(monkeypatch, isa):
    monkeypatch.setenv("KVHAL_CPU_ISA", isa)
    spec = kvhal.CacheSpec(1, 2, 64, "q4_1", "q8_0")
    c = kvhal.KVCache(spec, 64, backend=CpuBackend())
    assert c.backend.isa == isa
    rng = np.random.default_rng(4)
    k, v = awkward(rng, 20, 2, 64), awkward(rng, 20, 2, 64)
    ref = kvhal.KVCache(spec, 64, backend="reference")
    for x in (c, ref):
        x.store(x.new_seq(), 0, k, v)
    for got, want in zip(pools(c), pools(ref), strict=True):
        np.testing.assert_array_equal(got, want)
    # backend="auto" uses the process's shared instance, which reads the variable when it is made
    code = "import kvhal; print(kvhal.KVCache(kvhal.CacheSpec(1, 2, 64, 'q4_1', 'q8_0'), 64).backend.isa)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [isa]


def test_best_isa_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVHAL_CPU_ISA", raising=False)  # the suite also runs with the ISA forced
    assert CpuBackend().isa == kvhal_cpu.best_isa() == ISAS[-1]


@pytest.mark.parametrize("bad", [np.inf, np.nan, 70000.0])
def test_fast_value_check_raises_the_canonical_error(bad):
    c = cache("q8_0", CpuBackend())
    k = np.ones((3, 2, 64), np.float32)
    k[1, 1, 5] = bad
    with pytest.raises(kvhal.NonFiniteError):
        c.store(c.new_seq(), 0, k, np.ones_like(k))
    c.store(c.new_seq(), 0, np.full((3, 2, 64), 65000.0, np.float32), np.ones_like(k))  # fits fp16


def _child(q: mp.Queue) -> None:
    c = cache("q4_0", CpuBackend(threads=2, kv_split=32), heads=2, dim=64, cap=256)
    seqs, _, _ = make_kv(np.random.default_rng(1), "q4_0", [200], 2, 64, c)
    q.put(float(np.abs(c.attention(0, np.ones((1, 4, 64), np.float32), seqs, [1])).sum()))


def test_thread_pool_survives_fork():
    c = cache("q4_0", CpuBackend(threads=2, kv_split=32), heads=2, dim=64, cap=256)
    seqs, _, _ = make_kv(np.random.default_rng(1), "q4_0", [200], 2, 64, c)
    parent = float(np.abs(c.attention(0, np.ones((1, 4, 64), np.float32), seqs, [1])).sum())  # pool running
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(out,))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and out.get(timeout=5) == pytest.approx(parent, rel=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_instance_tolerance_covers_every_path_of_its_isa(isa):
    """One instance serves every spec, so it declares the loosest figure of its ISA's kernels."""
    be = CpuBackend(isa=isa)
    assert be.attention_tolerance == (CpuBackend.INT_TOLERANCE if isa in ("avx512", "amx") else F32_PATH_TOL)
    for kf, vf in (("q8_0", "q8_0"), ("f16", "bf16"), ("f16", "q4_0")):
        assert path_tolerance(isa, kf, vf) <= be.attention_tolerance


NATIVE = Path(__file__).parent / "native" / "isa_check.c"
CSRC = Path(kvhal_cpu.__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))  # the translation units setup.py builds


def _build_and_run(cc: str, runner: list[str], tmp_path: Path) -> str:
    exe = tmp_path / "isa_check"
    flags = ["-O2", "-std=c11", "-ffp-contract=off", "-pthread"]
    subprocess.run([cc, *flags, str(NATIVE), *map(str, SOURCES), "-lm", "-o", str(exe)], check=True)
    done = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_native_isa_check_on_this_cpu(tmp_path):
    """The C sources on their own: every ISA this CPU runs against the scalar baseline."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    assert "0 failures" in _build_and_run(cc, [], tmp_path)


def test_neon_kernels_under_qemu(tmp_path):
    """The NEON translation unit, cross-compiled and run under qemu-aarch64 ([tool.kvhal] apt has both)."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        pytest.skip("needs gcc-aarch64-linux-gnu and qemu-user (Debian)")
    out = _build_and_run(cc, [qemu, "-L", "/usr/aarch64-linux-gnu"], tmp_path)
    paged = [f for f in FORMATS if formats.get(f).k_page is not None]  # checked twice: K rows, then K pages
    assert f"{len(FORMATS) + len(paged)} format x isa combinations checked, 0 failures" in out


def test_library_struct_layout_matches_python():
    """kv_args as the compiled library lays it out (kvc_args_layout) is what _abi.Args writes."""
    lib, _ = kvhal_cpu._library()
    got = _abi.library_layout(lib).split(";")
    assert got == _abi.layout().split(";")
    assert got[0] == f"kv_args {ctypes.sizeof(_abi.Args)}" and len(got) == 1 + len(_abi.Args._fields_)
    assert got[1] == "isa 0 4 i" and got[-1].startswith("scale ") and got[-1].endswith(" 4 f")
    offsets = [int(f.split()[1]) for f in got[1:]]
    assert offsets == sorted(offsets)


def test_kernel_formats_come_from_the_registry():
    """The committed csrc/formats.h is the registry's table, and the library was built from it."""
    assert _cgen.HEADER.read_text() == _cgen.render(), "csrc/formats.h is stale: run python -m kvhal_cpu._cgen"
    lib, runs = kvhal_cpu._library()
    table = {fid: (block_len, block_bytes) for name, fid, block_len, block_bytes in format_table() if name in runs}
    assert _abi.library_formats(lib) == table
    assert runs == frozenset(FORMATS) == CpuBackend.formats - {f for f in formats.names() if formats.get(f).side_data}
    assert all(CpuBackend().supports(kvhal.CacheSpec(1, 2, 64, k_format=f, v_format="q8_0"), "attention") is None
               for f in CpuBackend.formats - runs)  # fmt: skip  # the kltq K formats: csrc/kltq.c


LATE_FORMAT = """
import kvhal
from kvhal import formats
q8 = formats.get("q8_0")
formats.register(formats.Format("q8_late", 32, 34, q8.max_abs, q8.quantize_blocks, q8.dequantize_blocks))
import kvhal_cpu  # after the registration: the class claims q8_late, its kernels were built without it
spec = kvhal.CacheSpec(1, 2, 64, "q8_late", "f16")
be = kvhal_cpu.CpuBackend()
print(be.supports(spec, "store"))
try:
    kvhal.KVCache(spec, 64, backend=be)
except kvhal.UnsupportedError as e:
    print(type(e).__name__)
print(be.supports(kvhal.CacheSpec(1, 2, 64, "q8_0", "f16"), "store"))
"""


def test_a_format_the_kernels_lack_is_refused_before_allocation():
    """A registry format the kernel library was built without: supports() refuses it, naming it."""
    done = subprocess.run([sys.executable, "-c", LATE_FORMAT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refusal, error, fine = done.stdout.splitlines()
    assert "format q8_late" in refusal and "q8_0" in refusal
    assert error == "UnsupportedError" and fine == "None"


def test_empty_load_ranges_are_empty_arrays():
    c = cache("q4_0", CpuBackend())
    s = c.new_seq()
    k, v = c.load(s, 0)
    assert k.shape == v.shape == (0, 2, 64) and k.dtype == np.float32


# -- attention_lse: the kernels' log-sum-exp, and block streaming built on it --------------------------

# (n_heads, n_kv_heads, dim, seq lens, q lens, causal, window, block_size)
LSE_SHAPES = {
    "decode-gqa4-d128": (32, 8, 128, [333, 64], [1, 1], True, None, 16),  # the AVX-512 decode fast path
    "decode-window-gqa8": (16, 2, 128, [300], [1], True, 45, 32),
    "prefill-window": (8, 2, 64, [150, 40], [70, 40], True, 33, 8),
    # causal rows before the first key, and a sequence with no keys at all: lse -inf, output 0
    "rows-that-see-nothing": (8, 2, 64, [30, 0, 5], [50, 3, 9], True, None, 16),
    # a streamed chunk: every key precedes every query, more queries than keys
    "non-causal-more-queries-than-keys": (16, 4, 128, [64, 96], [100, 1], False, None, 16),
}


def paged_pools(be: kvhal.Backend, spec: kvhal.CacheSpec, lens: list[int], rng: np.random.Generator):
    """Pools holding random K/V of sequences ``lens`` on shuffled pages, and their block table."""
    bs = spec.block_size
    pages = [-(-n // bs) for n in lens]
    n_blocks = sum(pages) + 1
    pools = be.allocate(spec, n_blocks)
    order = rng.permutation(n_blocks)
    table = np.full((len(lens), max(max(pages), 1)), -1, np.int32)
    used = 0
    for s, (n, p) in enumerate(zip(lens, pages)):
        table[s, :p] = order[used : used + p]
        used += p
        if n:
            k = rng.standard_normal((n, spec.n_kv_heads, spec.head_dim), dtype=np.float32)
            k[:, :, 3] *= 8
            v = rng.standard_normal((n, spec.n_kv_heads, spec.head_dim), dtype=np.float32)
            j = np.arange(n)
            be.store(pools, 0, k, v, (table[s, j // bs].astype(np.int64) * bs + j % bs))
    return pools, table


@pytest.mark.parametrize("isa,tile", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(LSE_SHAPES))
def test_attention_lse_matches_the_float64_default(isa, tile, fmt, shape):
    """One kernel call gives the output and each row's log-sum-exp: both within the path's tolerance of
    the float64 default (``backend_util.attention_lse`` over the reference's reading of the same bytes),
    -inf exactly where a row sees no key, and the output bit-identical to ``attention``."""
    from kvhal.backend_util import attention_lse
    from kvhal.reference import ReferenceBackend

    n_heads, n_kv, dim, lens, q_lens, causal, window, bs = LSE_SHAPES[shape]
    if dim % formats.get(fmt).block_len:
        pytest.skip(f"{fmt} needs head_dim % {formats.get(fmt).block_len} == 0")
    rng = np.random.default_rng(17)
    be = CpuBackend(isa=isa, kv_split=64, tile=tile)  # small splits: the partials' merge gives lse too
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=n_kv, head_dim=dim, k_format=k_of(fmt), v_format=fmt, block_size=bs)
    pools, table = paged_pools(be, spec, lens, rng)
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
    batch = kvhal.AttentionBatch(table, np.array(lens, np.int32), np.array(q_lens, np.int32), dim**-0.5, causal, window)
    args = (q, pools, 0, batch)
    out, lse = be.attention_lse(*args)
    want_out, want_lse = attention_lse(ReferenceBackend(), *args)
    assert out.dtype == np.float32 and lse.dtype == np.float64 and lse.shape == q.shape[:2]
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert np.all(lse[~seen] == -np.inf) and np.all(out[~seen] == 0.0)
    if shape == "rows-that-see-nothing":
        assert 0 < seen.sum() < seen.size
    tol = path_tolerance(isa, k_of(fmt), fmt, takes_decode_path(n_heads, n_kv, dim, q_lens, bs))
    assert float(np.abs(lse[seen] - want_lse[seen]).max()) <= tol
    assert float(np.abs(out - want_out).max()) <= tol
    np.testing.assert_array_equal(out, be.attention(*args))


@pytest.mark.parametrize("isa,tile", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f16", "q5_1"])
def test_streamed_attention_equals_all_resident(isa, tile, fmt):
    """A sequence offloaded to host memory and streamed through a small arena (partials merged by the
    kernels' log-sum-exp) attends like the same sequence all resident, decode, prefill and non-causal."""
    rng = np.random.default_rng(23)
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=4, head_dim=128, k_format=fmt, v_format=fmt, block_size=16)
    be = CpuBackend(isa=isa, tile=tile, kv_split=128)
    n = 1500
    k = rng.standard_normal((n, 4, 128), dtype=np.float32)
    v = rng.standard_normal((n, 4, 128), dtype=np.float32)
    small = kvhal.KVCache(spec, 224, backend=be, stream_arena_tokens=256)
    big = kvhal.KVCache(spec, n + 16, backend=be)
    s, r = small.new_seq(), big.new_seq()
    for start in range(0, n, 100):
        for layer in (0, 1):
            small.store(s, layer, k[start : start + 100], v[start : start + 100])
            big.store(r, layer, k[start : start + 100], v[start : start + 100])
        small.offload(s, keep_tokens=80)
    held = small.stats().offloaded_tokens
    assert n - held < 224 and held > 5 * 256  # several arena passes
    for q_len, causal in ((1, True), (64, True), (7, False)):
        q = rng.standard_normal((q_len, 16, 128), dtype=np.float32)
        got = small.attention(1, q, [s], [q_len], causal=causal)
        want = big.attention(1, q, [r], [q_len], causal=causal)
        assert float(np.abs(got - want).max()) <= be.attention_tolerance, (q_len, causal)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_io_is_the_reference_bytes_on_many_blocks(threads):
    """read_blocks / write_blocks copy pages on the thread pool: the reference's bytes for hundreds of blocks
    of 3 layers in any order; a block named twice ends with its last copy, as in the reference."""
    from kvhal.reference import ReferenceBackend

    rng = np.random.default_rng(31)
    spec = kvhal.CacheSpec(n_layers=3, n_kv_heads=4, head_dim=64, k_format="q5_1", v_format="f16", block_size=16)
    be, ref = CpuBackend(threads=threads), ReferenceBackend()
    ours, theirs = be.allocate(spec, 400), ref.allocate(spec, 400)
    for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
        a[...] = b[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    ids = rng.permutation(400)[:333]
    np.testing.assert_array_equal(be.read_blocks(ours, ids), ref.read_blocks(theirs, ids))
    assert be.read_blocks(ours, np.zeros(0, np.int64)).shape == (0, spec.block_nbytes)
    data = rng.integers(0, 256, (300, spec.block_nbytes), dtype=np.uint8)
    data.flags.writeable = False  # e.g. straight from a file
    for dst in (ids[:300], np.r_[ids[:150], ids[:150]]):  # distinct, then every block twice
        be.write_blocks(ours, dst, data)
        ref.write_blocks(theirs, dst, data)
        for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
            np.testing.assert_array_equal(a, b)
    before = [a.copy() for a in ours.k + ours.v]
    for bad_ids, bad_data, err in (
        (np.array([1, 400]), data[:2], kvhal.PositionError),
        (np.array([1, 2, 3]), data[:2], kvhal.ShapeError),
        (np.array([1]), data[:1, :-1], kvhal.ShapeError),
    ):
        with pytest.raises(err):
            be.write_blocks(ours, bad_ids, bad_data)
    for a, b in zip(before, ours.k + ours.v):  # a refused call wrote nothing
        np.testing.assert_array_equal(a, b)


V2_FORMATS = [f for f in FORMATS if f not in formats.GGML_CLASSIC]


def v2_edges(rng: np.random.Generator) -> np.ndarray:
    """Rows of 64 that hit the later formats' edge cases: fp8 saturation, subnormals, ties and signed
    zeros, e2m1 scales next to powers of two, tiny and huge blocks."""
    f32 = np.float32
    below = lambda p: np.nextafter(f32(2.0**p), f32(0))  # noqa: E731
    rows = [
        np.array([448, 449, 464, 480, 1e4, 57344, 61440, 65536, 3e38, -3e38, -448, -500] * 5 + [0, -0.0, 1, -1], f32),
        np.concatenate([np.arange(32, dtype=f32) * f32(2.0**-10), -np.arange(32, dtype=f32) * f32(2.0**-17)]),
        (np.arange(64, dtype=f32) + f32(0.5)) * f32(2.0**-9),  # e4m3 subnormal ties
        (np.arange(64, dtype=f32) + f32(0.5)) * f32(2.0**-16),  # e5m2 subnormal ties
        f32(1.0) + (np.arange(64, dtype=f32) + f32(0.5)) * f32(2.0**-4),  # normal ties (e4m3 mantissa)
        np.array([-0.0] * 32 + [0.0] * 32, f32),
        np.array([1e-45, -1e-45, 1e-40, -2e-39] * 16, f32),  # f32 subnormals: fp8 zeros with sign
        np.array([below(p) for p in range(-8, 8)] * 4, f32),  # mxfp4 exponent just below a power of two
        np.array([below(p) for p in (127, 100, 3, -100, -126, -130)] * 10 + [1, 2, 3, 4], f32),
        np.array([6 * 448, 6 * 449, 1e6, -1e7] * 16, f32),  # nvfp4 scale saturation
        (np.arange(64, dtype=f32) - 32) * f32(0.25),  # e2m1 ties between codes
        rng.standard_normal(64).astype(f32) * f32(1e-3),
    ]
    return np.stack(rows)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the reference's errors at 3e38
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", V2_FORMATS)
def test_v2_edge_values_bytes_and_loads_equal_numpy(isa, fmt):
    """Store writes the numpy reference's bytes and load returns its dequantization, on edge values."""
    f = formats.get(fmt)
    x = v2_edges(np.random.default_rng(5))
    if not f.saturates:
        x = np.clip(x, -f.max_abs, f.max_abs)
    x = x.reshape(-1, 1, 64)
    c = cache(k_of(fmt), CpuBackend(isa=isa), heads=1, dim=64, bs=16, cap=64, vfmt=fmt)
    s = c.new_seq()
    c.store(s, 0, np.zeros_like(x), x)
    v = pools(c)[1]
    n = x.shape[0]
    np.testing.assert_array_equal(v.reshape(-1, f.row_bytes(64))[:n], f.quantize(x.reshape(n, 64)))
    np.testing.assert_array_equal(c.load(0, s)[1], f.dequantize(f.quantize(x)))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # float64 attention on NaN
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("side,n_q", [("k", 1), ("v", 1), ("k", 30)])
@pytest.mark.parametrize("fmt,code", [("fp8_e4m3", 0x7F), ("fp8_e4m3", 0xFF), ("fp8_e5m2", 0x7C), ("fp8_e5m2", 0xFD)])
def test_fp8_inf_nan_codes_attend_as_nan(isa, side, n_q, fmt, code):
    """A never-stored fp8 inf/NaN code written into a page reads NaN, as the spec's table: in K every output
    of the query rows that see its token is NaN, in V the output dim that holds it, as float64
    attention gives; the other rows and dims stay within tolerance. Decode (AVX-512: kern_v2.h's path)
    and, for K, a causal prefill of 30 queries, of which the first 11 do not see the token. (A NaN in V
    also reaches the rows of its 64-token tile that do not see it: their weight 0 times NaN.)"""
    f = formats.get(fmt)
    rng = np.random.default_rng(12)
    c = cache(fmt, CpuBackend(isa=isa, kv_split=0), heads=1, dim=128, bs=16, cap=64)
    s = c.new_seq()
    c.store(
        s, 0, rng.standard_normal((40, 1, 128), dtype=np.float32), rng.standard_normal((40, 1, 128), dtype=np.float32)
    )
    pool = pools(c)[0 if side == "k" else 1].reshape(-1, 128)
    pool[21, 7] = code  # token 21 (page 1, row 5), dim 7
    k, v = (f.dequantize(p.reshape(-1, 128)[:40]).reshape(40, 1, 128) for p in pools(c))
    q = rng.standard_normal((n_q, 4, 128), dtype=np.float32)
    want = attention_f64(q, [k], [v], [n_q])
    out = c.attention(0, q, [s], [n_q])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    seeing = n_q - max(0, 21 - (40 - n_q))  # query rows at positions >= 21
    assert np.isnan(want).sum() == seeing * (4 * 128 if side == "k" else 4)
    ok = ~np.isnan(want)
    assert float(np.abs(out[ok] - want[ok]).max(initial=0.0)) <= path_tolerance(isa, fmt, fmt)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # float64 attention on NaN
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_0", "q4_1", "fp8_e4m3", "mxfp4", "nvfp4", "kivi4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("n_q", [1, 20])
def test_non_finite_query_value_makes_its_row_nan(isa, fmt, bad, n_q):
    """A NaN or inf in one query row gives NaN in that row's output only, as float64 attention, on every
    path (the integer kernels quantize q per row: its scale must not drop the NaN), decode and prefill."""
    rng = np.random.default_rng(6)
    c = cache(fmt, CpuBackend(isa=isa, kv_split=0), heads=2, dim=128, bs=16, cap=96, vfmt=fmt)
    s = c.new_seq()
    c.store(
        s, 0, rng.standard_normal((70, 2, 128), dtype=np.float32), rng.standard_normal((70, 2, 128), dtype=np.float32)
    )
    q = rng.standard_normal((n_q, 8, 128), dtype=np.float32)
    q[n_q - 1, 6, 40] = bad
    k, v = (kvhal.to_numpy(x) for x in c.load(s, 0))
    want = attention_f64(q, [k], [v], [n_q])
    out = c.attention(0, q, [s], [n_q])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(want).any(axis=-1).sum() == 1
    ok = ~np.isnan(want)
    assert float(np.abs(out[ok] - want[ok]).max()) <= path_tolerance(isa, fmt, fmt, decode_path=n_q == 1)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # float64 attention on NaN
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
@pytest.mark.parametrize("bad", ["d_inf", "d_nan", "q_nan", "q_inf"])
def test_kivi_k_non_finite_scale_or_query_attends_as_nan(isa, fmt, bad):
    """A kivi K page whose d of one channel is inf or NaN (bytes written directly), or a query row with a NaN
    or inf: the outputs NaN are exactly float64 attention's over the values load gives (an inf d gives
    inf * 0 = NaN at the page's minimum, so every row that sees the page; a bad query, its own row), the
    others within tolerance. Decode shape (GQA 4, 16-token pages: the AVX-512 decode path's bound)."""
    rng = np.random.default_rng(5)
    c = cache(fmt, CpuBackend(isa=isa, kv_split=0), heads=2, dim=128, bs=16, cap=64, vfmt="q8_0")
    s = c.new_seq()
    c.store(
        s, 0, rng.standard_normal((40, 2, 128), dtype=np.float32), rng.standard_normal((40, 2, 128), dtype=np.float32)
    )
    q = rng.standard_normal((1, 8, 128), dtype=np.float32)
    if bad.startswith("d"):
        page = pools(c)[0][c.block_ids(s)[1]].reshape(2, -1)  # page 1 of KV head 1: codes, f16 d[128], m[128]
        page[1, page.shape[1] - 4 * 128 + 2 * 5 : page.shape[1] - 4 * 128 + 2 * 6] = np.frombuffer(
            np.float16(np.inf if bad == "d_inf" else np.nan).tobytes(), np.uint8
        )
    else:
        q[0, 6, 40] = np.nan if bad == "q_nan" else np.inf
    k, v = (kvhal.to_numpy(x) for x in c.load(s, 0))
    want = attention_f64(q, [k], [v], [1])
    out = c.attention(0, q, [s], [1])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(want).any(axis=-1).sum() == (4 if bad.startswith("d") else 1)
    ok = ~np.isnan(want)
    assert float(np.abs(out[ok] - want[ok]).max()) <= path_tolerance(isa, fmt, "q8_0", decode_path=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if formats.get(f).k_page is not None])
@pytest.mark.parametrize(("bs", "dim", "gqa", "n_q"), [(16, 128, 4, 1), (8, 64, 2, 5), (32, 96, 1, 3)])
def test_paged_k_pages_and_attention(isa, fmt, bs, dim, gqa, n_q):
    """K per channel over whole pages (kivi): the pool bytes are the spec's (the numpy page codec), load
    reads them back exactly, and attention over several pages plus the open page (the f16 tail) equals
    float64 attention over those values, on one thread and on two with small split-KV slices."""
    rng = np.random.default_rng(11)
    n, heads = 5 * bs + 3, 2
    k, v = awkward(rng, n, heads, dim), rng.standard_normal((n, heads, dim), dtype=np.float32)
    spec = kvhal.CacheSpec(1, heads, dim, fmt, fmt, bs)
    ours = [kvhal.KVCache(spec, 256, backend=CpuBackend(isa=isa, threads=t, kv_split=s)) for t, s in ((1, 0), (2, 16))]
    ref = kvhal.KVCache(spec, 256, backend="reference")
    for c in (*ours, ref):
        s = c.new_seq()
        c.store(s, 0, k[:3], v[:3])
        c.store(s, 0, k[3:], v[3:])
    full = n // bs * bs
    codec = formats.get(fmt).k_page
    pages = k[:full].astype(np.float16).astype(np.float32).reshape(-1, bs, heads, dim).transpose(0, 2, 1, 3)
    want_pages = codec.quantize_page(np.ascontiguousarray(pages).reshape(-1, bs, dim))
    blocks = ref.block_ids(0)[: full // bs]
    for c in (*ours, ref):
        kp = pools(c)[0][np.asarray(blocks)]  # [pages, heads, bs, row]
        np.testing.assert_array_equal(kp.reshape(len(blocks) * heads, -1), want_pages)
    k_want = kvhal.to_numpy(ref.load(0, 0)[0])
    q = rng.standard_normal((n_q, heads * gqa, dim), dtype=np.float32)
    want = attention_f64(q, [k_want], [kvhal.to_numpy(ref.load(0, 0)[1])], [n_q])
    for c in ours:
        np.testing.assert_array_equal(kvhal.to_numpy(c.load(0, 0)[0]), k_want)
        err = np.abs(kvhal.to_numpy(c.attention(0, q, [0], [n_q])) - want).max()
        decode_path = n_q == 1 and dim == 128 and gqa % 4 == 0 and bs % 16 == 0  # the AVX-512 decode kernels
        assert err <= path_tolerance(isa, fmt, fmt, decode_path), err
    with pytest.raises(kvhal.FormatError, match="whole pages"):
        ours[0].backend.store(ours[0].pools, 0, k[:bs], v[:bs], np.arange(1, bs + 1))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference on inf scales
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", V2_FORMATS)
def test_v2_every_byte_loads_and_attends_as_the_reference(isa, fmt):
    """Pool bytes written directly (every byte value, the never-stored fp8 inf/NaN codes and any scale byte
    included): load equals the numpy dequantization, NaN where it gives NaN, and decode attention over
    the finite rows (the others' bytes masked finite) matches float64 attention on them."""
    f = formats.get(fmt)
    c = cache("f16", CpuBackend(isa=isa), heads=1, dim=128, bs=16, cap=64, vfmt=fmt)
    s = c.new_seq()
    c.store(s, 0, np.zeros((32, 1, 128), np.float32), np.zeros((32, 1, 128), np.float32))
    v = pools(c)[1]
    rows = np.random.default_rng(9).integers(0, 256, (32, f.row_bytes(128)), dtype=np.uint8)
    rows.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    v.reshape(-1, f.row_bytes(128))[:32] = rows  # pages 0 and 1 of the cache's single head, in token order
    want = f.dequantize(rows)
    got = c.load(0, s)[1].reshape(32, 128)
    np.testing.assert_array_equal(got, want)
    # attention over the rows whose values are finite and sum in f32 (NaN attends as NaN; mxfp4's
    # largest scales overflow any f32 sum); the others' bytes masked to 0x3f (small exponents, finite)
    bad = ~np.isfinite(want).all(axis=1) | (np.abs(np.nan_to_num(want)).max(axis=1) > 1e30)
    rows[bad] &= 0x3F
    v.reshape(-1, f.row_bytes(128))[:32] = rows
    want = f.dequantize(rows)
    q = np.random.default_rng(10).standard_normal((1, 4, 128), dtype=np.float32)
    out = c.attention(0, q, [s], [1])
    ks = [np.zeros((32, 1, 128), np.float32)]
    err = np.abs(out - attention_f64(q, ks, [want.reshape(32, 1, 128)], [1])).max()
    assert err <= path_tolerance(isa, "f16", fmt) * max(1.0, float(np.abs(want).max()))


@pytest.mark.skipif("avx2" not in ISAS, reason="this CPU has no AVX2")
def test_avx2_prefill_path_is_named_where_items_reach_the_gemm_tiles():
    """AVX2 items of 12+ query rows per KV head (head_dim a multiple of 16) run the GEMM-form tiles; decode
    items keep the dot form. (That the GEMM tiles compute right is every prefill test on avx2 above.)"""
    be = CpuBackend(isa="avx2")
    spec = kvhal.CacheSpec(1, 8, 128, k_format="q8_0", v_format="q4_0")
    assert [be.attention_path(spec, 32, n) for n in (1, 2, 3, 512)] == ["avx2", "avx2", "avx2-gemm", "avx2-gemm"]
    assert be.attention_path(kvhal.CacheSpec(1, 2, 24, k_format="f16", v_format="f16"), 8, 512) == "avx2"


@pytest.mark.parametrize("isa", ISAS)
def test_attention_path_names_the_kltq_kernels(isa):
    """A kltq K or V runs csrc/kltq.c's kernels (AVX-512 where the instance's ISA has it), whatever the block
    kernels would pick for the other side: the path says so."""
    be = CpuBackend(isa=isa)
    want = "kltq-avx512" if isa in ("avx512", "amx") else "kltq-scalar"
    for k_format, v_format in (("kltq:4.5", "q8_0"), ("q8_0", "kltq:4.5")):
        spec = kvhal.CacheSpec(1, 2, 64, k_format=k_format, v_format=v_format)
        assert be.attention_path(spec, 4, 1) == want
        assert be.attention_path(spec, 4, 512) == want
    assert not be.attention_path(kvhal.CacheSpec(1, 2, 64, k_format="q8_0", v_format="q8_0"), 4, 1).startswith("kltq")
