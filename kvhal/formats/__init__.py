"""The format registry: one entry per KV storage format, each with a numpy reference that *is* the spec.

A format stores a row of ``n`` values (one token of one KV head, ``n = head_dim``) as ``n // block_len``
blocks of ``block_bytes`` bytes each, laid out back to back. The ggml formats are byte-identical to
ggml's ``block_*`` structs, so a kvhal pool row is a valid ggml tensor row of that type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DTypeError, FormatError, NonFiniteError, ShapeError
from ..interop import to_numpy
from ..validate import count, is_int

Quantizer = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class KPageCodec:
    """K stored per channel over the ``block_size`` tokens of one page of one KV head (KIVI).

    A page of ``bs`` tokens x ``n`` channels is ``bs`` rows of packed codes followed by the page's
    per-channel f16 scales and mins; the page is ``bs * row_bytes(n, bs)`` contiguous bytes, so it fits
    the pool's ``[block, head, token, row]`` layout and a row view of it is just a reshape.
    """

    bits: int
    quantize_page: Callable[[np.ndarray], np.ndarray] = field(repr=False)  # [pages, bs, n] f32 -> [pages, bytes]
    dequantize_page: Callable[[np.ndarray, int], np.ndarray] = field(repr=False)  # ([pages, bytes], bs) -> f32

    def row_bytes(self, n: int, bs: int) -> int:
        """Bytes per token row of a K page: the codes plus this row's share of the page's scales."""
        n, bs = count(n, "head_dim", 1, FormatError), count(bs, "block_size", 1, FormatError)
        if n % 32 or (4 * n) % bs:
            raise FormatError(
                f"per-channel K pages of head_dim {n} and block_size {bs}: head_dim must be a multiple of 32 "
                f"and block_size must divide 4*head_dim = {4 * n} (pick a block_size of 8, 16, 32 or 64)"
            )
        return n * self.bits // 8 + 4 * n // bs

    def bits_per_element(self, bs: int) -> float:
        return self.bits + 32 / count(bs, "block_size", 1, FormatError)


@dataclass(frozen=True)
class Format:
    name: str
    block_len: int  # values per block
    block_bytes: int  # bytes per block, scales included
    max_abs: float  # largest |x| the format stores without overflowing its scale or values
    quantize_blocks: Quantizer = field(repr=False)  # [nb, block_len] f32 -> [nb, block_bytes] u8
    dequantize_blocks: Quantizer = field(repr=False)  # [nb, block_bytes] u8 -> [nb, block_len] f32
    ggml_type: str | None = None  # gguf.GGMLQuantizationType member name, when ggml has the format
    # values beyond max_abs store max_abs (fp8, nvfp4) instead of being refused
    saturates: bool = False
    # what a calibrated cache scale maps the first store's |x| max to; None: the format's own block
    # scales make a cache scale pointless, and calibration picks 1.0
    calibration_max: float | None = None
    # per-value formats without block scales (fp8): finite f32 values -> the values read back, fast; a
    # calibrated scale is then searched on it (see KVCache), not only rounded to a power of two
    round_values: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    # K quantized per channel over the tokens of a page (KIVI); V and this format's rows are per token
    k_page: KPageCodec | None = field(default=None, repr=False)
    # a row means something only with its cache's side data (kltq: per-layer, per-head calibration), so
    # quantize/dequantize here refuse and a cache runs the codec (kvhal.formats.kltq) with the side data
    side_data: bool = False

    @property
    def bits_per_element(self) -> float:
        """Storage bits per value, scales and mins included (q8_0: 8.5, q4_0: 4.5)."""
        return self.block_bytes * 8 / self.block_len

    def row_bytes(self, n: int) -> int:
        """Bytes of one stored row of ``n`` values."""
        self.check_row_len(n)
        return int(n) // self.block_len * self.block_bytes

    def check_row_len(self, n: int) -> None:
        if not is_int(n):  # "32" or 32.0 is not a row length (and would fail the arithmetic below untyped)
            raise FormatError(f"a row length is an int number of values (head_dim), got {type(n).__name__} {n!r}")
        if n <= 0 or n % self.block_len:
            raise FormatError(
                f"format {self.name} stores rows in blocks of {self.block_len} values; "
                f"a row of {n} is not a multiple of it (pick a head_dim that is)"
            )

    def check_values(self, x: np.ndarray) -> None:
        """Raise NonFiniteError if ``x`` holds a value this format cannot store faithfully."""
        if x.size == 0:
            return
        finite = np.isfinite(x)
        if not finite.all():
            bad = x[~finite].flat[0]
            raise NonFiniteError(
                f"{int((~finite).sum())} non-finite value(s) (first: {bad}) in input for format {self.name}; "
                "kvhal stores finite values only: find the NaN/inf upstream (overflowing activations) "
                "or clamp before storing"
            )
        amax = float(np.abs(x).max())
        if amax > self.max_abs and not self.saturates:
            raise NonFiniteError(
                f"|x| = {amax:g} exceeds {self.max_abs:g}, the largest value format {self.name} stores "
                "without overflowing to inf; clamp, rescale, or use a wider format (f32/bf16)"
            )

    def _rows(self, x: Any, dtype: type, what: str) -> np.ndarray:
        """``x`` as a contiguous array of ``dtype`` with at least one axis, or a typed error saying what to pass."""
        byte_rows = dtype is np.uint8
        try:
            arr = x if isinstance(x, np.ndarray) else to_numpy(x)  # torch, DLPack, nested lists
            # numbers only, arrays as lists: a cast would read "1.5", True and complex values as values, and
            # bytes from floats (1.5 -> 1) or out-of-range ints (-1 -> 255)
            bf16 = arr.dtype.name == "bfloat16" and not byte_rows  # ml_dtypes' (kind "V"): floats, as load returns
            if arr.dtype.kind not in ("iu" if byte_rows else "fiu") and not bf16:
                raise TypeError
            if byte_rows and arr.dtype != np.uint8 and arr.size and (arr.min() < 0 or arr.max() > 255):
                raise ValueError
            out: np.ndarray = np.ascontiguousarray(arr, dtype=dtype)
        except (TypeError, ValueError, DTypeError):  # None, "abc", ragged lists: not numbers
            dt = getattr(x, "dtype", None)
            raise DTypeError(
                f"{what} (format {self.name}); got {type(x).__name__}{f' of {dt}' if dt is not None else ''}"
            ) from None
        if out.ndim == 0:
            raise ShapeError(f"{what} (format {self.name}); got a scalar")
        return out

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Quantize float rows ``[..., n]`` into bytes ``[..., row_bytes(n)]``; rejects non-finite input."""
        x = self._rows(x, np.float32, "quantize takes float rows [..., n]")
        n = x.shape[-1]
        self.check_row_len(n)
        self.check_values(x)
        blocks = x.reshape(-1, self.block_len)
        out = self.quantize_blocks(blocks)
        return out.reshape(*x.shape[:-1], n // self.block_len * self.block_bytes)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Dequantize bytes ``[..., row_bytes]`` into float32 rows ``[..., n]``."""
        q = self._rows(q, np.uint8, "dequantize takes uint8 rows [..., row_bytes]")
        nb = q.shape[-1]
        if nb % self.block_bytes:
            raise FormatError(f"{nb} bytes is not a whole number of {self.name} blocks ({self.block_bytes} B each)")
        out = self.dequantize_blocks(q.reshape(-1, self.block_bytes))
        return out.reshape(*q.shape[:-1], nb // self.block_bytes * self.block_len)


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    if fmt.name in _REGISTRY:
        raise FormatError(f"format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def get(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    if not isinstance(name, str):  # a list or dict is not a name (nor hashable)
        raise FormatError(f"a format is a name such as 'q8_0' or a kvhal.formats.Format, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise FormatError(f"unknown format {name!r}; known formats: {', '.join(_REGISTRY)}") from None


def names() -> list[str]:
    """Every registered format, in id order (the kltq budgets last, each its own name)."""
    return list(_REGISTRY)


def plain_names() -> list[str]:
    """The formats whose rows stand alone (no side data): what block kernels and format tables cover; the ids
    are those of ``names()`` (the side-data formats join after them)."""
    return [n for n, f in _REGISTRY.items() if not f.side_data]


# registration order is the format id kernels switch on: formats only ever join at the end
# isort: off
from . import ggml as _ggml  # noqa: E402,F401  (f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1)
from . import fp8 as _fp8  # noqa: E402,F401  (fp8_e4m3 fp8_e5m2)
from . import fp4 as _fp4  # noqa: E402,F401  (mxfp4 nvfp4)
from . import kivi as _kivi  # noqa: E402,F401  (kivi4 kivi2)
from . import kltq_format as _kltq_format  # noqa: E402,F401  (kltq:2 .. kltq:8, with side data)
# isort: on

# the formats of kvhal 1 (ggml's KV types): what a backend without kernels for the later ones runs
GGML_CLASSIC = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

__all__ = ["GGML_CLASSIC", "Format", "KPageCodec", "get", "names", "plain_names", "register"]
