"""The backend interface, version 2. A backend sees pools, slots and block tables, never sequences.

One backend instance serves any number of caches at once: everything of one cache lives in the
``Pools`` object that ``allocate`` returns (its spec, its block count, each layer's device arrays and
whatever per-cache state the backend needs), never on the instance.

Conventions every backend follows, so pools are byte-identical everywhere:

* pool layout: ``CacheSpec.pool_shape`` — ``[n_blocks, n_kv_heads, block_size, row_bytes]`` uint8,
  each row one token of one head in the format's byte layout;
* a slot is ``block_id * block_size + offset``;
* ``attention`` gets an ``AttentionBatch`` of host int32 arrays: ``block_table [n_seqs, max_blocks]``
  (padded with -1), ``seq_lens [n_seqs]`` (KV tokens per sequence) and ``q_lens [n_seqs]``; query ``i`` of a sequence
  sits at position ``seq_len - q_len + i`` and sees KV position ``j`` iff ``j <= pos`` (when causal) and
  ``j > pos - window`` (when a window is given); query head ``h`` reads KV head
  ``h // (n_heads // n_kv_heads)`` (``AttentionBatch.visible`` computes this once);
* raw block I/O (``read_blocks``/``write_blocks``) moves whole blocks of all layers as
  ``CacheSpec.block_nbytes`` bytes each: for every layer in order, the K page
  ``[n_kv_heads, block_size, k_row_bytes]`` then the V page. Every backend produces the same bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from .attention import AttentionBatch, AttentionShape
from .errors import SpecError, UnsupportedError
from .formats import Format
from .interop import LoadOut, cast_into
from .spec import CacheSpec

__all__ = ["FUSED", "OPS", "AttentionBatch", "AttentionShape", "Backend", "HostPoolsBackend", "Pools", "Probe"]

Op = Literal["store", "load", "attention"]
OPS: tuple[Op, ...] = ("store", "load", "attention")
# what a backend may run natively beyond attention (``Backend.fused``); anything else is the host's float64 path
FusedOp = Literal["attention_lse", "attention_mass", "transform"]
FUSED: tuple[FusedOp, ...] = ("attention_lse", "attention_mass", "transform")


@dataclass(frozen=True)
class Probe:
    """What a backend says of this machine. ``score`` None: unusable here, and ``reason`` says why;
    otherwise the highest score wins ``backend="auto"`` and ``reason`` describes the device."""

    score: int | None
    reason: str
    device: str = ""
    # unusable because of this process's own settings (an environment variable the backend reads), not the
    # machine: backend="auto" raises rather than passing it over for a slower one without a word
    misconfigured: bool = False

    @property
    def available(self) -> bool:
        return self.score is not None


@dataclass
class Pools:
    """One cache's storage on a backend: the spec, the block count, and per-layer K and V pools in the
    backend's native array type. ``state`` is the backend's own per-cache data (compiled kernels,
    buffers sized for this spec); nothing of a cache is kept on the backend instance."""

    spec: CacheSpec
    n_blocks: int
    k: list[Any]
    v: list[Any]
    nbytes: int  # bytes really allocated for every k and v pool
    state: Any = field(default=None, repr=False)
    # a kltq K format's side data per layer (one-layer ``kltq.Side``, None before the layer's first store): the
    # cache's list, set by the cache; what a backend's store/load/attention of such a format reads
    side: list[Any] = field(default_factory=list, repr=False)
    # the same for a kltq V format (``Pools.v_side[layer]``); attention over such V weights its decoded
    # coefficients (the cache maps the output back to values), load returns values
    v_side: list[Any] = field(default_factory=list, repr=False)


class Backend(ABC):
    name: ClassVar[str]
    formats: ClassVar[frozenset[str]]  # formats it runs for every op
    # max |attention - float64 oracle on the dequantized K/V|, for unit-scale inputs; the contract
    # suite holds each backend to its own declared figure
    attention_tolerance: float = 1e-4  # an instance may set its own (e.g. per device precision)
    # the same for calls where a sequence has more than one query, where a backend routes them elsewhere (cuda's
    # bf16 SDPA prefill); None: ``attention_tolerance``. Kept apart so a looser prefill figure never covers decode
    prefill_tolerance: float | None = None
    # what it runs natively of FUSED (each one an override here); the rest runs on the host in float64
    fused: ClassVar[frozenset[FusedOp]] = frozenset()
    # True where supports() refuses some AttentionShapes: the cache then asks it on every attention call
    shape_limits: ClassVar[bool] = False
    # True where attention honours ``AttentionBatch.holes`` (per-head eviction); the cache refuses a per-head
    # eviction on a backend without it (it would attend over the dropped rows)
    masks_heads: ClassVar[bool] = False

    def tolerance(self, max_q_len: int) -> float:
        """The declared attention error bound for a call whose longest query run is ``max_q_len``."""
        if max_q_len > 1 and self.prefill_tolerance is not None:
            return self.prefill_tolerance
        return self.attention_tolerance

    def masks_heads_of(self, spec: CacheSpec) -> bool:
        """Whether attention over ``spec``'s pools honours per-head holes (a backend may mask them for some formats
        only)."""
        return self.masks_heads

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Cheap check of this machine; imports nothing heavy. Says why in ``reason`` either way."""

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        """None when this backend runs ``op`` for ``spec`` (and, for attention, calls of ``shape``), else the
        reason it refuses.

        The base checks the formats; backends extend it with their device limits (head_dim, block
        size, workgroup memory, ...), so ``backend="auto"`` and ``kvhal info --spec`` see every refusal
        before anything is allocated. A backend that also refuses some shapes (a window, a GQA ratio,
        prefill) sets ``shape_limits``; without a shape, supports answers for the spec alone."""
        if not isinstance(spec, CacheSpec):  # a raw AttributeError on spec.k_format otherwise
            raise SpecError(f"spec must be a kvhal.CacheSpec, got {type(spec).__name__}")
        if op not in OPS:
            return f"unknown op {op!r} (one of {', '.join(OPS)})"
        if shape is not None and not isinstance(shape, AttentionShape):
            raise SpecError(f"shape must be a kvhal.AttentionShape or None, got {type(shape).__name__}")
        for which, fmt in (("K", spec.k_format), ("V", spec.v_format)):
            if fmt not in self.formats:
                return f"does not run format {fmt} ({which}); it runs {', '.join(sorted(self.formats))}"
        return None

    @abstractmethod
    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        """Zero-filled K and V pools for every layer of one cache."""

    @abstractmethod
    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        """Quantize ``k``/``v`` ``[n, n_kv_heads, head_dim]`` and write token i into ``slots[i]``."""

    @abstractmethod
    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[Any, Any]:
        """The first ``n`` tokens of the pages ``block_ids``, dequantized: ``[n, n_kv_heads, head_dim]`` f32."""

    def load_into(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int, skip: int, out: LoadOut) -> None:
        """Rows ``[skip, n)`` of ``load`` written into the host buffers of ``out`` (checked by the cache) in
        ``out.dtype``, rounded to nearest even. The default loads f32 and copies; a backend whose kernels write
        the buffers directly overrides it."""
        for x, dst in zip(self.load(pools, layer, block_ids, n), (out.k, out.v)):
            cast_into(dst, out.dtype, self.to_numpy(x)[skip:])

    @abstractmethod
    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> Any:
        """Attention of ``q [sum(batch.q_lens), n_heads, head_dim]`` over the quantized pages; f32, q's shape."""

    @abstractmethod
    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the stored bytes of ``src`` slots into ``dst`` slots at ``layer`` (gather all, then scatter)."""

    @abstractmethod
    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        """The raw bytes of whole blocks, all layers: host uint8 ``[len(block_ids), spec.block_nbytes]``."""

    @abstractmethod
    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        """Write ``data`` (as ``read_blocks`` returns it) into the blocks ``block_ids``, all layers."""

    def attention_mass(
        self, q: Any, pools: Pools, layer: int, batch: AttentionBatch, tail: int, lse: Any = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per sequence, the attention weight each key received from all queries and from the last
        ``tail`` ones, summed over each KV head's query heads: float64 ``[n_kv_heads, seq_len]`` each.
        ``lse``: the rows' log-sum-exp ``attention_lse`` returned for this very call, when the caller has it (a
        backend that fuses both then needs no second attention pass). The default works on every backend
        (float64 over ``load``, ``lse`` unused); a backend that fuses it lists "attention_mass" in ``fused``."""
        from .backend_util import attention_mass

        return attention_mass(self, q, pools, layer, batch, tail)

    def attention_lse(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
        """``attention`` plus each row's log-sum-exp of its scores (host f32 ``[n_q, H, D]``, f64 ``[n_q, H]``):
        what block streaming merges. The default works on every backend (float64 over ``load``); a backend
        that returns it from its kernel lists "attention_lse" in ``fused``."""
        from .backend_util import attention_lse

        return attention_lse(self, q, pools, layer, batch)

    def transform_heads(self, x: Any, scale: np.ndarray, rotation: str | None, inverse: bool) -> Any:
        """``scale * R x`` per KV head of ``x [n, n_heads, D]`` (``inverse``: ``scale * R^T x``; query heads grouped
        over ``len(scale)`` KV heads), f32 in this backend's array type: the codec's step for queries and outputs
        (queries meet K's rotation, ``inverse`` outputs V's: a rotation whose blocks differ for K and V, such as
        "hadamard-llama", takes its K or V form from ``inverse``). Here on the host in float64; a backend that runs it on its device lists "transform" in ``fused``."""
        from . import transforms

        h = np.asarray(self.to_numpy(x), np.float64)
        if rotation is not None:
            h = transforms.unrotate(h, rotation, "v") if inverse else transforms.rotate(h, rotation, "k")
        h = h * scale[np.arange(h.shape[1]) // (h.shape[1] // len(scale))][None, :, None]
        return self.asarray(h.astype(np.float32), "out" if inverse else "q")

    def synchronize(self) -> None:
        """Wait for queued device work; host backends have none."""

    # -- array interop; device backends override ------------------------------------------------------

    def __init__(self, **options: Any) -> None:
        """Backends with options (device, threads, ...) parse them with ``backend_util.parse_options``."""
        from .backend_util import parse_options

        parse_options(self.name, options, ())

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


def check_shape(backend: Backend, spec: CacheSpec, batch: AttentionBatch, n_heads: int) -> None:
    """UnsupportedError where ``backend`` declares ``shape_limits`` and refuses this call's shape; a caller
    of ``attention*`` runs it first. Costs one attribute read on backends without per-call limits."""
    if backend.shape_limits and (why := backend.supports(spec, "attention", batch.shape(n_heads))) is not None:
        raise UnsupportedError(
            f"backend {backend.name!r} refuses this attention call ({why}); change the call or create the cache on "
            "a backend that runs it (see `kvhal info`)"
        )


class HostPoolsBackend(Backend):
    """Shared pieces of backends whose pools are host numpy arrays in the common layout."""

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        k = [np.zeros(spec.pool_shape(n_blocks, "k"), np.uint8) for _ in range(spec.n_layers)]
        v = [np.zeros(spec.pool_shape(n_blocks, "v"), np.uint8) for _ in range(spec.n_layers)]
        return Pools(spec, n_blocks, k, v, sum(a.nbytes for a in k + v))

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        bs = pools.spec.block_size
        for pool in (pools.k[layer], pools.v[layer]):
            pool[dst // bs, :, dst % bs, :] = pool[src // bs, :, src % bs, :]

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        from .backend_util import check_block_ids, pages_to_blocks

        block_ids = check_block_ids(pools.n_blocks, block_ids)
        # np.take gathers whole pages ~3x faster than fancy indexing
        pages = [(np.take(k, block_ids, axis=0), np.take(v, block_ids, axis=0)) for k, v in zip(pools.k, pools.v)]
        return pages_to_blocks(pools.spec, pages)

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        from .backend_util import blocks_to_pages, check_block_ids

        pages = blocks_to_pages(pools.spec, data)
        block_ids = check_block_ids(pools.n_blocks, block_ids, len(data))
        for layer, (k, v) in enumerate(pages):
            pools.k[layer][block_ids] = k
            pools.v[layer][block_ids] = v
