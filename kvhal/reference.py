"""The reference backend: numpy, float64 accumulation, straight from the format spec. Slow and exact."""

from __future__ import annotations

import numpy as np

from . import formats
from .backend import Backend, LayerPools, Probe
from .formats import Format
from .spec import CacheSpec


class ReferenceBackend(Backend):
    name = "reference"
    formats = frozenset(formats.names())
    attention_tolerance = 1e-6

    @classmethod
    def probe(cls) -> Probe:
        return Probe(score=0, reason="numpy reference, always available (slow, float64)", device="host")

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        pools = []
        for _ in range(spec.n_layers):
            k = np.zeros(spec.pool_shape(n_blocks, "k"), np.uint8)
            v = np.zeros(spec.pool_shape(n_blocks, "v"), np.uint8)
            pools.append(LayerPools(k, v, k.nbytes + v.nbytes))
        return pools

    def store(self, pools: LayerPools, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        bs = self.spec.block_size
        blk, off = slots // bs, slots % bs
        pools.k[blk, :, off, :] = self.spec.k_fmt.quantize(k)
        pools.v[blk, :, off, :] = self.spec.v_fmt.quantize(v)

    def _gather(self, pool: np.ndarray, fmt: Format, block_ids: np.ndarray, n: int) -> np.ndarray:
        pages = pool[block_ids]  # [nb, H, bs, rb]
        rows = pages.transpose(0, 2, 1, 3).reshape(-1, pool.shape[1], pool.shape[3])[:n]
        return fmt.dequantize(rows)  # [n, H, D]

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            self._gather(pools.k, self.spec.k_fmt, block_ids, n),
            self._gather(pools.v, self.spec.v_fmt, block_ids, n),
        )

    def attention(
        self,
        q: np.ndarray,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> np.ndarray:
        n_heads = q.shape[1]
        group = n_heads // self.spec.n_kv_heads
        out = np.empty(q.shape, np.float32)
        q_start = 0
        for s, (n_kv, n_q) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
            blocks = block_table[s, : -(-n_kv // self.spec.block_size)]
            k, v = self.load(pools, blocks, n_kv)
            k = np.repeat(k.astype(np.float64), group, axis=1)  # [n_kv, Hq, D]
            v = np.repeat(v.astype(np.float64), group, axis=1)
            qs = q[q_start : q_start + n_q].astype(np.float64)  # [n_q, Hq, D]
            scores = np.einsum("qhd,khd->hqk", qs, k) * scale
            pos = np.arange(n_kv - n_q, n_kv)[:, None]
            kv_pos = np.arange(n_kv)[None, :]
            visible = np.ones((n_q, n_kv), bool)
            if causal:
                visible &= kv_pos <= pos
            if window is not None:
                visible &= kv_pos > pos - window
            scores = np.where(visible[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            out[q_start : q_start + n_q] = np.einsum("hqk,khd->qhd", p, v)
            q_start += n_q
        return out

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        bs = self.spec.block_size
        for pool in (pools.k, pools.v):
            pool[dst // bs, :, dst % bs, :] = pool[src // bs, :, src % bs, :]
