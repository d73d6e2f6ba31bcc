"""Independent oracles for tests: float64 attention computed directly from K/V arrays."""

from __future__ import annotations

import numpy as np


def attention_f64(
    q: np.ndarray,
    ks: list[np.ndarray],
    vs: list[np.ndarray],
    q_lens: list[int],
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
) -> np.ndarray:
    """softmax(q kᵀ · scale + mask) v per sequence, float64, with GQA by head grouping.

    ``ks[i]``/``vs[i]``: ``[n_kv_i, n_kv_heads, d]``; ``q``: ``[sum(q_lens), n_heads, d]``.
    """
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = []
    start = 0
    for k, v, n_q in zip(ks, vs, q_lens):
        qs = q[start : start + n_q].astype(np.float64)
        start += n_q
        group = q.shape[1] // k.shape[1]
        n_kv = k.shape[0]
        rows = []
        for i in range(n_q):
            pos = n_kv - n_q + i
            heads = []
            for h in range(q.shape[1]):
                kh = k[:, h // group].astype(np.float64)
                vh = v[:, h // group].astype(np.float64)
                j = np.arange(n_kv)
                ok = np.ones(n_kv, bool)
                if causal:
                    ok &= j <= pos
                if window is not None:
                    ok &= j > pos - window
                s = (kh[ok] @ qs[i, h]) * scale
                w = np.exp(s - s.max())
                heads.append((w / w.sum()) @ vh[ok])
            rows.append(heads)
        out.append(np.asarray(rows))
    return np.concatenate(out, axis=0)


def adakv_transcription(wm: np.ndarray, n: int, keep: int, window: int, kernel: int, ceil: float, safe: float) -> list:
    """AdaKV over SnapKV (kvpress's AdaKVPress, plus the ceiling), as a greedy loop over float64 window mass
    ``wm [KV heads, n]``: the last ``window`` positions score as every head's best, the rest their mass average-pooled
    over ``kernel`` (zero padding counted, as torch's ``avg_pool1d``); each head first takes its int(safe * keep)
    best; then the best remaining (score, head, position) whose head holds fewer than int(ceil * keep) is taken,
    until the layer holds heads * keep positions."""
    heads, win = wm.shape[0], min(window, keep, n)
    pad = kernel // 2
    pooled = np.array([np.convolve(np.pad(m[: n - win], pad), np.ones(kernel) / kernel, "valid") for m in wm])
    cap, n_safe = min(n, int(ceil * keep)), int(safe * keep)
    taken = [set(range(n - win, n)) for _ in range(heads)]
    for h in range(heads):
        taken[h] |= set(sorted(range(n - win), key=lambda j: (-pooled[h, j], j))[: max(0, n_safe - win)])
    rest = sorted((-pooled[h, j], h, j) for h in range(heads) for j in range(n - win) if j not in taken[h])
    for _, h, j in rest:
        if sum(map(len, taken)) == heads * keep:
            break
        if len(taken[h]) < cap:
            taken[h].add(j)
    return [sorted(t) for t in taken]
