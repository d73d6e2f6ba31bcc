"""Host-side logic of the CUDA/HIP kernels, in plain numpy so it is unit-tested without a GPU.

Launch geometry, the device limits a spec must fit, the packed metadata buffer the attention kernels
read, the split-KV partition and its log-sum-exp merge, and which compiled kernel binary fits a device.
The constants below reach ``kernels/kvhal.cu`` as generated defines (``source.constants_header``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvhal import formats
from kvhal.attention import visible_range
from kvhal.backend_util import format_id
from kvhal.errors import ShapeError, UnsupportedError
from kvhal.spec import CacheSpec

NUM_WARPS = 4  # KV_NW: warps per attention CTA
MAX_HEAD_DIM = 256  # 32 * KV_MAXC: lane-owned output elements live in registers
MAX_ROWS_PER_WARP = 4  # KV_RPW_MAX
ELEMENTWISE_THREADS = 256
SMEM_LIMIT = 48 * 1024  # static limit on every CUDA arch and AMD's 64 KiB LDS; no opt-in attribute needed
GRID_YZ_MAX = 65535
# CTAs resident per SM, as the attention kernels' __launch_bounds__(KV_NW * 32, 4) allow: a split-KV grid aims to
# fill them
CTAS_PER_SM = 4
DECODE_LANE_VALUES = 16  # q and output values per lane a grouped decode CTA keeps in registers (kvhal_attn_decode)
# KV_DEC_STAGE_MAX: decode K rows of at most this many bytes are staged in shared memory per 32-token tile (every
# block format and fp8 up to head_dim 256, f16/bf16 to 136); wider rows (f32, f16/bf16 past 136) are read by each
# lane straight from the pool
DECODE_STAGE_ROW_BYTES = 272
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (launch, merge) outweighs its parallelism
WORKSPACE_LIMIT = 256 << 20  # bytes of split partials one call may allocate
KPAGED = 1 << 8  # KV_KPAGED: or'ed into the K format id when K is stored per channel over whole pages (kivi4/kivi2)

# CUDA 13 dropped sm_50..sm_72; CUDA 12 still builds sm_50+, kvhal's binaries start at sm_70
MIN_ARCH = {12: 70, 13: 75}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---- what a spec must fit ------------------------------------------------------------------------------


def spec_refusal(spec: CacheSpec, op: str) -> str | None:
    """Why the kernels cannot run ``op`` for ``spec``, or None (``CudaBackend.supports``; nothing it passes
    is refused later). Store, load and copies take any spec (K per channel over whole pages too); attention
    has two limits."""
    if op != "attention":
        return None
    if spec.head_dim > MAX_HEAD_DIM:
        return (
            f"head_dim {spec.head_dim} > {MAX_HEAD_DIM}: the CUDA/HIP attention kernels keep a row's output in "
            f"registers (32 lanes x {MAX_HEAD_DIM // 32}); use the cpu or reference backend for wider heads"
        )
    if spec.n_kv_heads > GRID_YZ_MAX:
        return f"n_kv_heads {spec.n_kv_heads} > {GRID_YZ_MAX}, the most query heads one attention launch covers"
    return None


def quantized(fmt: str) -> bool:
    """Block formats: one 32-lane warp quantizes 32 values, a block or half of nvfp4's 64-value block (kvhal.cu
    checks the block lengths); fp8 and the float formats take one thread per value."""
    return formats.get(fmt).block_len > 1


@dataclass(frozen=True)
class PoolPlan:
    """One side (K or V) of a cache as its kernels see it."""

    fmt: str
    fmt_id: int
    row_bytes: int
    page_bytes: int  # one layer's page of one block: n_kv_heads * block_size rows


@dataclass(frozen=True)
class CachePlan:
    """What every call on one cache needs, fixed by its spec: built once by ``allocate`` (``Pools.state``)."""

    n_kv_heads: int
    head_dim: int
    block_size: int
    k: PoolPlan
    v: PoolPlan
    prefill: PrefillGeometry | None  # None when attention refuses the spec (head_dim too wide)

    @classmethod
    def of(cls, spec: CacheSpec) -> CachePlan:
        def side(fmt: str, row_bytes: int, which: str) -> PoolPlan:
            paged = which == "k" and spec.k_paged  # the kernels take such a K page whole (KV_KPAGED)
            return PoolPlan(fmt, format_id(fmt) | (KPAGED if paged else 0), row_bytes, spec.page_nbytes(which))

        return cls(
            spec.n_kv_heads,
            spec.head_dim,
            spec.block_size,
            side(spec.k_format, spec.k_row_bytes, "k"),
            side(spec.v_format, spec.v_row_bytes, "v"),
            prefill_geometry(spec.head_dim) if spec_refusal(spec, "attention") is None else None,
        )


# ---- elementwise kernels: store, load, copy, raw block I/O -------------------------------------------


def grid_1d(n_threads: int, threads: int = ELEMENTWISE_THREADS) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and block for one thread per item (x may reach 2**31 - 1 on every supported arch)."""
    blocks = max(1, _ceil(n_threads, threads))
    if blocks > 2**31 - 1:
        raise ShapeError(f"{n_threads} work items exceed one kernel launch; store or load fewer tokens per call")
    return (blocks, 1, 1), (threads, 1, 1)


def store_launch(
    fmt: str, n: int, n_heads: int, head_dim: int, paged_bs: int = 0
) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """kvhal_store_quant runs one 32-lane warp per 32-value block; kvhal_store_float one thread per value;
    kvhal_store_kpage (``paged_bs``: K per channel over whole pages of that many tokens) one CTA per (page,
    head), a thread per code byte of a row."""
    if paged_bs:
        bits = formats.get(fmt).k_page.bits  # type: ignore[union-attr]
        threads = min(ELEMENTWISE_THREADS, _ceil(head_dim * bits // 8, 32) * 32)
        pages = n // paged_bs * n_heads
        if pages > 2**31 - 1:
            raise ShapeError(f"{pages} K pages exceed one kernel launch; store fewer tokens per call")
        return "kvhal_store_kpage", (max(1, pages), 1, 1), (threads, 1, 1)
    if quantized(fmt):
        grid, block = grid_1d(n * n_heads * (head_dim // 32) * 32)
        return "kvhal_store_quant", grid, block
    grid, block = grid_1d(n * n_heads * head_dim)
    return "kvhal_store_float", grid, block


def blocks_launch(n_blocks: int, n_layers: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """kvhal_blocks_gather/scatter: one CTA per (block, layer, K or V) page, its threads striding the page."""
    return grid_1d(n_blocks * n_layers * 2 * ELEMENTWISE_THREADS)


# ---- attention geometry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillGeometry:
    rows_per_warp: int  # query rows each warp owns; a tile holds NUM_WARPS * rows_per_warp rows
    tile_tokens: int  # K/V tokens staged in shared memory per step (<= 32: lane j scores token j)
    k_stride: int  # floats per staged K row: odd, so lanes reading the same column hit distinct banks
    smem_bytes: int

    @property
    def rows_per_tile(self) -> int:
        return NUM_WARPS * self.rows_per_warp


def k_stride(head_dim: int) -> int:
    return head_dim | 1


def prefill_geometry(head_dim: int, smem_limit: int = SMEM_LIMIT) -> PrefillGeometry:
    """The largest tile that fits: q rows, a K tile (padded stride) and a V tile, all f32."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise UnsupportedError(f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM}, what the CUDA/HIP kernels hold")
    kst = k_stride(head_dim)
    for bt, rpw in ((32, 4), (32, 2), (16, 4), (16, 2), (32, 1), (16, 1), (8, 4), (8, 2), (8, 1)):
        smem = 4 * (NUM_WARPS * rpw * head_dim + bt * kst + bt * head_dim)
        if smem <= smem_limit:
            return PrefillGeometry(rpw, bt, kst, smem)
    raise UnsupportedError(f"head_dim {head_dim} does not fit a prefill tile in {smem_limit} bytes of shared memory")


def decode_group(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Query heads one decode CTA attends together over their shared KV head, so each K/V row is read and
    dequantized once for all of them: the most of 8, 4, 2, 1 that divides the GQA group and whose per-lane
    registers (group x head_dim / 32 of q and of the output each) stay within DECODE_LANE_VALUES."""
    group = n_heads // n_kv_heads
    chunks = _ceil(head_dim, 32)
    return next(g for g in (8, 4, 2, 1) if group % g == 0 and (g == 1 or g * chunks <= DECODE_LANE_VALUES))


def decode_stage_words(k_row_bytes: int) -> int:
    """32-bit words per staged K row of kvhal_attn_decode: odd, so lane j reading word i of row j hits bank
    (j * words + i) % 32, distinct over the 32 lanes; 0 when the rows are too wide to stage."""
    return (_ceil(k_row_bytes, 4) | 1) if k_row_bytes <= DECODE_STAGE_ROW_BYTES else 0


def decode_smem_bytes(head_dim: int, group: int, k_row_bytes: int) -> int:
    """kvhal_attn_decode's shared memory: the group's pre-scaled q rows [group][head_dim rounded up to 4] f32, and
    per warp its tile's weights [group][32] f32, K and V row offsets [32] i64 each and staged K rows
    [32][decode_stage_words] u32; the warps' softmax states [NUM_WARPS][group][head_dim + 2] f32, merged at the
    end, reuse the same bytes."""
    q = 4 * group * (_ceil(head_dim, 4) * 4)
    per_warp = 4 * group * 32 + 2 * 8 * 32 + 4 * 32 * decode_stage_words(k_row_bytes)
    return max(q + NUM_WARPS * per_warp, 4 * NUM_WARPS * group * (head_dim + 2))


def split_range(p: int, split_pages: int, block_size: int) -> tuple[int, int]:
    """Token range of split ``p``: whole pages, so a split never straddles one."""
    return p * split_pages * block_size, (p + 1) * split_pages * block_size


def split_efficiency(n_ctas: int, n_splits: int, slots: int) -> float:
    """The fraction of the last wave's CTA slots a grid of ``n_ctas * n_splits`` CTAs keeps busy over its waves:
    ``waves / ceil(waves)`` with ``waves = n_ctas * n_splits / slots`` (FlashAttention-2's num_splits_heuristic)."""
    waves = n_ctas * n_splits / slots
    return waves / math.ceil(waves)


def choose_splits(
    n_ctas: int,
    max_kv: int,
    block_size: int,
    n_sm: int,
    n_rows: int,
    n_heads: int,
    head_dim: int,
) -> tuple[int, int]:
    """(n_splits, split_pages): split KV across CTAs only when rows x heads alone leave the GPU idle.

    Sized from the SM count as FlashAttention-2 / FlashInfer do: the slots are CTAS_PER_SM CTAs per SM; a grid
    that fills 80% of them is not split; otherwise, of the split counts the bounds allow (each split at least
    MIN_SPLIT_TOKENS tokens of whole pages, the partials n_splits x rows x heads x (head_dim + 1) f32 under
    WORKSPACE_LIMIT, at most one wave of slots): the most when even they stay within one wave, else the fewest
    whose wave efficiency (``split_efficiency``) is within 85% of the best, so no split pays for a second wave
    left mostly idle.
    """
    max_pages = max(1, _ceil(max_kv, block_size))
    slots = CTAS_PER_SM * n_sm
    n_ctas = max(1, n_ctas)
    if n_ctas >= 0.8 * slots:
        return 1, max_pages
    by_len = max(1, max_kv // MIN_SPLIT_TOKENS)
    by_mem = max(1, WORKSPACE_LIMIT // max(1, 4 * n_rows * n_heads * (head_dim + 1)))
    most = max(1, min(_ceil(slots, n_ctas), by_len, by_mem, max_pages, GRID_YZ_MAX))
    # split counts that differ in pages per split (more splits of the same size only add empty ones)
    counts = sorted({_ceil(max_pages, _ceil(max_pages, n)) for n in range(1, most + 1)})
    if n_ctas * counts[-1] <= slots:  # under one wave even at the most: every split adds parallelism
        n = counts[-1]
    else:
        eff = {n: split_efficiency(n_ctas, n, slots) for n in counts}
        n = next(n for n in counts if eff[n] >= 0.85 * max(eff.values()))
    split_pages = _ceil(max_pages, n)
    return _ceil(max_pages, split_pages), split_pages


# ---- per-call plan and metadata -----------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the attention launches need; ``meta`` is uploaded once per call."""

    # int32: table [S, tstride] | seq_lens | q_lens | q_start | lo [R] | hi [R] | decode (s, row) | tiles (s, i0, nr)
    meta: np.ndarray
    n_seqs: int
    tstride: int
    range_off: int  # row r sees KV [meta[range_off + r], meta[range_off + R + r])
    decode_off: int
    n_decode: int
    tile_off: int
    n_tiles: int
    n_rows: int
    n_splits: int
    split_pages: int
    prefill: PrefillGeometry
    decode_group: int = 1  # query heads per decode CTA (decode_group())

    def unpack(self) -> dict[str, np.ndarray]:
        """The sections of ``meta`` as the kernels index them (for tests and debugging)."""
        S, ts, R, m = self.n_seqs, self.tstride, self.n_rows, self.meta
        base = S * ts
        return {
            "table": m[:base].reshape(S, ts),
            "seq_lens": m[base : base + S],
            "q_lens": m[base + S : base + 2 * S],
            "q_start": m[base + 2 * S : base + 3 * S],
            "lo": m[self.range_off : self.range_off + R],
            "hi": m[self.range_off + R : self.range_off + 2 * R],
            "decode": m[self.decode_off : self.decode_off + 2 * self.n_decode].reshape(-1, 2),
            "tiles": m[self.tile_off : self.tile_off + 3 * self.n_tiles].reshape(-1, 3),
        }


def pack_block_table(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """The core's ``[S, max_blocks]`` table (padded with -1) as C-contiguous int32, every used page checked."""
    table = np.ascontiguousarray(block_table, dtype=np.int32)
    if table.ndim != 2 or table.shape[0] != len(seq_lens):
        raise ShapeError(f"block_table has shape {table.shape}; expected [{len(seq_lens)}, max_blocks]")
    need = -(-np.asarray(seq_lens, np.int64) // block_size)
    if (need > table.shape[1]).any():
        raise ShapeError("block_table is narrower than its sequences need")
    used = np.arange(table.shape[1])[None, :] < need[:, None]
    if (table[used] < 0).any():
        raise ShapeError("block_table has a -1 inside a sequence's pages")
    return table


def plan_attention(
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    q_lens: np.ndarray,
    *,
    n_heads: int,
    head_dim: int,
    block_size: int,
    n_sm: int,
    causal: bool = True,
    window: int | None = None,
    geometry: PrefillGeometry | None = None,
    n_kv_heads: int | None = None,
) -> AttentionPlan:
    """Route each sequence's queries (one query: the split-KV decode kernel; more: prefill tiles) and give
    every query row its visible KV interval (``kvhal.attention.visible_range``)."""
    seq_lens = np.asarray(seq_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    table = pack_block_table(block_table, seq_lens, block_size)
    geom = geometry or prefill_geometry(head_dim)
    S, ts = table.shape
    q_start = np.zeros(S, np.int32)
    np.cumsum(q_lens[:-1], out=q_start[1:])
    decode, tiles = [], []
    for s in range(S):
        nq = int(q_lens[s])
        if nq == 1:
            decode.append((s, int(q_start[s])))
        else:
            for i0 in range(0, nq, geom.rows_per_tile):
                tiles.append((s, i0, min(geom.rows_per_tile, nq - i0)))
    n_rows = int(q_lens.sum())
    if len(decode) > 2**31 - 1 or len(tiles) > 2**31 - 1 or n_heads > GRID_YZ_MAX:
        raise ShapeError(
            f"attention over {n_rows} query rows x {n_heads} heads exceeds one launch grid; attend in smaller batches"
        )
    _, _, lo, hi = visible_range(seq_lens, q_lens, causal, window)
    group = decode_group(n_heads, n_kv_heads or n_heads, head_dim)
    n_ctas = len(decode) * (n_heads // group) + len(tiles) * n_heads
    n_splits, split_pages = choose_splits(n_ctas, int(seq_lens.max()), block_size, n_sm, n_rows, n_heads, head_dim)
    dec = np.asarray(decode, np.int32).reshape(-1)
    til = np.asarray(tiles, np.int32).reshape(-1)
    meta = np.concatenate([table.reshape(-1), seq_lens, q_lens, q_start, lo, hi, dec, til]).astype(np.int32)
    range_off = S * ts + 3 * S
    decode_off = range_off + 2 * n_rows
    return AttentionPlan(
        meta, S, ts, range_off, decode_off, len(decode), decode_off + dec.size, len(tiles), n_rows, n_splits,
        split_pages, geom, group,
    )  # fmt: skip


# ---- the split-KV merge, as kvhal_attn_merge computes it ----------------------------------------------


def merge_splits(part_o: np.ndarray, part_lse: np.ndarray) -> np.ndarray:
    """``part_o [P, ..., D]`` (each split normalized) and ``part_lse [P, ...]`` into the full softmax output.

    Splits with no visible token carry lse = -inf and weigh nothing.
    """
    M = part_lse.max(axis=0)
    with np.errstate(invalid="ignore"):
        w = np.where(np.isneginf(part_lse), 0.0, np.exp(part_lse - M))
    return (w[..., None] * part_o).sum(axis=0) / w.sum(axis=0)[..., None]


# ---- which compiled binary runs on a device -------------------------------------------------------------


@dataclass(frozen=True)
class KernelChoice:
    kind: str  # "cubin" | "ptx" | "hsaco" | "compile"
    arch: str  # the binary's target (sm_86, compute_120, gfx90a) or the arch to compile for
    file: str | None  # prebuilt file name in the manifest, None for "compile"
    note: str  # why this one (for probe reasons and warnings)


def arch_refusal(cc: int, runtime_major: int) -> str | None:
    """Why the installed CUDA cannot run kvhal on compute capability ``cc`` (e.g. 70), or None."""
    floor = MIN_ARCH.get(runtime_major, MIN_ARCH[max(MIN_ARCH)])
    if cc >= floor:
        return None
    if runtime_major >= 13 and cc >= MIN_ARCH[12]:
        return (
            f"sm_{cc} is not supported by CUDA {runtime_major} (it dropped Volta and older); "
            "install kvhal-cuda12 (cupy-cuda12x) instead of kvhal-cuda13"
        )
    return f"sm_{cc} is older than sm_{floor}, the oldest GPU kvhal's CUDA kernels target"


def choose_cuda_binary(cc: int, manifest: dict) -> KernelChoice:
    """Best prebuilt binary for compute capability ``cc``: SASS of the same major and minor <= the device's
    (binary compatible), else PTX of an arch <= the device's (the driver JITs it), else compile with NVRTC."""
    cubins = {int(a["arch"][3:]): a["file"] for a in manifest.get("artifacts", []) if a["kind"] == "cubin"}
    ptxs = {int(a["arch"][8:]): a["file"] for a in manifest.get("artifacts", []) if a["kind"] == "ptx"}
    same_major = [a for a in cubins if a // 10 == cc // 10 and a <= cc]
    if same_major:
        a = max(same_major)
        return KernelChoice("cubin", f"sm_{a}", cubins[a], f"prebuilt cubin sm_{a}")
    older = [a for a in ptxs if a <= cc]
    if older:
        a = max(older)
        return KernelChoice("ptx", f"compute_{a}", ptxs[a], f"prebuilt PTX compute_{a}, JIT-compiled by the driver")
    return KernelChoice("compile", f"sm_{cc}", None, f"no prebuilt kernel for sm_{cc}")


def choose_hip_binary(gcn_arch: str, manifest: dict) -> KernelChoice:
    """Code objects are not portable across gfx targets: an exact match or compile (hiprtc)."""
    base = gcn_arch.split(":")[0]
    for a in manifest.get("artifacts", []):
        if a["kind"] == "hsaco" and a["arch"] == base:
            return KernelChoice("hsaco", base, a["file"], f"prebuilt code object {base}")
    return KernelChoice("compile", base, None, f"no prebuilt code object for {base}")


def attention_launches(
    plan: AttentionPlan, n_heads: int, head_dim: int, k_row_bytes: int
) -> list[tuple[str, tuple[int, int, int], int]]:
    """(kernel, grid, dynamic shared memory bytes) for one attention call, in launch order."""
    out = []
    if plan.n_decode:
        g = plan.decode_group
        smem = decode_smem_bytes(head_dim, g, k_row_bytes)
        out.append(("kvhal_attn_decode", (plan.n_decode, n_heads // g, plan.n_splits), smem))
    if plan.n_tiles:
        out.append(("kvhal_attn_prefill", (plan.n_tiles, n_heads, plan.n_splits), plan.prefill.smem_bytes))
    if plan.n_splits > 1:
        out.append(("kvhal_attn_merge", (plan.n_rows * n_heads, 1, 1), 0))
    return out


__all__ = [
    "AttentionPlan",
    "CachePlan",
    "PoolPlan",
    "KernelChoice",
    "PrefillGeometry",
    "arch_refusal",
    "attention_launches",
    "blocks_launch",
    "choose_cuda_binary",
    "choose_hip_binary",
    "choose_splits",
    "split_efficiency",
    "decode_group",
    "decode_smem_bytes",
    "decode_stage_words",
    "grid_1d",
    "merge_splits",
    "pack_block_table",
    "plan_attention",
    "prefill_geometry",
    "quantized",
    "split_range",
    "spec_refusal",
    "store_launch",
]
