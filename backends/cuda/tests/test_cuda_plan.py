"""The CUDA/HIP kernels' host-side logic, on the CPU: geometry, metadata packing, split-KV and its merge."""

from __future__ import annotations

import re

import numpy as np
import pytest
from kvhal_cuda import CudaBackend, plan, runtime, source

import kvhal
from kvhal import formats, registry
from kvhal.attention import visible_range
from kvhal.backend_util import format_id, format_table
from tests.oracle import attention_f64

SRC = runtime.kernel_source()


def cu_define(name: str) -> int:
    m = re.search(rf"^#define {name} (\d+)", SRC, re.M)
    assert m, f"{name} not defined in the kernel source"
    return int(m.group(1))


def test_constants_are_generated_from_the_registry_and_plan():
    for name, fid, block_len, block_bytes in format_table():
        n = f"KV_{name.upper()}"
        got = cu_define(n), cu_define(f"{n}_BLOCK_LEN"), cu_define(f"{n}_BLOCK_BYTES")
        assert got == (fid, block_len, block_bytes)
    assert cu_define("KV_NW") == plan.NUM_WARPS
    assert cu_define("KV_MAXC") * 32 == plan.MAX_HEAD_DIM
    assert cu_define("KV_RPW_MAX") == plan.MAX_ROWS_PER_WARP
    # nothing typed twice: the checked-in source defines none of them and spells no block size
    cu = (source.KERNEL_DIR / "kvhal.cu").read_text() + (source.KERNEL_DIR / "platform.h").read_text()
    assert not re.search(r"^#define KV_(NW|MAXC|RPW_MAX|F32|F16|BF16|Q\d)", cu, re.M)
    assert not re.search(r"\b(34|18|20|22|24|17|36|12)\b", re.sub(r"//.*", "", cu))


def test_kernels_dispatch_every_registered_format():
    dispatch = re.search(r"#define KV_DISPATCH\(fmt, CALL\)(.*?)\n\n", SRC, re.S)
    assert dispatch
    cases = set(re.findall(r"KV_(\w+)\)", dispatch.group(1)))
    assert {f"{n.upper()}" for n in formats.plain_names()} <= cases | {"DEQ"}
    assert CudaBackend.formats == frozenset(formats.plain_names())


@pytest.mark.parametrize("fmt", [f for f in formats.plain_names() if formats.get(f).k_page is not None])
def test_per_channel_k_pages_run_as_k_and_as_v(fmt):
    backend = CudaBackend.__new__(CudaBackend)  # supports() needs no device
    for k in (fmt, "f16"):
        spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=k, v_format=fmt)
        assert all(backend.supports(spec, op) is None for op in ("store", "load", "attention"))
        cp = plan.CachePlan.of(spec)
        # only a per-channel K side carries KV_KPAGED; V rows of the same format are plain rows
        assert cp.k.fmt_id == format_id(k) | (plan.KPAGED if k == fmt else 0)
        assert cp.v.fmt_id == format_id(fmt)


@pytest.mark.parametrize("fmt", [f for f in formats.plain_names() if formats.get(f).k_page is not None])
@pytest.mark.parametrize("n,h,d,bs", [(16, 1, 32, 16), (96, 3, 256, 32), (0, 2, 64, 16)])
def test_store_launch_of_k_pages_is_a_cta_per_page_and_head_a_thread_per_code_byte(fmt, n, h, d, bs):
    name, grid, block = plan.store_launch(fmt, n, h, d, bs)
    assert name == "kvhal_store_kpage"
    assert grid == (max(1, n // bs * h), 1, 1)  # one CTA when there is nothing: the kernel's guard returns
    code_bytes = d * formats.get(fmt).k_page.bits // 8
    assert block[0] % 32 == 0 and code_bytes <= block[0] < code_bytes + 32


def test_every_launched_kernel_is_in_the_source():
    launched = set(re.findall(r'"(kvhal_\w+)"', (source.KERNEL_DIR.parent / "__init__.py").read_text()))
    launched |= set(re.findall(r'"(kvhal_\w+)"', (source.KERNEL_DIR.parent / "plan.py").read_text()))
    assert len(source.kernel_names()) == 12 and launched == set(source.kernel_names())


@pytest.mark.parametrize("fmt", formats.plain_names())
@pytest.mark.parametrize("dims", [(1, 1, 64), (37, 2, 64), (5, 8, 256), (3, 3, 32), (2, 1, 40)])
def test_store_launch_covers_every_block(fmt, dims):
    n, h, d = dims
    if d % formats.get(fmt).block_len:
        pytest.skip(f"{fmt} rows hold whole {formats.get(fmt).block_len}-value blocks")
    name, grid, block = plan.store_launch(fmt, n, h, d)
    threads = grid[0] * block[0]
    assert block[0] % 32 == 0 and block[0] <= 1024
    if formats.get(fmt).block_len in (32, 64):  # a warp per 32 values: a block, or half an nvfp4 block
        assert name == "kvhal_store_quant"
        warps = n * h * d // 32
        assert threads // 32 >= warps > (grid[0] - 1) * block[0] // 32  # all blocks, no empty CTA
    else:
        assert name == "kvhal_store_float"
        assert threads >= n * h * d > (grid[0] - 1) * block[0]


@pytest.mark.parametrize("d", [1, 8, 40, 63, 64, 80, 96, 128, 160, 192, 255, 256])
def test_prefill_geometry_fits_and_is_bank_conflict_free(d):
    g = plan.prefill_geometry(d)
    assert g.smem_bytes <= plan.SMEM_LIMIT
    assert g.smem_bytes == 4 * (g.rows_per_tile * d + g.tile_tokens * g.k_stride + g.tile_tokens * d)
    assert g.k_stride >= d and g.k_stride % 2 == 1
    # lane j reads K[j][e]: 32 lanes at one column hit 32 distinct banks
    banks = {(j * g.k_stride) % 32 for j in range(min(32, g.tile_tokens))}
    assert len(banks) == min(32, g.tile_tokens)
    assert 1 <= g.rows_per_warp <= plan.MAX_ROWS_PER_WARP and g.tile_tokens <= 32
    if d <= 128:
        assert (g.tile_tokens, g.rows_per_warp) == (32, 4)


def test_head_dim_limit_is_refused_by_supports():
    with pytest.raises(kvhal.UnsupportedError, match="head_dim 512"):
        plan.prefill_geometry(512)
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=512, k_format="q8_0", v_format="q8_0")
    backend = CudaBackend.__new__(CudaBackend)  # supports() needs no device
    assert "head_dim 512 > 256" in (backend.supports(spec, "attention") or "")
    assert backend.supports(spec, "store") is None and backend.supports(spec, "load") is None
    assert "attention: head_dim 512" in (registry.refusal(backend, spec) or "")  # so no cache is made with it
    assert plan.CachePlan.of(spec).prefill is None
    assert backend.supports(kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=256), "attention") is None


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 7])
def test_meta_carries_the_core_visible_range(causal, window):
    rng = np.random.default_rng(4)
    table, lens, qls = ragged(rng, 6)
    p = plan.plan_attention(table, lens, qls, n_heads=4, head_dim=64, block_size=16, n_sm=8, causal=causal,
                            window=window)  # fmt: skip
    u = p.unpack()
    _, _, lo, hi = visible_range(lens, qls, causal, window)
    assert np.array_equal(u["lo"], lo) and np.array_equal(u["hi"], hi)
    assert (u["hi"] > u["lo"]).all()  # every query sees at least one key


def test_pack_block_table_checks_pages():
    t = plan.pack_block_table(np.array([[3, 1, -1], [0, -1, -1]], np.int64), np.array([20, 5]), 16)
    assert t.dtype == np.int32 and t.flags.c_contiguous
    with pytest.raises(kvhal.ShapeError, match="-1 inside"):
        plan.pack_block_table(np.array([[3, -1]]), np.array([20]), 16)
    with pytest.raises(kvhal.ShapeError, match="narrower"):
        plan.pack_block_table(np.array([[3]]), np.array([20]), 16)


def ragged(rng, n_seqs, bs=16, max_len=300):
    lens = rng.integers(1, max_len, n_seqs).astype(np.int32)
    qls = np.minimum(lens, rng.choice([1, 1, 3, 17, 40], n_seqs)).astype(np.int32)
    width = int(-(-lens.max() // bs))
    table = np.full((n_seqs, width), -1, np.int32)
    perm = rng.permutation(n_seqs * width)  # pages scattered over the pool
    for s, n in enumerate(lens):
        nb = -(-int(n) // bs)
        table[s, :nb] = perm[s * width : s * width + nb]
    return table, lens, qls


@pytest.mark.parametrize("seed", range(5))
def test_plan_routes_every_row_once(seed):
    rng = np.random.default_rng(seed)
    table, lens, qls = ragged(rng, 7)
    p = plan.plan_attention(table, lens, qls, n_heads=8, head_dim=128, block_size=16, n_sm=132)
    u = p.unpack()
    assert np.array_equal(u["table"], table) and np.array_equal(u["seq_lens"], lens)
    assert np.array_equal(u["q_lens"], qls)
    assert np.array_equal(u["q_start"], np.concatenate([[0], np.cumsum(qls)[:-1]]))
    rows = [int(r) for _, r in u["decode"]]
    for s, i0, nr in u["tiles"]:
        assert 1 <= nr <= p.prefill.rows_per_tile and qls[s] > 1
        rows += [int(u["q_start"][s]) + i0 + i for i in range(nr)]
    assert sorted(rows) == list(range(int(qls.sum())))
    for s, r in u["decode"]:
        assert qls[s] == 1 and r == u["q_start"][s]
    assert p.meta.dtype == np.int32 and p.n_rows == qls.sum()
    launches = plan.attention_launches(p, 8, 128, 136)
    assert all(g[1] == 8 and g[2] <= plan.GRID_YZ_MAX for _, g, _ in launches)
    assert (launches[-1][0] == "kvhal_attn_merge") == (p.n_splits > 1)


def test_decode_group_shares_kv_rows_within_the_register_budget():
    # (n_heads, n_kv_heads, head_dim) -> query heads per decode CTA
    cases = {(32, 8, 128): 4, (64, 8, 128): 4, (8, 1, 64): 8, (8, 1, 128): 4, (4, 2, 256): 2, (8, 1, 256): 2,
             (32, 32, 128): 1, (6, 2, 64): 1, (12, 2, 64): 2, (2, 1, 512): 1}  # fmt: skip
    for (hq, hkv, d), g in cases.items():
        assert plan.decode_group(hq, hkv, d) == g, (hq, hkv, d)
        assert g == 1 or g * -(-d // 32) <= plan.DECODE_LANE_VALUES


@pytest.mark.parametrize("d", [1, 8, 32, 33, 40, 64, 96, 128, 136, 160, 256])
def test_decode_smem_fits_every_format_and_group(d):
    """q rows, per-warp tile buffers and staged K rows (the warp merge reuses them) fit 48 KiB for every K format
    and every group decode_group picks; staged rows have an odd word stride, so the 32 lanes reading word i of
    their own row hit 32 distinct banks; rows past DECODE_STAGE_ROW_BYTES are not staged."""
    for fmt in formats.plain_names():
        f = formats.get(fmt)
        if f.k_page is not None or d % f.block_len:
            continue
        row = d // f.block_len * f.block_bytes
        words = plan.decode_stage_words(row)
        if row <= plan.DECODE_STAGE_ROW_BYTES:
            assert words % 2 == 1 and 4 * words >= row
            assert len({(j * words) % 32 for j in range(32)}) == 32
        else:
            assert words == 0 and fmt in ("f32", "f16", "bf16")
        for hq in (8, 16, 32, 64):
            g = plan.decode_group(hq, 1, d)
            smem = plan.decode_smem_bytes(d, g, row)
            q, warp = 4 * g * (-(-d // 4) * 4), 4 * g * 32 + 2 * 8 * 32 + 4 * 32 * words
            assert smem == max(q + plan.NUM_WARPS * warp, 4 * plan.NUM_WARPS * g * (d + 2)) <= plan.SMEM_LIMIT
            assert plan.CTAS_PER_SM * smem <= 228 * 1024  # 4 CTAs per SM stay viable (sm_90: 228 KiB per SM)


def test_split_heuristic():
    # one long decode on a big GPU: split; a full batch: no split; short context: no split
    n, pages = plan.choose_splits(8, 32768, 16, 132, 1, 8, 128)
    assert n > 1 and pages * 16 >= plan.MIN_SPLIT_TOKENS and (n - 1) * pages < 2048 <= n * pages
    assert plan.choose_splits(4096, 32768, 16, 132, 512, 8, 128)[0] == 1
    assert plan.choose_splits(8, 200, 16, 132, 1, 8, 128)[0] == 1
    # the workspace cap binds for huge prefill batches
    n, _ = plan.choose_splits(1, 1 << 20, 16, 132, 64, 64, 256)
    assert 1 < n and n * 64 * 64 * 257 * 4 <= plan.WORKSPACE_LIMIT < (n + 1) * 64 * 64 * 257 * 4


@pytest.mark.parametrize("n_sm", [4, 108, 132])
@pytest.mark.parametrize("n_ctas", [1, 4, 7, 24, 100, 300])
@pytest.mark.parametrize("max_kv", [300, 4096, 32768, 131072])
def test_split_count_follows_the_wave_efficiency_rule(n_sm, n_ctas, max_kv):
    """Against a brute force over every split count: no split once the CTAs fill 80% of the slots; within one wave,
    the most the bounds allow; past it, no count with fewer splits is within 85% of the best wave efficiency."""
    n, pages = plan.choose_splits(n_ctas, max_kv, 16, n_sm, 1, 32, 128)
    slots, max_pages = plan.CTAS_PER_SM * n_sm, -(-max_kv // 16)
    assert (n - 1) * pages < max_pages <= n * pages  # whole pages, no empty split
    if n_ctas >= 0.8 * slots:
        assert n == 1
        return
    allowed = [m for m in range(1, max_pages + 1)
               if m <= -(-slots // n_ctas) and m <= max(1, max_kv // plan.MIN_SPLIT_TOKENS)
               and -(-max_pages // -(-max_pages // m)) == m]  # fmt: skip
    assert n in allowed
    if n_ctas * max(allowed) <= slots:
        assert n == max(allowed)
    else:
        best = max(plan.split_efficiency(n_ctas, m, slots) for m in allowed)
        assert plan.split_efficiency(n_ctas, n, slots) >= 0.85 * best
        assert all(plan.split_efficiency(n_ctas, m, slots) < 0.85 * best for m in allowed if m < n)


def split_kv_emulation(q, ks, vs, p, bs, scale):
    """The kernels' arithmetic in float64: every (row, head, split) gives a normalized partial and its
    log-sum-exp over the split's visible tokens (-inf when none), merged by plan.merge_splits."""
    R, Hq, D = q.shape
    part_o = np.zeros((p.n_splits, R, Hq, D))
    part_lse = np.full((p.n_splits, R, Hq), -np.inf)
    u = p.unpack()
    for s in range(p.n_seqs):
        nq, r0 = int(u["q_lens"][s]), int(u["q_start"][s])
        group = Hq // ks[s].shape[1]
        for i in range(nq):
            lo, hi = int(u["lo"][r0 + i]), int(u["hi"][r0 + i])
            for sp in range(p.n_splits):
                a, b = plan.split_range(sp, p.split_pages, bs)
                a, b = max(a, lo), min(b, hi)
                if a >= b:
                    continue
                for h in range(Hq):
                    sc = ks[s][a:b, h // group].astype(np.float64) @ q[r0 + i, h].astype(np.float64) * scale
                    m = sc.max()
                    w = np.exp(sc - m)
                    part_o[sp, r0 + i, h] = w @ vs[s][a:b, h // group] / w.sum()
                    part_lse[sp, r0 + i, h] = m + np.log(w.sum())
    return plan.merge_splits(part_o, part_lse), part_lse


@pytest.mark.parametrize("causal,window", [(True, None), (True, 40), (False, None), (False, 5)])
def test_split_kv_merge_equals_float64_attention(causal, window):
    rng = np.random.default_rng(7)
    bs, Hkv, Hq, D = 16, 2, 4, 32
    table, lens, qls = ragged(rng, 5, bs, 700)
    lens[0], qls[0] = 3, 1  # a short sequence: every split past its one page is empty
    p = plan.plan_attention(table, lens, qls, n_heads=Hq, head_dim=D, block_size=bs, n_sm=64, causal=causal,
                            window=window)  # fmt: skip
    assert p.n_splits > 1
    ks = [rng.standard_normal((n, Hkv, D)) for n in lens]
    vs = [rng.standard_normal((n, Hkv, D)) for n in lens]
    q = rng.standard_normal((int(qls.sum()), Hq, D))
    got, lse = split_kv_emulation(q, ks, vs, p, bs, 0.2)
    assert np.isneginf(lse).any()  # some splits lie past short sequences or outside windows
    want = attention_f64(q, ks, vs, list(qls), scale=0.2, causal=causal, window=window)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_merge_is_associative_over_split_boundaries():
    rng = np.random.default_rng(3)
    sc, v = rng.standard_normal(100) * 4, rng.standard_normal((100, 8))
    full = np.exp(sc - sc.max()) @ v / np.exp(sc - sc.max()).sum()
    for cuts in ([50], [1, 99], [10, 20, 30, 90]):
        edges = [0, *cuts, 100]
        o = np.stack([np.exp(sc[a:b] - sc[a:b].max()) @ v[a:b] / np.exp(sc[a:b] - sc[a:b].max()).sum()
                      for a, b in zip(edges, edges[1:], strict=False)])  # fmt: skip
        lse = np.array(
            [
                sc[a:b].max() + np.log(np.exp(sc[a:b] - sc[a:b].max()).sum())
                for a, b in zip(edges, edges[1:], strict=False)
            ]
        )
        np.testing.assert_allclose(plan.merge_splits(o, lse), full, atol=1e-13)


def test_arch_policy():
    assert plan.arch_refusal(75, 13) is None and plan.arch_refusal(120, 13) is None
    r = plan.arch_refusal(70, 13)
    assert r and "CUDA 13" in r and "kvhal-cuda12" in r
    assert plan.arch_refusal(70, 12) is None
    assert "older than sm_70" in (plan.arch_refusal(61, 12) or "")


CUDA13 = {
    "artifacts": [{"kind": "cubin", "arch": f"sm_{a}", "file": f"kvhal.sm_{a}.cubin"}
                  for a in (75, 80, 86, 89, 90, 100, 120)]
    + [{"kind": "ptx", "arch": "compute_120", "file": "kvhal.compute_120.ptx"}]
}  # fmt: skip


@pytest.mark.parametrize(
    "cc,kind,arch",
    [(89, "cubin", "sm_89"), (87, "cubin", "sm_86"), (103, "cubin", "sm_100"), (121, "cubin", "sm_120"),
     (130, "ptx", "compute_120"), (75, "cubin", "sm_75")],
)  # fmt: skip
def test_choose_cuda_binary(cc, kind, arch):
    c = plan.choose_cuda_binary(cc, CUDA13)
    assert (c.kind, c.arch) == (kind, arch) and c.file


def test_choose_binary_falls_back_to_compile():
    assert plan.choose_cuda_binary(90, {}).kind == "compile"
    only_ptx = {"artifacts": [{"kind": "ptx", "arch": "compute_90", "file": "x.ptx"}]}
    assert plan.choose_cuda_binary(86, only_ptx).kind == "compile"  # PTX JITs only upwards
    hip = {"artifacts": [{"kind": "hsaco", "arch": "gfx90a", "file": "kvhal.gfx90a.hsaco"}]}
    assert plan.choose_hip_binary("gfx90a:sramecc+:xnack-", hip).kind == "hsaco"
    assert plan.choose_hip_binary("gfx942", hip).kind == "compile"
