"""CacheSpec: the shape and formats of a KV cache, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from . import formats
from .errors import FormatError, SpecError


@dataclass(frozen=True)
class CacheSpec:
    """Shape and storage formats of a paged KV cache.

    ``block_size`` is tokens per page. K and V may use different formats. ``tail`` (the last N
    tokens of each sequence kept in f16) is part of the contract but not implemented yet: only
    ``tail=0`` is accepted.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    k_format: str = "f16"
    v_format: str = "f16"
    block_size: int = 16
    tail: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if self.tail != 0:
            raise SpecError(f"CacheSpec.tail={self.tail!r}: the f16 precision tail is not implemented yet; pass tail=0")
        for name in ("k_format", "v_format"):
            fmt = formats.get(getattr(self, name))  # raises FormatError for unknown names
            try:
                fmt.check_row_len(self.head_dim)
                if name == "k_format" and fmt.k_page is not None:
                    fmt.k_page.row_bytes(self.head_dim, self.block_size)
            except FormatError as e:
                raise SpecError(f"CacheSpec.{name}={fmt.name!r}: {e}") from None

    @property
    def k_fmt(self) -> formats.Format:
        return formats.get(self.k_format)

    @property
    def v_fmt(self) -> formats.Format:
        return formats.get(self.v_format)

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
        return self.n_kv_heads * self.block_size * (self.k_row_bytes if which == "k" else self.v_row_bytes)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one whole block, all layers, K and V: the unit of raw block I/O (snapshots, tiers)."""
        return self.n_layers * (self.page_nbytes("k") + self.page_nbytes("v"))

    def pool_shape(self, n_blocks: int, which: str) -> tuple[int, int, int, int]:
        """Pool layout, shared by every backend: ``[n_blocks, n_kv_heads, block_size, row_bytes]`` uint8.

        Head-major inside a page, so one (page, head) is a contiguous ggml tensor of ``block_size``
        rows of ``head_dim`` values: attention over one KV head reads contiguous memory.
        """
        rb = self.k_row_bytes if which == "k" else self.v_row_bytes
        return (n_blocks, self.n_kv_heads, self.block_size, rb)
