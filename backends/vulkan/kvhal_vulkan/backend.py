"""The kvhal Backend on Vulkan: spec limits in ``supports``, per-cache pools and context, each op a few dispatches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvhal.backend import AttentionBatch, AttentionShape, Backend, Op, Pools, Probe
from kvhal.backend_util import Option, blocks_to_pages, check_block_ids, pages_to_blocks, parse_options
from kvhal.errors import BackendUnavailableError, CapacityError
from kvhal.spec import CacheSpec

from . import adapter, shaders
from .buffers import Context, Dispatch, VulkanPool

WG = shaders.WORKGROUP
BATCH_BYTES = 64 << 20  # scratch one batch of raw rows (read/write_blocks, large copies) may take
OPTIONS = (
    *adapter.OPTIONS,
    Option(
        "max_binding_bytes",
        int,
        None,
        check=lambda x: None if x >= 4 else "must be at least 4 (bytes)",
        help="lower the per-binding pool size below the adapter's (tests the pool split)",
    ),
)


def _groups(n: int) -> int:
    return -(-n // WG)


def _ctx(pools: Pools) -> Context:
    ctx: Context = pools.state  # set by allocate
    return ctx


class VulkanBackend(Backend):
    name = "vulkan"
    formats = shaders.FORMATS
    # f32 accumulation in the shaders against float64 in the oracle
    attention_tolerance = 5e-5

    @classmethod
    def probe(cls) -> Probe:
        return adapter.probe()

    def __init__(self, **options: Any) -> None:
        """Options: ``adapter``, ``power_preference``, ``allow_cpu`` (each also from its environment
        variable, see kvhal_vulkan.adapter) and ``max_binding_bytes``."""
        opts = parse_options(self.name, options, OPTIONS)
        found, reason = adapter.choose_from(opts)
        if found is None:
            raise BackendUnavailableError(f"backend 'vulkan' is unavailable: {reason}")
        self.gpu = adapter.gpu(found)
        limits = self.gpu.limits
        limit = min(limits["max-storage-buffer-binding-size"], limits["max-buffer-size"]) // 4 * 4
        self.scratch_limit = limit
        self.pool_binding_limit = min(limit, opts["max_binding_bytes"] or limit) // 4 * 4
        self.workgroup_memory = int(limits["max-compute-workgroup-storage-size"])

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        why = super().supports(spec, op, shape)
        if why is not None:
            return why
        for which, rb in (("K", spec.k_row_bytes), ("V", spec.v_row_bytes)):
            page = spec.n_kv_heads * spec.block_size * 4 * -(-rb // 4)  # rows padded to words in scratch
            if page > self.pool_binding_limit:
                return (
                    f"one {which} page takes {page} bytes, above the {self.pool_binding_limit}-byte storage binding "
                    "limit (the adapter's, or max_binding_bytes); use a smaller block_size"
                )
        if op == "attention":
            need = shaders.attention_workgroup_bytes(spec.head_dim, 1)
            if need > self.workgroup_memory:
                return (
                    f"head_dim {spec.head_dim} needs {need} bytes of workgroup memory, above this "
                    f"adapter's {self.workgroup_memory} (maxComputeWorkgroupStorageSize); use a smaller head_dim"
                )
        return None

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        geometry = {}
        for which, fmt in (("k", spec.k_format), ("v", spec.v_format)):
            shape = spec.pool_shape(n_blocks, which)
            # pages per chunk depends on the limit only, not on n_blocks: caches of any size share pipelines
            ppc = self.pool_binding_limit // spec.page_nbytes(which)
            geometry[which] = (shape, shaders.PoolGeometry(fmt, *shape[1:], ppc, -(-n_blocks // ppc)))
        chunks = geometry["k"][1].chunks + geometry["v"][1].chunks
        have = self.gpu.limits["max-storage-buffers-per-shader-stage"]
        if 3 + chunks > have:
            raise CapacityError(
                f"vulkan: {n_blocks} blocks need {chunks} pool bindings of at most {self.pool_binding_limit} bytes "
                f"plus 3, above this adapter's {have} storage buffers per shader stage; allocate fewer blocks"
            )
        usage = self.gpu.wgpu.BufferUsage
        k: list[VulkanPool] = []
        v: list[VulkanPool] = []
        try:
            for _ in range(spec.n_layers):
                for which, out in (("k", k), ("v", v)):
                    shape, g = geometry[which]
                    page = spec.page_nbytes(which)
                    sizes = [min(g.pages_per_chunk, n_blocks - c * g.pages_per_chunk) * page for c in range(g.chunks)]
                    bufs = [  # WebGPU zero-fills new buffers
                        self.gpu.device.create_buffer(
                            label=f"kvhal-{which}-pool",
                            size=-(-n // 4) * 4,
                            usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST,
                        )
                        for n in sizes
                    ]
                    out.append(VulkanPool(bufs, shape, g))
        except self.gpu.wgpu.GPUError as e:
            raise CapacityError(
                f"vulkan: could not allocate {n_blocks * spec.block_nbytes} bytes of pools on "
                f"{self.gpu.info.get('device')}: {e}; allocate fewer blocks or layers"
            ) from e
        ctx = Context(self.gpu, slots=max(4, 2 * spec.n_layers), scratch_limit=self.scratch_limit)
        return Pools(spec, n_blocks, k, v, sum(p.nbytes for p in k + v), state=ctx)

    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        spec, ctx = pools.spec, _ctx(pools)
        kx = np.ascontiguousarray(k, np.float32).reshape(-1).view(np.uint32)
        vx = np.ascontiguousarray(v, np.float32).reshape(-1).view(np.uint32)
        n = int(k.shape[0])
        x, (koff, voff) = ctx.upload("x", [kx, vx])
        meta, (soff,) = ctx.upload("meta", [np.asarray(slots, np.uint32)])
        units = n * spec.n_kv_heads * -(-spec.head_dim // shaders.QK)
        ctx.submit(
            [
                Dispatch(
                    shaders.store(p.geometry, spec.head_dim), (x, meta, *p.buffers), (n, off, soff), _groups(units)
                )
                for p, off in ((pools.k[layer], koff), (pools.v[layer], voff))
            ]
        )

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec, ctx = pools.spec, _ctx(pools)
        shape = (n, spec.n_kv_heads, spec.head_dim)
        size = n * spec.n_kv_heads * spec.head_dim
        if size == 0:
            return np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        meta, (ioff,) = ctx.upload("meta", [np.asarray(block_ids, np.uint32)])
        out = ctx.buffer("out", 8 * size)
        steps = [
            Dispatch(shaders.load(p.geometry, spec.head_dim), (meta, out, *p.buffers), (n, ioff, ooff), _groups(size))
            for p, ooff in ((pools.k[layer], 0), (pools.v[layer], size))
        ]
        kv = ctx.read(steps, out, 8 * size).view(np.float32)
        return kv[:size].reshape(shape), kv[size:].reshape(shape)

    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> np.ndarray:
        spec, ctx = pools.spec, _ctx(pools)
        kp, vp = pools.k[layer], pools.v[layer]
        qx = np.ascontiguousarray(q, np.float32)
        rows, hq, d = qx.shape
        seq, _, lo, hi = batch.visible
        info = np.stack([seq, lo, hi, np.zeros_like(seq)], axis=1).astype(np.uint32)
        group = hq // spec.n_kv_heads
        ht = shaders.heads_per_tile(group, d, self.workgroup_memory)  # >= 1: supports() checked one head fits
        tiles = rows * spec.n_kv_heads * (group // ht)
        # split long contexts into partitions of >= 256 keys until there are enough workgroups
        parts = max(1, min(-(-512 // tiles), -(-int((hi - lo).max()) // 256)))
        table = np.asarray(batch.block_table, np.int64).astype(np.uint32)  # -1 padding is never read
        qbuf, _ = ctx.upload("q", [qx.reshape(-1)])
        meta, (_, toff) = ctx.upload("meta", [info.reshape(-1), table.reshape(-1)])
        # tiles * parts < tiles + 512: sized so a growing context never regrows it
        part = ctx.buffer("part", (tiles + 512) * ht * (d + 2) * 4)
        out = ctx.buffer("out", rows * hq * d * 4)
        scale_bits = int(np.float32(batch.scale).view(np.uint32))
        steps = [
            Dispatch(
                shaders.attention(kp.geometry, vp.geometry, d, ht),
                (qbuf, meta, part, *kp.buffers, *vp.buffers),
                (rows, hq, group, parts, table.shape[1], toff, scale_bits),
                tiles * parts,
            ),
            Dispatch(shaders.combine(d), (part, out), (rows * hq, parts), rows * hq),
        ]
        return ctx.read(steps, out, rows * hq * d * 4).view(np.float32).reshape(rows, hq, d)

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        n = len(src)
        if n == 0:
            return
        ctx, h = _ctx(pools), pools.spec.n_kv_heads
        pair = [pools.k[layer], pools.v[layer]]
        if 4 * n * h * sum(p.row_words for p in pair) > ctx.scratch_limit:  # through the host, in batches
            self._scatter_rows(pools, pair, dst, self._gather_rows(pools, pair, src))
            return
        meta, (soff, doff) = ctx.upload("meta", [np.asarray(src, np.uint32), np.asarray(dst, np.uint32)])
        tmp = ctx.buffer("tmp", 4 * n * h * sum(p.row_words for p in pair))
        gathers, scatters, toff = [], [], 0
        for p in pair:
            buffers = (meta, tmp, *p.buffers)
            gathers.append(Dispatch(shaders.gather(p.geometry), buffers, (n, soff, toff), _groups(n * h * p.row_words)))
            scatters.append(Dispatch(shaders.scatter(p.geometry), buffers, (n, doff, toff), _groups(n * h)))
            toff += n * h * p.row_words
        ctx.submit(gathers + scatters)  # all gathers before any scatter: overlapping ranges are safe

    # -- raw blocks ------------------------------------------------------------------------------------

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        spec = pools.spec
        ids = check_block_ids(pools.n_blocks, block_ids)
        if len(ids) == 0:
            return np.zeros((0, spec.block_nbytes), np.uint8)
        every = [p for layer in range(spec.n_layers) for p in (pools.k[layer], pools.v[layer])]
        rows = self._gather_rows(pools, every, self._block_slots(spec, ids))
        pages = []
        for r, p in zip(rows, every, strict=True):  # [n * bs, H, words] -> [n, H, bs, row_bytes]
            b = r.view(np.uint8).reshape(len(ids), spec.block_size, spec.n_kv_heads, -1)[..., : p.shape[3]]
            pages.append(b.transpose(0, 2, 1, 3))
        return pages_to_blocks(spec, zip(pages[::2], pages[1::2], strict=True))

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        spec = pools.spec
        pages = blocks_to_pages(spec, data)
        ids = check_block_ids(pools.n_blocks, block_ids, data.shape[0])
        if len(ids) == 0:
            return
        every, rows = [], []
        for layer, kv in enumerate(pages):
            for p, page in zip((pools.k[layer], pools.v[layer]), kv, strict=True):
                r = np.zeros((len(ids), spec.block_size, spec.n_kv_heads, 4 * p.row_words), np.uint8)
                r[..., : p.shape[3]] = page.transpose(0, 2, 1, 3)
                every.append(p)
                rows.append(r.view(np.uint32).reshape(-1, spec.n_kv_heads, p.row_words))
        self._scatter_rows(pools, every, self._block_slots(spec, ids), rows)

    @staticmethod
    def _block_slots(spec: CacheSpec, ids: np.ndarray) -> np.ndarray:
        return (ids[:, None] * spec.block_size + np.arange(spec.block_size)).reshape(-1)

    def _batches(self, pools: Pools, every: Sequence[VulkanPool], n: int) -> Iterator[tuple[int, int, list[int]]]:
        """Moving ``n`` rows of each pool in ``every`` as submissions that fit one scratch buffer and the
        uniform slots: (first row, end row, indices into ``every``)."""
        ctx, h = _ctx(pools), pools.spec.n_kv_heads
        budget = min(BATCH_BYTES, ctx.scratch_limit) // 4
        words = [h * p.row_words for p in every]
        step = max(1, min(n, budget // sum(words)))
        for r0 in range(0, n, step):
            m = min(step, n - r0)
            batch: list[int] = []
            used = 0
            for i, w in enumerate(words):
                if batch and (used + m * w > budget or len(batch) == ctx.slots):
                    yield r0, r0 + m, batch
                    batch, used = [], 0
                batch.append(i)
                used += m * w
            yield r0, r0 + m, batch

    def _gather_rows(self, pools: Pools, every: Sequence[VulkanPool], slots: np.ndarray) -> list[np.ndarray]:
        """The rows at ``slots`` of each pool, word-aligned on the host: ``[len(slots), H, row_words]`` u32."""
        ctx, h = _ctx(pools), pools.spec.n_kv_heads
        out = [np.empty((len(slots), h, p.row_words), np.uint32) for p in every]
        for r0, r1, batch in self._batches(pools, every, len(slots)):
            m = r1 - r0
            meta, (soff,) = ctx.upload("meta", [np.asarray(slots[r0:r1], np.uint32)])
            sizes = [m * h * every[i].row_words for i in batch]
            tmp = ctx.buffer("tmp", 4 * sum(sizes))
            offsets = np.cumsum([0, *sizes])
            steps = [
                Dispatch(
                    shaders.gather(every[i].geometry), (meta, tmp, *every[i].buffers), (m, soff, int(o)), _groups(w)
                )
                for i, o, w in zip(batch, offsets, sizes)
            ]
            got = ctx.read(steps, tmp, 4 * sum(sizes)).view(np.uint32)
            for i, o, w in zip(batch, offsets, sizes):
                out[i][r0:r1] = got[o : o + w].reshape(m, h, -1)
        return out

    def _scatter_rows(
        self, pools: Pools, every: Sequence[VulkanPool], slots: np.ndarray, rows: Sequence[np.ndarray]
    ) -> None:
        """The inverse of ``_gather_rows``: write host rows into ``slots`` of each pool."""
        ctx, h = _ctx(pools), pools.spec.n_kv_heads
        for r0, r1, batch in self._batches(pools, every, len(slots)):
            m = r1 - r0
            meta, (doff,) = ctx.upload("meta", [np.asarray(slots[r0:r1], np.uint32)])
            tmp, offsets = ctx.upload("tmp", [np.ascontiguousarray(rows[i][r0:r1]).reshape(-1) for i in batch])
            ctx.submit(
                [
                    Dispatch(
                        shaders.scatter(every[i].geometry), (meta, tmp, *every[i].buffers), (m, doff, o), _groups(m * h)
                    )
                    for i, o in zip(batch, offsets)
                ]
            )

    # -- host side -------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        self.gpu.wait()

    def to_numpy(self, x: Any) -> np.ndarray:
        """A pool's bytes in kvhal's pool layout, or any array as numpy."""
        if not isinstance(x, VulkanPool):
            return super().to_numpy(x)
        ppc, n_blocks = x.geometry.pages_per_chunk, x.shape[0]
        chunks = [
            np.frombuffer(self.gpu.queue.read_buffer(buf), np.uint8)[: min(ppc, n_blocks - c * ppc) * x.page_bytes]
            for c, buf in enumerate(x.buffers)
        ]
        return np.concatenate(chunks).reshape(x.shape)
