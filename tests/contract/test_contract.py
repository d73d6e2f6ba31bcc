"""The contract every backend meets, checked against the reference backend and float64 oracles.

Parametrized over every available backend (``KVHAL_TEST_BACKENDS`` narrows it). For each format a
backend claims: its pools are byte-identical to the reference's, load equals the reference
dequantization, attention matches float64 attention on the dequantized K/V within the backend's
declared tolerance (``Backend.tolerance``: decode's, and a prefill's where the backend declares it apart), and sequence operations leave identical pools. The shape sweep (SWEEP_TABLE)
repeats store/load and attention over head_dim x block_size x GQA ratio as a covering design. A spec the
backend refuses skips with the reason its ``supports`` gives (which the cache's ``UnsupportedError`` names).
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest

import kvhal
import kvhal.streaming
from kvhal import formats
from kvhal.formats import kltq
from tests.oracle import attention_f64

ALL_FORMATS = formats.plain_names()  # the kltq budgets (side data) have their own tests below
KLTQ = [f for f in formats.names() if formats.get(f).side_data]


def make_spec(fmt_k: str, fmt_v: str | None = None, *, layers: int = 1, heads: int = 2, dim: int = 64,
              bs: int = 16) -> kvhal.CacheSpec:
    return kvhal.CacheSpec(n_layers=layers, n_kv_heads=heads, head_dim=dim, k_format=fmt_k,
                           v_format=fmt_v or fmt_k, block_size=bs)


def make_cache(name: str, fmt_k: str, fmt_v: str | None = None, *, layers: int = 1, heads: int = 2,
               dim: int = 64, bs: int = 16, cap: int = 512) -> kvhal.KVCache:
    return kvhal.KVCache(make_spec(fmt_k, fmt_v, layers=layers, heads=heads, dim=dim, bs=bs), cap, backend=name)


def pool_bytes(cache: kvhal.KVCache, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``layer``'s K and V pools, read straight from the backend's arrays."""
    n, p = cache.n_blocks, cache.pools
    k = np.asarray(cache.backend.to_numpy(p.k[layer])).view(np.uint8).reshape(cache.spec.pool_shape(n, "k"))
    v = np.asarray(cache.backend.to_numpy(p.v[layer])).view(np.uint8).reshape(cache.spec.pool_shape(n, "v"))
    return k, v


def kv(rng: np.random.Generator, n: int, heads: int = 2, dim: int = 64) -> tuple[np.ndarray, np.ndarray]:
    k = rng.standard_normal((n, heads, dim), dtype=np.float32)
    v = rng.standard_normal((n, heads, dim), dtype=np.float32)
    k[:, :, 3] *= 8  # an outlier channel, as real keys have
    return k, v


# K per channel over whole pages (KIVI): the cache keeps each sequence's open page in its f16 tail, and
# sequence operations that move rows between pages (evict, seq_rm of a middle range, offload) refuse
PAGED_K = [f for f in ALL_FORMATS if formats.get(f).k_page is not None]


def claimed(info: kvhal.BackendInfo) -> list[str]:
    """The formats the backend claims that every cache operation takes (the per-channel K formats aside)."""
    return [f for f in ALL_FORMATS if f in info.formats and f not in PAGED_K]


def claimed_all(info: kvhal.BackendInfo) -> list[str]:
    return [f for f in ALL_FORMATS if f in info.formats]


def oracle_kv(fk: str, fv: str, k: np.ndarray, v: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V as a cache of K format ``fk`` and V format ``fv`` returns them (the oracle for ``load``)."""
    paged = formats.get(fk).k_page is not None
    n_full = len(k) // bs * bs if paged else len(k)

    def rows(fmt: str, x: np.ndarray) -> np.ndarray:
        f = formats.get(fmt)
        if not paged:
            return f.dequantize(f.quantize(x))
        x16 = x.astype(np.float16).astype(np.float32)  # through the f16 tail, quantized from f16 values
        return np.concatenate([f.dequantize(f.quantize(x16[:n_full])), x16[n_full:]])

    ok = rows(fv, v)
    if not paged or n_full == 0:
        return rows(fk, k) if not paged else k.astype(np.float16).astype(np.float32), ok
    codec = formats.get(fk).k_page
    assert codec is not None
    x16 = k.astype(np.float16).astype(np.float32)
    pages = x16[:n_full].reshape(n_full // bs, bs, *k.shape[1:]).transpose(0, 2, 1, 3)  # [p, H, bs, D]
    p, h = pages.shape[:2]
    dq = codec.dequantize_page(codec.quantize_page(pages.reshape(p * h, bs, k.shape[2])), bs).reshape(p, h, bs, -1)
    full = dq.transpose(0, 2, 1, 3).reshape(n_full, *k.shape[1:])
    return np.concatenate([full, x16[n_full:]]), ok


def runs_as_k(info: kvhal.BackendInfo, fmt: str) -> bool:
    """Whether a KVCache on ``info`` takes ``fmt`` as its K format (a backend may run a per-channel K
    format's V rows only, and refuses it as K with a typed error)."""
    try:
        make_cache(info.name, fmt)
    except kvhal.UnsupportedError:
        return False
    return True


OPS = ("store", "load", "attention")


@functools.cache
def backend_of(name: str) -> kvhal.Backend:
    """The backend instance a ``KVCache(..., backend=name)`` runs on (every backend takes this f16 spec)."""
    return make_cache(name, "f16", cap=16).backend


def skip_if_refused(info: kvhal.BackendInfo, spec: kvhal.CacheSpec, capacity: int = 64) -> None:
    """Nothing where ``info``'s backend takes ``spec`` for every op. Where ``supports`` refuses an op, the cache
    refuses the spec with an ``UnsupportedError`` that names exactly that reason, and the test skips with it
    (a refusal is a skip that says why, never a pass)."""
    backend = backend_of(info.name)
    refusals = [(op, why) for op in OPS if (why := backend.supports(spec, op)) is not None]
    if not refusals:
        return
    with pytest.raises(kvhal.UnsupportedError) as refused:
        kvhal.KVCache(spec, capacity, backend=info.name)
    op, why = refusals[0]
    assert why in str(refused.value), f"the cache's refusal {str(refused.value)!r} does not name supports({op!r}): {why!r}"
    pytest.skip(f"{info.name} refuses {op}: {why}")


def k_v_pair(info: kvhal.BackendInfo, fmt: str) -> tuple[str, str]:
    """The (K, V) formats that exercise ``fmt`` on ``info``: ``(fmt, fmt)``, or ``("f16", fmt)`` where only its
    V rows run there; where it does not run at all (not claimed, or refused by a device limit), the test skips
    with ``supports``' reason, having checked that the cache's typed refusal names it."""
    if fmt not in claimed_all(info):
        with pytest.raises(kvhal.UnsupportedError):
            make_cache(info.name, fmt)
        skip_if_refused(info, make_spec(fmt))
        pytest.fail(f"{info.name} refuses format {fmt} though its supports() takes it")
    if runs_as_k(info, fmt):
        return fmt, fmt
    if formats.get(fmt).k_page is None:  # claimed, but this device's limits refuse it here: skip with the reason
        skip_if_refused(info, make_spec(fmt))
    assert formats.get(fmt).k_page is not None, f"{info.name} claims {fmt} but refuses it as K"
    return "f16", fmt


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_claims_at_least_f16(backend_info: kvhal.BackendInfo) -> None:
    assert "f16" in claimed(backend_info)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_store_load_bytes_match_reference(backend_info, fmt, rng):
    pair = k_v_pair(backend_info, fmt)
    fk, fv = pair
    k, v = kv(rng, 37)
    caches = [make_cache(backend_info.name, fk, fv, bs=16), make_cache("reference", fk, fv, bs=16)]
    for c in caches:
        s = c.new_seq()
        c.store(s, 0, k[:1], v[:1])  # decode-sized store
        c.store(s, 0, k[1:], v[1:])  # prefill-sized store across page boundaries
    got, want = pool_bytes(caches[0]), pool_bytes(caches[1])
    np.testing.assert_array_equal(got[0], want[0], err_msg="K pool bytes differ from the reference")
    np.testing.assert_array_equal(got[1], want[1], err_msg="V pool bytes differ from the reference")
    k2, v2 = (kvhal.to_numpy(x) for x in caches[0].load(0, 0))
    want_k, want_v = oracle_kv(fk, fv, k, v, 16)
    np.testing.assert_allclose(k2, want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v2, want_v, rtol=1e-6, atol=1e-6)
    k3, _ = (kvhal.to_numpy(x) for x in caches[0].load(0, 0, 5, 21))
    np.testing.assert_allclose(k3, k2[5:21], rtol=0, atol=0)


OUT_DTYPES = ("float32", "float16", "bfloat16")


def narrowed(x: np.ndarray, dtype: str) -> np.ndarray:
    """The oracle of a narrowed load: ml_dtypes' / numpy's round-to-nearest-even cast of the f32 load, as bits."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(dtype).view(np.uint16 if dtype == "float16" else np.uint32)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_load_into_out_and_dtype_match_the_f32_load(backend_info, fmt, rng):
    """load(out=) into reused buffers and load(dtype=) equal the f32 load cast by numpy / ml_dtypes, bit for bit,
    over a range that starts and ends inside pages; torch CPU tensors (bf16 included) take the same bits."""
    fk, fv = k_v_pair(backend_info, fmt)
    cache = make_cache(backend_info.name, fk, fv, bs=16)
    s = cache.new_seq()
    k, v = kv(rng, 53)
    cache.store(s, 0, k, v)
    want = [kvhal.to_numpy(x) for x in cache.load(s, 0, 5, 45)]
    torch = None if os.environ.get("KVHAL_TEST_NO_TORCH") else _torch()
    for dtype in OUT_DTYPES:
        bits = [narrowed(w, dtype) for w in want]
        got = cache.load(s, 0, 5, 45, dtype=dtype)
        for g, b in zip(got, bits):
            np.testing.assert_array_equal(kvhal.to_numpy(g).view(b.dtype), b)
        out = tuple(np.full((40, 2, 64), 7, b.dtype) for b in bits)  # dtype's bits: a reused, dirty buffer
        views = tuple(o.view(kvhal.to_numpy(got[0]).dtype) for o in out)
        for _ in range(2):
            assert cache.load(s, 0, 5, 45, out=views)[0] is views[0]
            for o, b in zip(out, bits):
                np.testing.assert_array_equal(o, b)
        if torch is not None:
            t = tuple(torch.empty((40, 2, 64), dtype=getattr(torch, dtype)) for _ in range(2))
            cache.load(s, 0, 5, 45, out=t)
            for x, w in zip(t, want):
                assert torch.equal(x, torch.from_numpy(w).to(x.dtype))


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


@pytest.mark.parametrize("fmt", ["q4_1", "f16"])
def test_load_into_a_large_output_matches_the_f32_load(backend_info, fmt, rng):
    """An output of more than 8 MiB (the cpu backend writes those with non-temporal stores) holds the same bits."""
    fk, fv = k_v_pair(backend_info, fmt)
    cache = make_cache(backend_info.name, fk, fv, heads=8, dim=128, bs=16, cap=2200)
    s = cache.new_seq()
    k, v = kv(rng, 2100, 8, 128)
    cache.store(s, 0, k, v)
    want = [kvhal.to_numpy(x) for x in cache.load(s, 0, 3)]
    for dtype in ("float32", "bfloat16"):
        got = cache.load(s, 0, 3, dtype=dtype)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(kvhal.to_numpy(g).view(np.uint16 if dtype != "float32" else np.uint32),
                                          narrowed(w, dtype))


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
    pair = k_v_pair(backend_info, fmt)
    x = adversarial_rows(rng)
    caches = [make_cache(backend_info.name, *pair), make_cache("reference", *pair)]
    for c in caches:
        c.store(c.new_seq(), 0, x, x[::-1].copy())
    for got, want, which in zip(pool_bytes(caches[0]), pool_bytes(caches[1]), "KV"):
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{which} pool differs from the reference at [block, head, slot, byte] {bad[:5].tolist()}"


@pytest.mark.parametrize("last", [1, 2])
def test_mixed_k_v_formats(backend_info, rng, last):
    fmts = claimed_all(backend_info)
    fk, fv = [f for f in fmts if runs_as_k(backend_info, f)][-last], fmts[0]
    k, v = kv(rng, 20)
    a, b = make_cache(backend_info.name, fk, fv), make_cache("reference", fk, fv)
    for c in (a, b):
        c.store(c.new_seq(), 0, k, v)
    for x, y in zip(pool_bytes(a), pool_bytes(b)):
        np.testing.assert_array_equal(x, y)
    got = [kvhal.to_numpy(x) for x in a.load(0, 0)]
    for g, w in zip(got, oracle_kv(fk, fv, k, v, 16)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


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
    pair = k_v_pair(backend_info, fmt)
    fk, fv = pair
    n_heads, n_kv, dim, lens, q_lens, causal, window = CASES[case]
    cache = make_cache(backend_info.name, fk, fv, heads=n_kv, dim=dim, cap=sum(lens) + 64)
    seqs, ks, vs = [], [], []
    for n in lens:
        k, v = kv(rng, n, n_kv, dim)
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        seqs.append(s)
        want_k, want_v = oracle_kv(fk, fv, k, v, 16)
        ks.append(want_k)
        vs.append(want_v)
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=np.float32)
    out = kvhal.to_numpy(cache.attention(0, q, seqs, q_lens, causal=causal, window=window))
    want = attention_f64(q, ks, vs, q_lens, causal=causal, window=window)
    assert out.shape == q.shape and out.dtype == np.float32
    err = float(np.abs(out - want).max())
    tol = cache.backend.tolerance(max(q_lens))
    assert err <= tol, f"max error {err:.3g} > {tol}"


# ---- the shape sweep: head_dim x block_size x GQA ratio, a covering design over every format -------------

SWEEP_DIMS = (64, 80, 96, 128, 256)  # 80 only for the per-value formats (block_len 1): f32, f16, bf16, fp8_*
SWEEP_BLOCKS = (16, 32, 64, 256)
SWEEP_GQA = (1, 4, 8)  # query heads per KV head (2 KV heads: 2, 8 or 16 query heads)
LARGEST = (256, 256, 8)  # head_dim, block_size, GQA
FAMILIES = {
    "float": ("f32", "f16", "bf16"),
    "ggml": ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"),
    "fp8": ("fp8_e4m3", "fp8_e5m2"),
    "fp4": ("mxfp4", "nvfp4"),
    "kivi": ("kivi4", "kivi2"),
}
_ = None  # a head_dim the format cannot store (rows are whole blocks: 80 needs block_len 1, 96 block_len <= 32)
# The full product (14 formats x 5 x 4 x 3) is too slow on the emulated backends, so each format gets one case
# per head_dim it stores, each cell (block_size, GQA ratio); a second row for a format adds cases where its
# head_dims are too few to meet all four block sizes. Read across: every format meets every head_dim it stores,
# every block size and every GQA ratio. Read the eight ggml-classic rows (what opencl, vulkan, arm, openvino and
# ascend run) down each column: every (head_dim, block_size), (head_dim, GQA) and (block_size, GQA) pair occurs
# among them alone. LARGEST occurs in every family. kivi's d=96 cases avoid block 256 (a per-channel K page
# needs block_size | 4 * head_dim). test_sweep_design_covers_every_pair checks all of this.
SWEEP_TABLE = [
    # format        d=64       d=80       d=96       d=128      d=256
    ("f32",        (16, 8),   (64, 4),   (32, 1),   (256, 8),  (256, 8)),
    ("f16",        (256, 4),  (16, 1),   (64, 8),   (32, 8),   (32, 1)),
    ("f16",        _,         (32, 8),   _,         _,         _),
    ("bf16",       (64, 8),   (256, 4),  (32, 1),   (16, 1),   (64, 4)),
    ("q8_0",       (32, 4),   _,         (16, 8),   (256, 1),  (64, 8)),
    ("q4_0",       (64, 8),   _,         (16, 4),   (32, 1),   (256, 8)),
    ("q4_1",       (32, 1),   _,         (256, 8),  (16, 4),   (64, 8)),
    ("q5_0",       (64, 1),   _,         (256, 4),  (32, 8),   (16, 1)),
    ("q5_1",       (256, 1),  _,         (16, 4),   (64, 8),   (32, 8)),
    ("fp8_e4m3",   (32, 1),   (256, 4),  (64, 8),   (16, 1),   (64, 4)),
    ("fp8_e5m2",   (16, 1),   (64, 8),   (32, 4),   (256, 4),  (256, 8)),
    ("mxfp4",      (64, 1),   _,         (16, 8),   (32, 4),   (256, 8)),
    ("nvfp4",      (32, 1),   _,         _,         (16, 4),   (256, 8)),
    ("nvfp4",      _,         _,         _,         (64, 4),   _),
    ("kivi4",      (32, 4),   _,         (16, 1),   (64, 8),   (256, 8)),
    ("kivi2",      (256, 1),  _,         (64, 8),   (16, 4),   (32, 8)),
]  # fmt: skip
SWEEP_DESIGN = [
    (fmt, dim, *cell) for fmt, *cells in SWEEP_TABLE for dim, cell in zip(SWEEP_DIMS, cells) if cell is not None
]
# KVHAL_SWEEP=full runs the whole product instead (714 cases, each a valid spec; minutes on the host backends, far
# longer emulated): how SWEEP_FOUND below was found
SWEEP_FULL = [
    (fmt, dim, bs, gqa)
    for fmt in ALL_FORMATS
    for dim, bs, gqa in itertools.product(SWEEP_DIMS, SWEEP_BLOCKS, SWEEP_GQA)
    if dim % formats.get(fmt).block_len == 0 and (formats.get(fmt).k_page is None or 4 * dim % bs == 0)
]
SWEEP = SWEEP_FULL if os.environ.get("KVHAL_SWEEP") == "full" else SWEEP_DESIGN


def sweep_id(case: tuple[str, int, int, int]) -> str:
    fmt, dim, bs, gqa = case
    return f"{fmt}-d{dim}-bs{bs}-gqa{gqa}"


def test_sweep_design_covers_every_pair():
    """The covering design above, checked: every format x every value of each axis it can take, every pair of
    axes among the ggml-classic formats alone, and the largest case in every format family."""
    assert sorted(f for fam in FAMILIES.values() for f in fam) == sorted(ALL_FORMATS)
    for fmt in ALL_FORMATS:
        rows = [c for c in SWEEP_DESIGN if c[0] == fmt]
        dims = {d for d in SWEEP_DIMS if d % formats.get(fmt).block_len == 0}
        assert {c[1] for c in rows} == dims, fmt
        assert {c[2] for c in rows} == set(SWEEP_BLOCKS), fmt
        assert {c[3] for c in rows} == set(SWEEP_GQA), fmt
    for subset in (formats.GGML_CLASSIC, ALL_FORMATS):
        rows = [c for c in SWEEP_DESIGN if c[0] in subset]
        for (i, a), (j, b) in [((1, SWEEP_DIMS), (2, SWEEP_BLOCKS)), ((1, SWEEP_DIMS), (3, SWEEP_GQA)),
                               ((2, SWEEP_BLOCKS), (3, SWEEP_GQA))]:  # fmt: skip
            missing = {(x, y) for x in a for y in b} - {(c[i], c[j]) for c in rows}
            assert not missing, (subset, missing)
    for family, fmts in FAMILIES.items():
        assert any(c[0] in fmts and c[1:] == LARGEST for c in SWEEP_DESIGN), family
    assert len(set(SWEEP_DESIGN)) == len(SWEEP_DESIGN) and set(SWEEP_DESIGN) <= set(SWEEP_FULL)
    for fmt, dim, bs, _gqa in SWEEP_DESIGN:
        make_spec(fmt, heads=2, dim=dim, bs=bs)  # a valid spec: only a backend may refuse it


# the caches test_sweep_store_load_match_reference built, taken over by test_sweep_attention_matches_float64 (the
# stores are much of each case's time on the emulated backends); nothing else reads them
_SWEEP_BUILT: dict[tuple[str, tuple[str, int, int, int]], list[kvhal.KVCache]] = {}


def sweep_caches(info: kvhal.BackendInfo, case: tuple[str, int, int, int]) -> list[kvhal.KVCache]:
    """This backend's cache and the reference's for ``case``, each holding one sequence (id 0) of
    ``block_size + 11`` tokens (a full page and part of the next) stored by a decode-sized store and a prefill-sized
    one; skips, with ``supports``' reason, where the backend refuses the spec."""
    fmt, dim, bs, gqa = case
    fk, fv = k_v_pair(info, fmt)
    spec = make_spec(fk, fv, heads=2, dim=dim, bs=bs)
    skip_if_refused(info, spec, 2 * bs)
    built = _SWEEP_BUILT.pop((info.name, case), None)
    if built is not None:
        return built
    caches = [kvhal.KVCache(spec, 2 * bs, backend=name) for name in (info.name, "reference")]
    k, v = kv(np.random.default_rng([dim, bs, gqa, ALL_FORMATS.index(fmt)]), bs + 11, 2, dim)
    for c in caches:
        s = c.new_seq()
        assert s == 0
        c.store(s, 0, k[:1], v[:1])
        c.store(s, 0, k[1:], v[1:])
    return caches


@pytest.mark.parametrize("case", SWEEP, ids=sweep_id)
def test_sweep_store_load_match_reference(backend_info, case):
    """Pool bytes identical to the reference's, and load equal to the reference's dequantization."""
    got, ref = sweep_caches(backend_info, case)
    for x, y, which in zip(pool_bytes(got), pool_bytes(ref), "KV"):
        bad = np.argwhere(x != y)
        assert bad.size == 0, f"{which} pool differs from the reference at [block, head, slot, byte] {bad[:5].tolist()}"
    for x, y in zip(got.load(0, 0), ref.load(0, 0)):
        np.testing.assert_allclose(kvhal.to_numpy(x), kvhal.to_numpy(y), rtol=1e-6, atol=1e-6)
    _SWEEP_BUILT[backend_info.name, case] = [got, ref]  # only once every check passed


def sweep_attention(info: kvhal.BackendInfo, case: tuple[str, int, int, int], rng: np.random.Generator) -> None:
    """Decode (1 query) and a causal prefill chunk (20 queries across the page boundary) against float64
    attention over the reference's dequantized K/V, within the backend's declared tolerance."""
    fmt, dim, bs, gqa = case
    got, ref = sweep_caches(info, case)
    ks, vs = (kvhal.to_numpy(x).copy() for x in ref.load(0, 0))
    errs = {}
    for q_len in (1, 20):
        q = rng.standard_normal((q_len, 2 * gqa, dim), dtype=np.float32)
        out = kvhal.to_numpy(got.attention(0, q, [0], [q_len]))
        assert out.shape == q.shape and out.dtype == np.float32
        errs[q_len] = float(np.abs(out - attention_f64(q, [ks], [vs], [q_len])).max())
    tols = {q_len: got.backend.tolerance(q_len) for q_len in errs}
    assert all(errs[n] <= tols[n] for n in errs), f"max error decode {errs[1]:.3g}, prefill {errs[20]:.3g} > {tols}"


@pytest.mark.parametrize("case", SWEEP, ids=sweep_id)
def test_sweep_attention_matches_float64(backend_info, case, rng):
    sweep_attention(backend_info, case, rng)


# Cases outside the design that the full product found (every format x head_dim x block_size x GQA, 714 attention
# cases, the queries drawn from seeds 1234, 7, 0, 1, 2): the worst ones of cpu's AVX-512 integer kernels, whose
# prefill error over 267 keys (128-token tiles, int16 p*d_v) reaches 3.4e-4 and 3.8e-4 here, the largest of the
# whole product; cpu declares 5e-4 for those kernels from their weights' rounding (docs/backends/cpu.md).
SWEEP_FOUND = [(("q5_0", 96, 256, 8), 7), (("q4_1", 64, 256, 4), 2)]  # (case, seed of the queries)


@pytest.mark.parametrize(("case", "q_seed"), SWEEP_FOUND, ids=[f"{sweep_id(c)}-q{s}" for c, s in SWEEP_FOUND])
def test_sweep_found_attention_matches_float64(backend_info, case, q_seed):
    sweep_attention(backend_info, case, np.random.default_rng(q_seed))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # float64 attention on NaN
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_query_value_gives_nan_in_its_row_only(backend_info, bad, rng):
    """A NaN or inf in one query row (a model bug upstream) is not hidden: that row's output is NaN, as in
    float64 attention, and every other row is unchanged, for each claimed format, decode and prefill."""
    for fmt in claimed_all(backend_info):
        pair = k_v_pair(backend_info, fmt)  # a claimed format: never skips
        cache = make_cache(backend_info.name, *pair, cap=96)
        k, v = kv(rng, 40)
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        for n_q in (1, 5):
            q = rng.standard_normal((n_q, 4, 64), dtype=np.float32)
            clean = kvhal.to_numpy(cache.attention(0, q, [s], [n_q]))
            q[n_q - 1, 2, 9] = bad
            out = kvhal.to_numpy(cache.attention(0, q, [s], [n_q]))
            nan = np.isnan(out).any(axis=-1)
            assert nan[n_q - 1, 2] and np.isnan(out[n_q - 1, 2]).all(), (fmt, n_q)
            nan[n_q - 1, 2] = False
            assert not nan.any(), (fmt, n_q)
            ok = np.ones(out.shape[:2], bool)
            ok[n_q - 1, 2] = False
            np.testing.assert_array_equal(out[ok], clean[ok])


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
    assert float(np.abs(out - want).max()) <= cache.backend.tolerance(1)


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


def snapshot(cache: kvhal.KVCache) -> tuple:
    """Everything a failed call must leave as it was: every pool byte, the stats, each sequence's lengths."""
    pools = [tuple(x.copy() for x in pool_bytes(cache, layer)) for layer in range(cache.spec.n_layers)]
    lens = {s: [cache.seq_len(s, layer) for layer in range(cache.spec.n_layers)] for s in cache.seqs}
    return pools, cache.stats(), lens


def assert_same(a: tuple, b: tuple) -> None:
    for pa, pb in zip(a[0], b[0]):
        for x, y in zip(pa, pb):
            np.testing.assert_array_equal(x, y)
    assert a[1:] == b[1:]


def test_bad_input_is_a_typed_error_and_changes_nothing(backend_info, rng):
    """Mistyped and out-of-range arguments: a KVHalError naming the problem, nothing changed."""
    fmt = "bf16" if "bf16" in claimed(backend_info) else claimed(backend_info)[-1]
    cache = make_cache(backend_info.name, fmt, layers=2, bs=8, cap=128)
    s = cache.new_seq()
    empty = cache.new_seq()
    k, v = kv(rng, 12)
    for layer in (0, 1):
        cache.store(s, layer, k, v)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    before = snapshot(cache)
    cases = [
        (kvhal.PositionError, lambda: cache.store(s, True, k[:1], v[:1])),  # a bool is not layer 1
        (kvhal.PositionError, lambda: cache.load(s, True)),
        (kvhal.PositionError, lambda: cache.attention(True, q, [s])),
        (kvhal.PositionError, lambda: cache.seq_len(s, True)),
        (kvhal.PositionError, lambda: cache.store(s, 1.0, k[:1], v[:1])),
        (kvhal.SequenceError, lambda: cache.store(True, 0, k[:1], v[:1])),  # True is not sequence 1
        (kvhal.SequenceError, lambda: cache.store(0.0, 0, k[:1], v[:1])),  # nor 0.0 sequence 0
        (kvhal.SequenceError, lambda: cache.store(np.float64(0), 0, k[:1], v[:1])),
        (kvhal.SequenceError, lambda: cache.seq_len("0")),
        (kvhal.SequenceError, lambda: cache.attention(0, q, s)),  # seqs must be a list
        (kvhal.PositionError, lambda: cache.seq_rm(s, 1, 4.5)),
        (kvhal.PositionError, lambda: cache.seq_rm(s, "1", 4)),
        (kvhal.PositionError, lambda: cache.seq_cp(s, 1.5, 4)),
        (kvhal.PositionError, lambda: cache.load(s, 0, 1.5)),
        (kvhal.PositionError, lambda: cache.load(s, 0, None)),
        (kvhal.PositionError, lambda: cache.load(s, 0, 0, 2.5)),
        (kvhal.PositionError, lambda: cache.load(s, 0, 0, 13)),
        (kvhal.DTypeError, lambda: cache.store(s, 0, "kv", "kv")),
        (kvhal.DTypeError, lambda: cache.store(s, 0, [[[1.0] * 64, [1.0] * 63]], [[[1.0] * 64, [1.0] * 63]])),  # ragged
        (kvhal.DTypeError, lambda: cache.store(s, 0, k[:1].astype(np.float64), v[:1])),
        (kvhal.DTypeError, lambda: cache.store(s, 0, [[["1.5"] * 64] * 2], [[["1.5"] * 64] * 2])),  # text, not numbers
        (kvhal.DTypeError, lambda: cache.store(s, 0, [[[True] * 64] * 2], [[[True] * 64] * 2])),  # nor flags
        (kvhal.DTypeError, lambda: cache.store(s, 0, [[[None] * 64] * 2], [[[None] * 64] * 2])),
        (kvhal.DTypeError, lambda: cache.attention(0, "q", [s])),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], scale="x")),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], scale=float("nan"))),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], scale=True)),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], window=2.0)),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], window=True)),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], causal="yes")),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], q_lens=[1.0])),
        (kvhal.ShapeError, lambda: cache.attention(0, q, [s], q_lens=[True])),
        (kvhal.ShapeError, lambda: cache.attention(0, q[:, :0], [s])),  # 0 query heads: one answer everywhere
        (kvhal.ShapeError, lambda: cache.attention(0, q[:, :3], [s])),
        (kvhal.SpecError, lambda: kvhal.KVCache(cache.spec, True, backend=backend_info.name)),
        (kvhal.SpecError, lambda: kvhal.KVCache(cache.spec, 16.0, backend=backend_info.name)),
        (kvhal.SpecError, lambda: kvhal.KVCache(cache.spec, 16, backend=backend_info.name,
                                                backend_options={"no_such_option": 1})),
    ]
    for err, call in cases:
        with pytest.raises(err) as info:
            call()
        assert isinstance(info.value, kvhal.KVHalError) and len(str(info.value)) > 20, str(info.value)
    assert_same(before, snapshot(cache))
    # empty ranges are empty results, not errors, on every backend (including one that covers no page)
    for lo, hi in ((0, None), (8, 8), (0, 0), (12, 12)):
        src = empty if hi is None else s
        k0, v0 = (kvhal.to_numpy(x) for x in cache.load(src, 0, lo, hi))
        assert k0.shape == v0.shape == (0, 2, 64)
    # p1=None means "to the end" for every range call, as for load
    t = cache.seq_cp(s, 4, None)
    assert cache.seq_len(t) == 8
    cache.seq_rm(t, 2, None)
    assert cache.seq_len(t) == 2


def test_two_caches_share_one_backend_instance(backend_info, rng):
    """One instance serves any number of caches (different specs), also from two threads at once."""
    import threading

    from kvhal import registry

    fmts = [f for f in claimed(backend_info) if formats.get(f).block_len <= 32]  # head_dim 32 below
    backend = registry.instance(backend_info.name)
    specs = [
        kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fmts[-1], v_format=fmts[0], block_size=16),
        kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, k_format=fmts[0], v_format=fmts[-1], block_size=8),
    ]
    caches = [kvhal.KVCache(sp, 256, backend=backend) for sp in specs]
    refs = [kvhal.KVCache(sp, 256, backend="reference") for sp in specs]
    assert caches[0].backend is caches[1].backend
    data = [kv(rng, 70, sp.n_kv_heads, sp.head_dim) for sp in specs]
    qs = [rng.standard_normal((2, 2 * sp.n_kv_heads, sp.head_dim), dtype=np.float32) for sp in specs]
    errors: list[BaseException] = []
    outs: dict[int, np.ndarray] = {}

    def work(i: int, c: kvhal.KVCache) -> None:
        try:
            s = c.new_seq()
            for t0 in range(0, 70, 10):  # interleaved small stores, as two engines' decode loops would
                for layer in range(c.spec.n_layers):
                    c.store(s, layer, data[i][0][t0 : t0 + 10], data[i][1][t0 : t0 + 10])
            outs[i] = kvhal.to_numpy(c.attention(0, qs[i], [s], [2]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (c, r) in enumerate(zip(caches, refs)):
        s = r.new_seq()
        for layer in range(r.spec.n_layers):
            r.store(s, layer, *data[i])
        for layer in range(r.spec.n_layers):
            for x, y in zip(pool_bytes(c, layer), pool_bytes(r, layer)):
                np.testing.assert_array_equal(x, y)
        want = kvhal.to_numpy(r.attention(0, qs[i], [s], [2]))
        assert float(np.abs(outs[i] - want).max()) <= c.backend.tolerance(2) + r.backend.tolerance(2)


def test_read_write_blocks_round_trip_and_match_reference(backend_info, rng):
    """Raw block I/O: the same bytes as the reference, and written blocks read back and attend the same."""
    fmts = claimed(backend_info)
    spec_args = {"layers": 2, "bs": 8, "cap": 128}
    src = make_cache(backend_info.name, fmts[-1], fmts[0], **spec_args)
    ref = make_cache("reference", fmts[-1], fmts[0], **spec_args)
    k, v = kv(rng, 29)
    for c in (src, ref):
        s = c.new_seq()
        for layer in (0, 1):
            c.store(s, layer, k, v)
    ids = np.array([3, 0, 2], np.int64)
    got = src.backend.read_blocks(src.pools, ids)
    want = ref.backend.read_blocks(ref.pools, ids)
    assert got.dtype == np.uint8 and got.shape == (3, src.spec.block_nbytes)
    np.testing.assert_array_equal(got, want)
    for layer in (0, 1):  # and they are the pool bytes, in the documented order
        kp, vp = pool_bytes(src, layer)
        kb, vb = src.spec.page_nbytes("k"), src.spec.page_nbytes("v")
        at = layer * (kb + vb)
        np.testing.assert_array_equal(got[:, at : at + kb], kp[ids].reshape(3, -1))
        np.testing.assert_array_equal(got[:, at + kb : at + kb + vb], vp[ids].reshape(3, -1))
    # write the reference's blocks into a fresh cache of this backend: bytes and attention follow
    dst = make_cache(backend_info.name, fmts[-1], fmts[0], **spec_args)
    all_ids = np.arange(4, dtype=np.int64)
    dst.backend.write_blocks(dst.pools, all_ids[::-1].copy(), ref.backend.read_blocks(ref.pools, all_ids[::-1].copy()))
    for layer in (0, 1):
        for x, y in zip(pool_bytes(dst, layer), pool_bytes(ref, layer)):
            np.testing.assert_array_equal(x[:4], y[:4])
    with pytest.raises(kvhal.ShapeError):
        dst.backend.write_blocks(dst.pools, all_ids[:1], np.zeros((1, 3), np.uint8))


SNAPSHOT_CHILD = """
import sys, numpy as np, kvhal
spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=sys.argv[2], v_format=sys.argv[3], block_size=8)
c = kvhal.KVCache(spec, 128, backend=sys.argv[1], fingerprint=kvhal.Fingerprint("contract"))
[s] = c.restore(sys.argv[4])
q = np.load(sys.argv[5])
np.save(sys.argv[6], kvhal.to_numpy(c.attention(1, q, [s], [3])))
"""


def test_snapshot_restores_byte_identically_across_backends(backend_info, rng, tmp_path):
    """A snapshot saved on this backend restores into the reference with identical bytes (and back), and
    into a fresh process on this backend with bit-identical attention."""
    import subprocess
    import sys

    fmts = claimed(backend_info)
    fk, fv = fmts[-1], fmts[0]
    fp = kvhal.Fingerprint("contract")

    def cache(name: str) -> kvhal.KVCache:
        spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fk, v_format=fv, block_size=8)
        return kvhal.KVCache(spec, 128, backend=name, fingerprint=fp)

    src = cache(backend_info.name)
    k, v = kv(rng, 27)
    s = src.new_seq()
    src.append_tokens(s, list(range(27)))
    for layer in (0, 1):
        src.store(s, layer, k, v)
    path = tmp_path / "c.kvs"
    src.save(path, seqs=[s])
    ref = cache("reference")
    ref.new_seq()  # occupy nothing, but shift the ids
    [r] = ref.restore(path)
    got = ref.backend.read_blocks(ref.pools, np.array(ref.block_ids(r)))
    want = src.backend.read_blocks(src.pools, np.array(src.block_ids(s)))
    np.testing.assert_array_equal(got, want)
    ref.save(tmp_path / "back.kvs", seqs=[r])
    back = cache(backend_info.name)
    [b] = back.restore(tmp_path / "back.kvs")
    np.testing.assert_array_equal(
        back.backend.read_blocks(back.pools, np.array(back.block_ids(b))),
        src.backend.read_blocks(src.pools, np.array(src.block_ids(s))),
    )
    assert back.match_prefix(list(range(30)))[1] == 24
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    np.save(tmp_path / "q.npy", q)
    want = kvhal.to_numpy(src.attention(1, q, [s], [3]))
    subprocess.run([sys.executable, "-c", SNAPSHOT_CHILD, backend_info.name, fk, fv, str(path), str(tmp_path / "q.npy"),
                    str(tmp_path / "out.npy")], check=True)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), want)


def test_evict_equals_a_fresh_cache_of_the_kept_tokens(backend_info, rng):
    """After evict, attention over the kept tokens equals a fresh cache that stored only them, bit for bit."""
    from kvhal.eviction import SinkWindow

    fmt = claimed(backend_info)[-1]
    k, v = kv(rng, 45)
    c = make_cache(backend_info.name, fmt, layers=2, bs=8, cap=256)
    s = c.new_seq()
    for layer in (0, 1):
        c.store(s, layer, k, v)
    shared = c.seq_cp(s, 0, 16)  # the sinks' whole block stays shared with this copy
    res = c.evict(s, SinkWindow(sinks=8, window=13), keep_tokens=17)  # the window shrinks to 9
    kept = np.r_[np.arange(8), np.arange(36, 45)]
    np.testing.assert_array_equal(res.kept, kept)
    np.testing.assert_array_equal(res.dropped, np.setdiff1d(np.arange(45), kept))
    assert c.seq_len(s) == 17 and c.block_ids(s)[0] == c.block_ids(shared)[0]
    fresh = make_cache(backend_info.name, fmt, layers=2, bs=8, cap=256)
    f = fresh.new_seq()
    for layer in (0, 1):
        fresh.store(f, layer, k[kept], v[kept])
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    for layer in (0, 1):
        got = kvhal.to_numpy(c.attention(layer, q, [s], [2]))
        np.testing.assert_array_equal(got, kvhal.to_numpy(fresh.attention(layer, q, [f], [2])))
        for x, y in zip(c.load(s, layer), fresh.load(f, layer)):
            np.testing.assert_array_equal(kvhal.to_numpy(x), kvhal.to_numpy(y))


def test_tier_round_trip(backend_info, rng):
    """Blocks written down to a tier when their space is reused come back through match_prefix, bit-exact."""
    from kvhal.tiers import HostTier

    fmt = claimed(backend_info)[-1]
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=8)
    tier = HostTier(max_bytes=1 << 22)
    c = kvhal.KVCache(spec, 64, backend=backend_info.name, fingerprint=kvhal.Fingerprint("contract"), tiers=[tier])
    k, v = kv(rng, 33)
    s = c.new_seq()
    c.append_tokens(s, list(range(33)))
    for layer in (0, 1):
        c.store(s, layer, k, v)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    want = kvhal.to_numpy(c.attention(1, q, [s], [1])).copy()
    c.free_seq(s)
    filler = c.new_seq()
    for layer in (0, 1):
        c.store(filler, layer, *kv(rng, 64))  # reuses every cached block: written down to the tier
    c.free_seq(filler)
    assert c.stats().tier_written_blocks == 4
    t, n = c.match_prefix(list(range(33)))
    assert n == 32 and c.stats().tier_hit_blocks == 4
    for layer in (0, 1):
        c.store(t, layer, k[32:], v[32:])
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(1, q, [t], [1])), want)


def test_block_io_rejects_bad_ids(backend_info):
    c = make_cache(backend_info.name, claimed(backend_info)[-1], cap=64)
    data = c.backend.read_blocks(c.pools, np.array([0, 1]))
    for bad in (np.array([c.n_blocks]), np.array([-1]), np.array([0.5]), np.zeros((1, 1), np.int64)):
        with pytest.raises((kvhal.PositionError, kvhal.ShapeError)):
            c.backend.read_blocks(c.pools, bad)
    with pytest.raises((kvhal.PositionError, kvhal.ShapeError)):
        c.backend.write_blocks(c.pools, np.array([0]), data)  # 1 id, 2 blocks of data


@pytest.mark.parametrize("through_arena", [False, True], ids=["natural", "arena"])
def test_streamed_attention_equals_resident(backend_info, rng, monkeypatch, through_arena):
    """A sequence offloaded to host memory and streamed through the arena (or, where the pools are host memory,
    attended in place) attends like a resident one; ``arena`` forces the copy path on every backend."""
    if through_arena:
        monkeypatch.setattr(kvhal.streaming, "pools_in_host_memory", lambda pools: False)
    fmt = claimed(backend_info)[-1]
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=8)
    small = kvhal.KVCache(spec, 32, backend=backend_info.name, stream_arena_tokens=24)
    big = kvhal.KVCache(spec, 256, backend=backend_info.name)
    s, r = small.new_seq(), big.new_seq()
    k, v = kv(rng, 200)
    for start in range(0, 200, 20):
        small.store(s, 0, k[start : start + 20], v[start : start + 20])
        big.store(r, 0, k[start : start + 20], v[start : start + 20])
        small.offload(s, keep_tokens=8)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    got = kvhal.to_numpy(small.attention(0, q, [s], [3]))
    want = kvhal.to_numpy(big.attention(0, q, [r], [3]))
    assert float(np.abs(got - want).max()) <= 2 * big.backend.tolerance(3)


@pytest.mark.parametrize("tail", [0, 5])
def test_transforms_match_reference(backend_info, rng, tail):
    """Scales, rotations and the f16 tail live in the cache: on this backend they give the reference's
    pool bytes, loads and (within tolerance) attention."""
    fmt = "q8_0" if "q8_0" in claimed(backend_info) else "f16"
    kw = dict(k_scale=(0.5, 2.0), v_scale="calibrate", k_rotation="hadamard", v_rotation="hadamard", tail=tail)
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fmt, v_format=fmt, block_size=16, **kw)
    caches = [kvhal.KVCache(spec, 256, backend=name) for name in (backend_info.name, "reference")]
    k, v = kv(rng, 70)
    seqs = []
    for c in caches:
        s = c.new_seq()
        for a, b in ((0, 1), (1, 40), (40, 41), (41, 70)):
            for layer in (0, 1):
                c.store(s, layer, k[a:b], v[a:b])
        seqs.append(s)
    for layer in (0, 1):
        for got, want in zip(pool_bytes(caches[0], layer), pool_bytes(caches[1], layer)):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(caches[0].load(seqs[0], layer), caches[1].load(seqs[1], layer)):
            np.testing.assert_array_equal(kvhal.to_numpy(got), kvhal.to_numpy(want))
    assert caches[0].scales() == caches[1].scales() and caches[0].root_hash == caches[1].root_hash
    for n_q, window in ((1, None), (30, None), (3, 9)):
        q = rng.standard_normal((n_q, 4, 64), dtype=np.float32)
        outs = [kvhal.to_numpy(c.attention(1, q, [s], window=window)) for c, s in zip(caches, seqs)]
        assert float(np.abs(outs[0] - outs[1]).max()) <= sum(c.backend.tolerance(n_q) for c in caches)


def test_fused_declaration_matches_the_overrides(backend_info):
    """``fused`` names exactly the optional ops the backend overrides (``transform``: ``transform_heads``, the
    codec's per-head step); the rest run the host's float64 default."""
    cls = backend_info.cls
    assert cls is not None and cls.fused <= set(kvhal.backend.FUSED)
    for op, method in (("attention_lse",) * 2, ("attention_mass",) * 2, ("transform", "transform_heads")):
        assert (op in cls.fused) == (getattr(cls, method) is not getattr(kvhal.Backend, method)), op


@pytest.mark.parametrize("sinks", [0, 16])
def test_kltq_matches_the_numpy_spec_and_float64(backend_info, rng, sinks):
    """kltq K (side data calibrated on each layer's first store): a backend that claims it stores the numpy
    spec's records byte for byte, loads their synthesis, and attends within its tolerance of float64 attention
    on the loaded K/V (f16 sinks included); one that does not refuses with the UnsupportedError naming those
    that do."""
    fmt = "kltq:4.5"
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=fmt, v_format="q8_0", sinks=sinks)
    if fmt not in backend_info.formats:
        with pytest.raises(kvhal.UnsupportedError, match="reference"):
            kvhal.KVCache(spec, 256, backend=backend_info.name)
        return
    k, v = kv(rng, 90)
    c = kvhal.KVCache(spec, 256, backend=backend_info.name)
    s = c.new_seq()
    for a, b in ((0, 60), (60, 61), (61, 90)):
        for layer in (0, 1):
            c.store(s, layer, k[a:b], v[a:b])
    side = c.resolved_spec.k_side
    assert side.digest() == kltq.calibrate([k[:60], k[:60]], 4.5, skip=c.spec.sink_tokens).digest()
    paged = 80 if sinks else 90  # with sinks (an f16 tail path) the open page stays f16
    for layer in (0, 1):
        stored = k[:paged].astype(np.float16).astype(np.float32) if sinks else k[:paged]  # an f16 tail rounds
        records = kltq.quantize(side, layer, stored)
        if not sinks:
            got_rows, _ = c.load_rows(s, layer)
            np.testing.assert_array_equal(got_rows, records)
        kl, vl = (kvhal.to_numpy(x) for x in c.load(s, layer))
        want = kltq.dequantize(side, layer, records)
        if sinks:
            want[: c.spec.sink_tokens] = k[: c.spec.sink_tokens].astype(np.float16)
        np.testing.assert_allclose(kl[:paged], want, atol=1e-5)
        for n_q in (1, 7):
            q = rng.standard_normal((n_q, 4, 64), dtype=np.float32)
            got = kvhal.to_numpy(c.attention(layer, q, [s]))
            oracle = attention_f64(q, [kl], [vl], [n_q])
            assert float(np.abs(got - oracle).max()) <= c.backend.tolerance(n_q) + 1e-5


@pytest.mark.parametrize(("k_format", "sinks"), [("kltq:4.5", 0), ("q8_0", 16)])
def test_kltq_v_matches_the_numpy_spec_and_float64(backend_info, rng, k_format, sinks):
    """kltq V (side data calibrated on each layer's first store), beside kltq or block K: a backend that claims
    it stores the numpy spec's V records byte for byte, loads their synthesis, and attends (over V's decoded
    coefficients, the cache mapping the output back; f16 sinks merged as values) within its tolerance of
    float64 attention on the loaded K/V, a batch of two sequences; one that does not refuses with the
    UnsupportedError naming those that do."""
    fmt = "kltq:4.5"
    spec = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=k_format, v_format=fmt, sinks=sinks)
    if fmt not in backend_info.formats:
        with pytest.raises(kvhal.UnsupportedError, match="reference"):
            kvhal.KVCache(spec, 256, backend=backend_info.name)
        return
    k, v = kv(rng, 90)
    v = v + 1.5  # a mean away from 0: what the side data's mean is for
    c = kvhal.KVCache(spec, 256, backend=backend_info.name)
    seqs = [c.new_seq(), c.new_seq()]
    for a, b in ((0, 60), (60, 90)):
        for layer in (0, 1):
            c.store(seqs[0], layer, k[a:b], v[a:b])
    for layer in (0, 1):
        c.store(seqs[1], layer, k[:40] * 0.5, v[:40][::-1])
    side = c.resolved_spec.v_side
    assert side.digest() == kltq.calibrate([v[:60], v[:60]], 4.5, skip=c.spec.sink_tokens).digest()
    for layer in (0, 1):
        if not sinks:
            np.testing.assert_array_equal(c.load_rows(seqs[0], layer)[1], kltq.quantize(side, layer, v))
        loaded = [[kvhal.to_numpy(x) for x in c.load(s, layer)] for s in seqs]
        if not sinks:
            np.testing.assert_allclose(loaded[0][1], kltq.dequantize(side, layer, kltq.quantize(side, layer, v)),
                                       atol=1e-5)  # fmt: skip
        for q_lens in ([1, 1], [5, 2]):
            q = rng.standard_normal((sum(q_lens), 4, 64), dtype=np.float32)
            got = kvhal.to_numpy(c.attention(layer, q, seqs, q_lens))
            oracle = attention_f64(q, [x[0] for x in loaded], [x[1] for x in loaded], q_lens)
            assert float(np.abs(got - oracle).max()) <= c.backend.tolerance(max(q_lens)) + 1e-5


@pytest.mark.parametrize("budget", [4.5, 7])
def test_kltq_attention_with_every_code_width(backend_info, rng, budget):
    """kltq attention where the allocation spreads over every width (keys with a decaying spectrum: widths 0 to
    11 at 4.5 bits, to 12 at 7), a query group of 4 heads, decode and a few causal rows: within the backend's
    tolerance of float64 attention on the loaded K/V (the cpu kernels pick their lookup per width)."""
    fmt = f"kltq:{budget}"
    n, d = 200, 128
    spec = kvhal.CacheSpec(1, 2, d, k_format=fmt, v_format="q8_0")
    if fmt not in backend_info.formats:  # refused with the error naming the backends that run it
        with pytest.raises(kvhal.UnsupportedError, match="reference"):
            kvhal.KVCache(spec, 256, backend=backend_info.name)
        return
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    k = ((rng.standard_normal((n, 2, d)) * 10 * np.exp(-np.arange(d) / 16)) @ basis.T).astype(np.float32)
    v = rng.standard_normal((n, 2, d)).astype(np.float32)
    c = kvhal.KVCache(spec, 256, backend=backend_info.name)
    s = c.new_seq()
    c.store(s, 0, k, v)
    assert int(c.resolved_spec.k_side.alloc.max()) > 8 and int(c.resolved_spec.k_side.alloc.min()) <= 1
    kl, vl = (kvhal.to_numpy(x) for x in c.load(s, 0))
    for n_q in (1, 3):
        q = rng.standard_normal((n_q, 8, d), dtype=np.float32)
        got = kvhal.to_numpy(c.attention(0, q, [s]))
        assert float(np.abs(got - attention_f64(q, [kl], [vl], [n_q])).max()) <= c.backend.tolerance(n_q) + 1e-5
