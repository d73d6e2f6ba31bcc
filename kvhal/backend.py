"""The backend interface (DESIGN.md §4). A backend sees pools, slots and block tables, never sequences.

Conventions every backend follows, so pools are byte-identical everywhere:

* pool layout: ``CacheSpec.pool_shape`` — ``[n_blocks, n_kv_heads, block_size, row_bytes]`` uint8,
  each row one token of one head in the format's ggml byte layout;
* a slot is ``block_id * block_size + offset``;
* ``attention`` gets host int32 arrays: ``block_table [n_seqs, max_blocks]`` (padded with -1),
  ``seq_lens [n_seqs]`` (KV tokens per sequence) and ``q_lens [n_seqs]``; query ``i`` of a sequence
  sits at position ``seq_len - q_len + i``, sees KV position ``j`` iff ``j <= pos`` (when causal) and
  ``j > pos - window`` (when a window is given); query head ``h`` reads KV head
  ``h // (n_heads // n_kv_heads)``.

``copy_slots`` is a kvhal addition to the seven methods of DESIGN.md §4: copy-on-write and sequence
compaction must copy quantized rows byte for byte (re-quantizing would drift), and only the
backend can touch its device memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from .formats import Format
from .spec import CacheSpec

Op = Literal["store", "load", "attention"]
OPS: tuple[Op, ...] = ("store", "load", "attention")


@dataclass(frozen=True)
class Probe:
    """What a backend says of this machine: higher score wins ``backend="auto"``."""

    score: int
    reason: str
    device: str = ""


@dataclass
class LayerPools:
    """One layer's K and V pools in the backend's native array type."""

    k: Any
    v: Any
    nbytes: int  # bytes really allocated for k + v


class Backend(ABC):
    name: ClassVar[str]
    formats: ClassVar[frozenset[str]]  # formats it runs for every op (override supports() if ops differ)
    # max |attention - float64 oracle on the dequantized K/V|, for unit-scale inputs; the contract
    # suite holds each backend to its own declared figure
    attention_tolerance: float = 1e-4  # an instance may set its own (e.g. per device precision)

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe | None:
        """Cheap check of this machine; imports nothing heavy. None means "not here"."""

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why probe() returned None; backends override with specifics."""
        return "its probe found no usable device"

    @classmethod
    def supports(cls, fmt: str, op: Op) -> bool:
        return fmt in cls.formats and op in OPS

    @abstractmethod
    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        """Zero-filled K and V pools for every layer."""

    @abstractmethod
    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        """Quantize ``k``/``v`` ``[n, n_kv_heads, head_dim]`` and write token i into ``slots[i]``."""

    @abstractmethod
    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        """The first ``n`` tokens of the pages ``block_ids``, dequantized: ``[n, n_kv_heads, head_dim]`` f32."""

    @abstractmethod
    def attention(
        self,
        q: Any,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> Any:
        """Attention of ``q [sum(q_lens), n_heads, head_dim]`` over the quantized pages; f32, q's shape."""

    @abstractmethod
    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the stored bytes of ``src`` slots into ``dst`` slots (gather all, then scatter)."""

    def synchronize(self) -> None:
        """Wait for queued device work; host backends have none."""

    # -- array interop; device backends override ------------------------------------------------------

    def __init__(self, **options: Any) -> None:
        """Backends with options (device, provider list, ...) take them here; others take none."""
        if options:
            raise TypeError(f"backend {self.name!r} takes no options, got {sorted(options)}")

    def asarray(self, x: Any, what: str) -> Any:
        """Take a DLPack-capable array (or array-like) as this backend's native f32/f16 array."""
        from .interop import host_float_array

        return host_float_array(x, what)

    def to_numpy(self, x: Any) -> np.ndarray:
        from .interop import to_numpy

        return to_numpy(x)

    def check_values(self, fmt: Format, x: Any) -> None:
        """Raise NonFiniteError when ``x`` holds what ``fmt`` cannot store (before anything is written)."""
        fmt.check_values(self.to_numpy(x))
