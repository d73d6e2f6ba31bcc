"""The attention descriptor every backend's ``attention``/``attention_lse``/``attention_mass`` takes
(``AttentionBatch``), the static parts ``supports`` sees (``AttentionShape``), and the visible KV range of each
query, computed once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .errors import ShapeError
from .validate import END


def visible_range(
    seq_lens: np.ndarray, q_lens: np.ndarray, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per query row (``sum(q_lens)`` of them): its sequence index, its position, and the KV interval
    ``[lo, hi)`` it sees. Query ``i`` of a sequence of ``n`` tokens sits at ``n - q_len + i``; it sees
    ``j <= pos`` when causal and ``j > pos - window`` when a window is given. int64 arrays."""
    seq_lens = np.asarray(seq_lens, np.int64)
    q_lens = np.asarray(q_lens, np.int64)
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.cumsum(q_lens) - q_lens
    pos = seq_lens[seq] - q_lens[seq] + (np.arange(int(q_lens.sum())) - starts[seq])
    hi = pos + 1 if causal else seq_lens[seq].copy()
    lo = np.maximum(0, pos - window + 1) if window is not None else np.zeros_like(pos)
    return seq, pos, lo, hi


@dataclass(frozen=True, eq=False)
class AttentionBatch:
    """One attention call's geometry, what every backend's ``attention``/``attention_lse``/``attention_mass``
    takes: host int32 ``block_table [n_seqs, max_blocks]`` (padded with -1), ``seq_lens [n_seqs]`` (KV tokens
    per sequence), ``q_lens [n_seqs]``, the call's ``scale``, ``causal`` and ``window``, and the per-head ``holes``
    a per-head eviction left. A new attention
    parameter (soft-capping, sink tokens) is a new field here, not a new argument in every backend.

    Query ``i`` of a sequence of ``n`` tokens sits at ``n - q_len + i`` and sees KV position ``j`` iff
    ``j <= pos`` (causal) and ``j > pos - window`` (window); ``visible`` computes that once per call."""

    block_table: np.ndarray
    seq_lens: np.ndarray
    q_lens: np.ndarray
    scale: float
    causal: bool = True
    window: int | None = None
    # per-head eviction (``AdaKV``): int32 ``[n_seqs, n_kv_heads, 2]``, KV head ``h`` of sequence ``s`` does not
    # attend keys ``[holes[s, h, 0], holes[s, h, 1])`` (rows it dropped; empty when lo >= hi). None: no holes.
    # Only a backend whose ``masks_heads`` is True gets a batch with holes.
    holes: np.ndarray | None = None

    @property
    def n_seqs(self) -> int:
        return len(self.q_lens)

    @cached_property
    def visible(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per query row: its sequence index, position and visible KV interval ``[lo, hi)`` (int64), once."""
        return visible_range(self.seq_lens, self.q_lens, self.causal, self.window)

    def hidden(self, s: int, n_kv: int) -> np.ndarray | None:
        """Bool ``[n_kv_heads, n_kv]``: the keys of sequence ``s`` each KV head does not attend (None: none)."""
        if self.holes is None:
            return None
        j = np.arange(n_kv)[None, :]
        return (j >= self.holes[s, :, :1]) & (j < self.holes[s, :, 1:])

    def with_(self, **changes: Any) -> AttentionBatch:
        """A copy with some fields replaced (the visible range is computed afresh)."""
        return dataclasses.replace(self, **changes)

    def shape(self, n_heads: int) -> AttentionShape:
        """The static parts of this call with ``n_heads`` query heads: what ``Backend.supports`` sees."""
        return AttentionShape(n_heads, self.causal, self.window, int(self.q_lens.max()) if self.n_seqs else 0)


@dataclass(frozen=True)
class AttentionShape:
    """The static parts of an attention call: query heads (the GQA ratio is ``n_heads // spec.n_kv_heads``),
    causal, the window, and the longest ``q_len`` (1: decode). ``supports(spec, "attention", shape)`` refuses
    from these what a backend cannot run; hashable, so an answer can be kept per shape."""

    n_heads: int
    causal: bool = True
    window: int | None = None
    max_q_len: int = 1

    def __post_init__(self) -> None:
        def count(x: Any, least: int) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and bool(x >= least)

        if not (count(self.n_heads, 1) and count(self.max_q_len, 0) and isinstance(self.causal, (bool, np.bool_))):
            raise ShapeError(f"{self}: n_heads must be an int >= 1, max_q_len an int >= 0 and causal a bool")
        if self.window is not None and not (count(self.window, 1) and self.window <= END):
            raise ShapeError(f"{self}: window must be a positive int up to 2**62 or None")
