"""The reference backend: numpy, float64 accumulation, straight from the format spec. Slow and exact."""

from __future__ import annotations

import numpy as np

from . import formats
from .backend import AttentionBatch, HostPoolsBackend, Pools, Probe
from .backend_util import softmax, whole_pages
from .errors import UnsupportedError
from .formats import Format, kltq


def side(pools: Pools, layer: int, which: str = "k") -> kltq.Side:
    """Layer ``layer``'s kltq side data of K (``which="k"``: ``Pools.side``) or V (``Pools.v_side``) from the
    pools (the cache puts it there before a store writes rows)."""
    per_layer = pools.side if which == "k" else pools.v_side
    if len(per_layer) <= layer or per_layer[layer] is None:
        fmt, field = (pools.spec.k_format, "side") if which == "k" else (pools.spec.v_format, "v_side")
        raise UnsupportedError(
            f"{fmt} pools without side data at layer {layer}: a kltq cache sets it (Pools.{field}) on the layer's "
            "first store; run the format through a KVCache"
        )
    s: kltq.Side = per_layer[layer]
    return s


class ReferenceBackend(HostPoolsBackend):
    name = "reference"
    formats = frozenset(formats.names())
    attention_tolerance = 1e-6
    masks_heads = True

    @classmethod
    def probe(cls) -> Probe:
        return Probe(score=0, reason="numpy reference, always available (slow, float64)", device="host")

    def store(self, pools: Pools, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        spec = pools.spec
        blk, off = slots // spec.block_size, slots % spec.block_size
        # everything quantized before either pool is written
        qv = kltq.quantize(side(pools, layer, "v"), 0, v) if spec.v_codec else spec.v_fmt.quantize(v)
        if spec.k_codec:
            pools.k[layer][blk, :, off, :] = kltq.quantize(side(pools, layer), 0, k)
        elif spec.k_fmt.k_page is not None:
            pages = whole_pages(slots, spec.block_size)
            x = k.reshape(len(pages), spec.block_size, spec.n_kv_heads, spec.head_dim).transpose(0, 2, 1, 3)
            spec.k_fmt.check_values(x)
            qk = spec.k_fmt.k_page.quantize_page(np.ascontiguousarray(x, np.float32).reshape(-1, *x.shape[2:]))
            pools.k[layer][pages] = qk.reshape(len(pages), spec.n_kv_heads, spec.block_size, spec.k_row_bytes)
        else:
            pools.k[layer][blk, :, off, :] = spec.k_fmt.quantize(k)
        pools.v[layer][blk, :, off, :] = qv

    @staticmethod
    def _gather(pool: np.ndarray, fmt: Format, block_ids: np.ndarray, n: int, paged: bool = False) -> np.ndarray:
        pages = pool[block_ids]  # [nb, H, bs, rb]
        nb, h, bs, rb = pages.shape
        if paged:  # per-channel K: dequantize whole pages, then cut the rows
            assert fmt.k_page is not None
            x = fmt.k_page.dequantize_page(pages.reshape(nb * h, bs * rb), bs).reshape(nb, h, bs, -1)
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(nb * bs, h, -1)[:n]
        rows = pages.transpose(0, 2, 1, 3).reshape(-1, h, rb)[:n]
        return fmt.dequantize(rows)  # [n, H, D]

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec = pools.spec
        if spec.k_codec:
            k = kltq.dequantize(side(pools, layer), 0, self._rows(pools.k[layer], block_ids, n))
        else:
            k = self._gather(pools.k[layer], spec.k_fmt, block_ids, n, spec.k_paged)
        if spec.v_codec:
            return k, kltq.dequantize(side(pools, layer, "v"), 0, self._rows(pools.v[layer], block_ids, n))
        return k, self._gather(pools.v[layer], spec.v_fmt, block_ids, n)

    @staticmethod
    def _rows(pool: np.ndarray, block_ids: np.ndarray, n: int) -> np.ndarray:
        pages = pool[block_ids]  # [nb, H, bs, rb]
        return pages.transpose(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])[:n]

    def _keys(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V as attention weighs them: a kltq format's decoded coefficients (K: q comes in their space; V:
        the cache maps the output back to values), else the values."""
        spec = pools.spec
        if not (spec.k_codec or spec.v_codec):
            return self.load(pools, layer, block_ids, n)
        k, v = (
            kltq.decode_coefficients(side(pools, layer, w), 0, self._rows(pool[layer], block_ids, n))
            if fmt.side_data
            else self._gather(pool[layer], fmt, block_ids, n, w == "k" and spec.k_paged)
            for w, pool, fmt in (("k", pools.k, spec.k_fmt), ("v", pools.v, spec.v_fmt))
        )
        return k, v

    def attention(self, q: np.ndarray, pools: Pools, layer: int, batch: AttentionBatch) -> np.ndarray:
        spec = pools.spec
        group = q.shape[1] // spec.n_kv_heads
        out = np.empty(q.shape, np.float32)
        _, _, lo, hi = batch.visible
        q_start = 0
        for s, (n_kv, n_q) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens.tolist())):
            blocks = batch.block_table[s, : -(-n_kv // spec.block_size)]
            k, v = self._keys(pools, layer, blocks, n_kv)
            k = np.repeat(k.astype(np.float64), group, axis=1)  # [n_kv, Hq, D]
            v = np.repeat(v.astype(np.float64), group, axis=1)
            rows = slice(q_start, q_start + n_q)
            scores = np.einsum("qhd,khd->hqk", q[rows].astype(np.float64), k) * batch.scale
            j = np.arange(n_kv)[None, :]
            visible = ((j >= lo[rows, None]) & (j < hi[rows, None]))[None]
            if (hidden := batch.hidden(s, n_kv)) is not None:  # per-head holes (AdaKV)
                visible = visible & ~np.repeat(hidden, group, axis=0)[:, None, :]
            scores = np.where(visible, scores, -np.inf)
            p, _ = softmax(scores)
            out[rows] = np.einsum("hqk,khd->qhd", p, v)
            q_start += n_q
        return out
