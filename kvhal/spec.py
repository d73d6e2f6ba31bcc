"""CacheSpec: the shape and formats of a KV cache, validated once."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import formats
from .errors import FormatError, SpecError
from .validate import count, is_int

# a cache scale: None (1.0), a positive finite float, one per KV head, one per KV head for each layer,
# or "calibrate"
Scale = float | tuple[float, ...] | tuple[tuple[float, ...], ...] | str | None


def _check_scale(name: str, value: object, n_layers: int, n_kv_heads: int) -> None:
    def ok(x: object) -> bool:
        # numbers.Real takes numpy's float32/int scalars too; a bool is not a scale
        if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
            return False
        try:
            f = float(x)
        except OverflowError:  # an int beyond float's range is not a finite scale
            return False
        return math.isfinite(f) and f > 0

    if value is None or (isinstance(value, str) and value == "calibrate"):
        return
    if isinstance(value, tuple) and value and isinstance(value[0], (tuple, list)):
        if len(value) != n_layers or not all(
            isinstance(row, (tuple, list)) and len(row) == n_kv_heads and all(ok(x) for x in row) for row in value
        ):
            raise SpecError(
                f"CacheSpec.{name}={value!r}: a per-layer scale is a tuple of {n_layers} tuples (one per layer) of "
                f"{n_kv_heads} positive finite floats (one per KV head)"
            )
        return
    if isinstance(value, tuple):
        if len(value) != n_kv_heads or not all(ok(x) for x in value):
            raise SpecError(
                f"CacheSpec.{name}={value!r}: a per-head scale is a tuple of {n_kv_heads} positive finite floats "
                "(one per KV head)"
            )
        return
    if not ok(value):
        raise SpecError(
            f"CacheSpec.{name}={value!r}: a scale is None (1.0), a positive finite float, a tuple of one per KV "
            'head, one such tuple per layer, or "calibrate"'
        )


@dataclass(frozen=True)
class CacheSpec:
    """Shape and storage formats of a paged KV cache.

    ``block_size`` is tokens per page. K and V may use different formats.

    Transforms (applied by the cache, so every backend has them; see ``kvhal.transforms``):
    ``k_scale``/``v_scale`` (vLLM's meaning: ``stored = x / scale``): None (1.0), a float, a tuple of one
    float per KV head, a tuple of such tuples (one per layer), or ``"calibrate"`` (per layer and head,
    ``amax / format.calibration_max`` of that layer's first store, then fixed). ``k_rotation``/``v_rotation``: None, ``"hadamard"`` (head_dim a power of two) or
    ``"hadamard-llama"`` (llama.cpp's unsigned block rotation of quantized K/V; head_dim a multiple of 64).
    ``tail``: at least the last ``tail`` tokens of each sequence (at most ``tail + block_size - 1``) stay
    in f16; the quantized pages only ever hold whole blocks.
    ``sinks``: each sequence's first ``sinks`` tokens (rounded up to whole pages: ``sink_tokens``) are also
    kept in f16 and attended in f16 instead of their quantized pages (the attention sink; with ``tail``, both
    ends of the sequence).
    ``k_side``/``v_side``: the side data of a ``kltq:B`` K/V format (``kvhal.formats.kltq``): a ``kltq.Side`` of
    this spec's shape and budget, the path of one (``kvhal eval --calibrate`` writes them), or None: each layer
    calibrates on its first store (plain KLT, the sink tokens skipped), then keeps it. kltq takes no
    scale/rotation on its side (its basis is its transform).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    k_format: str = "f16"
    v_format: str = "f16"
    block_size: int = 16
    tail: int = 0
    k_scale: Scale = None
    v_scale: Scale = None
    k_rotation: str | None = None
    v_rotation: str | None = None
    sinks: int = 0
    k_side: Any = None  # kltq.Side | str | os.PathLike | None (typed loosely: the spec stays importable light)
    v_side: Any = None  # the same for a kltq V format

    def __post_init__(self) -> None:
        from .transforms import ROTATIONS, check_dim

        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise SpecError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if not is_int(self.tail) or self.tail < 0:
            raise SpecError(f"CacheSpec.tail must be an int >= 0 (tokens kept in f16), got {self.tail!r}")
        if not is_int(self.sinks) or self.sinks < 0:
            raise SpecError(
                f"CacheSpec.sinks must be an int >= 0 (each sequence's first tokens kept in f16), got {self.sinks!r}"
            )
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size", "tail", "sinks"):
            # a numpy int is stored as the plain int it is: one spec, one hash, one fingerprint
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if isinstance(value, list):  # a list would make the spec unhashable: take it as the tuple it means
                object.__setattr__(self, name, tuple(value))
            _check_scale(name, getattr(self, name), self.n_layers, self.n_kv_heads)
            value = getattr(self, name)
            if isinstance(value, tuple) and isinstance(value[0], (tuple, list)):  # 2 and 2.0: one fingerprint
                object.__setattr__(self, name, tuple(tuple(float(x) for x in row) for row in value))
            elif isinstance(value, tuple):
                object.__setattr__(self, name, tuple(float(x) for x in value))
            elif value is not None and not isinstance(value, str):
                object.__setattr__(self, name, float(value))
        for name in ("k_rotation", "v_rotation"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in ROTATIONS):
                raise SpecError(f"CacheSpec.{name}={value!r}: pass None or one of {ROTATIONS}")
            if value is not None:
                try:
                    check_dim(self.head_dim, value)
                except SpecError as e:
                    raise SpecError(f"CacheSpec.{name}={value!r}: {e}") from None
        for name in ("k_format", "v_format"):
            fmt = formats.get(getattr(self, name))  # raises FormatError for unknown names
            if fmt.name not in formats.names() or formats.get(fmt.name) != fmt:
                raise SpecError(f"CacheSpec.{name}={fmt!r} is not a registered format; pass its name, e.g. 'q8_0'")
            # a Format is kept by its name: one spec, one hash, one fingerprint (JSON has no Format)
            object.__setattr__(self, name, fmt.name)
            try:
                fmt.check_row_len(self.head_dim)
                if name == "k_format" and fmt.k_page is not None:
                    fmt.k_page.row_bytes(self.head_dim, self.block_size)
            except FormatError as e:
                raise SpecError(f"CacheSpec.{name}={fmt.name!r}: {e}") from None
        self._check_side()

    def _check_side(self) -> None:
        for w in "kv":
            self._check_codec(w)

    def _check_codec(self, w: str) -> None:
        """A kltq ``{w}_format``'s constraints and its ``{w}_side`` (loaded from a path); side data refused for
        any other format."""
        from .formats import kltq

        which, fmt, name = w.upper(), getattr(self, f"{w}_fmt"), f"{w}_side"
        if not fmt.side_data:
            if getattr(self, name) is not None:
                raise SpecError(
                    f"CacheSpec.{name} is side data of a kltq {which} format; {w}_format={fmt.name!r} takes none "
                    f"(pass {name}=None, or a kltq:B {w}_format)"
                )
            return
        if getattr(self, f"{w}_scale") is not None or getattr(self, f"{w}_rotation") is not None:
            raise SpecError(
                f"CacheSpec.{w}_format={fmt.name!r} takes no {w}_scale/{w}_rotation: its calibrated basis is its "
                f"transform (pass {w}_scale=None, {w}_rotation=None)"
            )
        side = getattr(self, name)
        if side is None:
            return
        if isinstance(side, (str, os.PathLike)):
            side = kltq.Side.load(side)
            object.__setattr__(self, name, side)
        if not isinstance(side, kltq.Side):
            raise SpecError(
                f"CacheSpec.{name} must be a kvhal.formats.kltq.Side, the path of one (.npz) or None, got "
                f"{type(side).__name__}"
            )
        bits = kltq.parse_name(fmt.name)
        want = (self.n_layers, self.n_kv_heads, self.head_dim)
        if side.shape != want or side.bits != bits:
            raise SpecError(
                f"CacheSpec.{name} is kltq:{side.bits:g} side data of shape (layers, heads, head_dim) {side.shape}; "
                f"this spec needs {fmt.name} of shape {want}: calibrate for this model and budget "
                f"(kvhal eval --calibrate), or pass {name}=None to calibrate on each layer's first store"
            )

    @property
    def k_fmt(self) -> formats.Format:
        return formats.get(self.k_format)

    @property
    def v_fmt(self) -> formats.Format:
        return formats.get(self.v_format)

    @property
    def k_codec(self) -> bool:
        """K is a transform codec with side data (kltq): rows mean something only with the layer's side data."""
        return self.k_fmt.side_data

    @property
    def v_codec(self) -> bool:
        """V is a transform codec with side data (kltq): attention weights its decoded coefficients, and the cache
        maps the output back to values (``mean + S o'``)."""
        return self.v_fmt.side_data

    @property
    def k_paged(self) -> bool:
        """K is quantized per channel over whole pages (KIVI): a K page is written once, when full."""
        return self.k_fmt.k_page is not None

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's K for one head (for a per-channel K format, its share of the page)."""
        if self.k_fmt.k_page is not None:
            return self.k_fmt.k_page.row_bytes(self.head_dim, self.block_size)
        return self.k_fmt.row_bytes(self.head_dim)

    @property
    def k_bits_per_element(self) -> float:
        fmt = self.k_fmt
        return fmt.k_page.bits_per_element(self.block_size) if fmt.k_page is not None else fmt.bits_per_element

    @property
    def v_row_bytes(self) -> int:
        return self.v_fmt.row_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes one token takes over all layers and KV heads."""
        return self.n_layers * self.n_kv_heads * (self.k_row_bytes + self.v_row_bytes)

    def page_nbytes(self, which: str) -> int:
        """Bytes of one block's K (``which="k"``) or V page of one layer: ``n_kv_heads * block_size`` rows."""
        return self.n_kv_heads * self.block_size * self._row_bytes(which)

    def _row_bytes(self, which: str) -> int:
        if not isinstance(which, str) or which not in ("k", "v"):  # anything else was read as "v"
            raise SpecError(f'which must be "k" or "v", got {which!r}')
        return self.k_row_bytes if which == "k" else self.v_row_bytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one whole block, all layers, K and V: the unit of raw block I/O (snapshots, tiers)."""
        return self.n_layers * (self.page_nbytes("k") + self.page_nbytes("v"))

    def pool_shape(self, n_blocks: int, which: str) -> tuple[int, int, int, int]:
        """Pool layout, shared by every backend: ``[n_blocks, n_kv_heads, block_size, row_bytes]`` uint8.

        Head-major inside a page, so one (page, head) is a contiguous ggml tensor of ``block_size``
        rows of ``head_dim`` values: attention over one KV head reads contiguous memory.
        """
        n_blocks = count(n_blocks, "n_blocks")
        return (n_blocks, self.n_kv_heads, self.block_size, self._row_bytes(which))

    @property
    def uses_tail(self) -> bool:
        """Tokens pass through a per-sequence f16 tail before they are quantized, a whole block at a time
        (``tail > 0``, or a per-channel K format, whose pages are quantized only when full)."""
        return self.tail > 0 or self.k_paged or self.sinks > 0

    @property
    def sink_tokens(self) -> int:
        """Tokens of each sequence's start held in f16: ``sinks`` rounded up to whole pages (0: none)."""
        return -(-self.sinks // self.block_size) * self.block_size

    @property
    def transformed(self) -> bool:
        """Any scale or rotation other than the identity."""
        return any(x is not None for x in (self.k_scale, self.v_scale, self.k_rotation, self.v_rotation))
