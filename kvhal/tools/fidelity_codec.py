"""``kvhal eval``'s rows of the kltq transform codec (``kvhal.formats.kltq``, the numpy reference) and the
Gaussian rate-distortion limit printed next to every row.

A kltq row reconstructs each layer's K (and V where asked) through the reference codec on the host: the side
data is calibrated on the capture's keys and queries (``kvhal eval``'s single store is the cache's first
prefill) or read from a directory ``kvhal eval --calibrate DIR`` wrote on another capture (``--calibration
DIR``: held-out). Descriptor: ``kltq:B`` then modifiers ``:plain`` (plain KLT, no query weighting), ``:sinkN``
(the first N tokens kept in f16), ``:v=FMT`` (V in a registry format; default q8_0) or ``:v=kltqB`` (V through
an unweighted KLT codec at B bits).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import formats
from ..errors import FormatError, SpecError
from ..formats import kltq
from ..formats.ggml import round_f16
from .fidelity_capture import Capture
from .output import output_dir

DEFAULT_V = "q8_0"


@dataclass(frozen=True)
class CodecChoice:
    """A kltq row: K budget, query weighting, f16 sinks, and V (a registry format or a kltq budget)."""

    label: str
    bits: float
    weighted: bool = True
    sinks: int = 0
    v_format: str = DEFAULT_V
    v_bits: float | None = None  # V through kltq (unweighted) at this budget instead of v_format

    @property
    def k_label(self) -> str:
        return f"kltq:{self.bits:g}"

    @property
    def v_label(self) -> str:
        return f"kltq:{self.v_bits:g}" if self.v_bits is not None else self.v_format

    @property
    def options(self) -> dict[str, Any]:
        return {"sinks": self.sinks, "weighted": self.weighted}

    def runner(self, cap: Capture, calibration: str | None) -> CodecRun:
        return CodecRun(self, cap, calibration)


def is_codec(text: str) -> bool:
    return isinstance(text, str) and text.strip().startswith(kltq.PREFIX + ":")


def parse(text: str) -> CodecChoice:
    label = text.strip()
    parts = label.split(":")
    bits = kltq.parse_name(":".join(parts[:2]))
    weighted, sinks, v_format, v_bits = True, 0, DEFAULT_V, None
    for mod in parts[2:]:
        if mod == "plain":
            weighted = False
        elif mod.startswith("sink") and mod[4:].isdigit():
            sinks = int(mod[4:])
        elif mod.startswith("v="):
            v = mod[2:]
            if v.startswith(kltq.PREFIX):
                v_bits = kltq.parse_name(f"{kltq.PREFIX}:{v[len(kltq.PREFIX) :]}")
            elif v in formats.names():
                v_format = v
            else:
                raise FormatError(f"format descriptor {label!r}: unknown V format {v!r}; known: {formats.names()}")
        else:
            raise SpecError(
                f"format descriptor {label!r}: unknown modifier {mod!r}; a kltq row takes :plain, :sinkN, :v=FMT, "
                ":v=kltqB"
            )
    return CodecChoice(label, bits, weighted, sinks, v_format, v_bits)


def side_path(directory: str, bits: float, weighted: bool, sinks: int, which: str = "k") -> str:
    """``DIR/kltq-k-4.5-sink1.npz``: one file per side, budget, weighting and sinks skipped in calibration."""
    return os.path.join(directory, f"kltq-{which}-{bits:g}{'' if weighted else '-plain'}-sink{sinks}.npz")


class CodecRun:
    """One kltq row over a capture: its K side data (and V's), then per-layer reconstruction."""

    def __init__(self, c: CodecChoice, cap: Capture, calibration: str | None) -> None:
        self.c = c
        skip = min(c.sinks, cap.tokens - 2)
        if calibration is not None:
            self.k_side = kltq.Side.load(side_path(calibration, c.bits, c.weighted, c.sinks))
            self.v_side = (
                None if c.v_bits is None else kltq.Side.load(side_path(calibration, c.v_bits, False, c.sinks, "v"))
            )
        else:
            self.k_side = kltq.calibrate(cap.k, c.bits, cap.q if c.weighted else None, skip=skip)
            self.v_side = None if c.v_bits is None else kltq.calibrate(cap.v, c.v_bits, None, skip=skip)
        for s in (self.k_side, self.v_side):
            if s is not None and s.shape != (cap.n_layers, cap.n_kv_heads, cap.head_dim):
                raise SpecError(
                    f"kltq side data of shape {s.shape} does not fit this capture "
                    f"({cap.n_layers}, {cap.n_kv_heads}, {cap.head_dim}); calibrate on the same model"
                )
        # a file under another row's name (copied, renamed) would code at its own budget while the row reports
        # this one's bits
        for s, bits, weighted, which in ((self.k_side, c.bits, c.weighted, "k"), (self.v_side, c.v_bits, False, "v")):
            if s is not None and (s.bits, s.weighted) != (bits, weighted):
                raise SpecError(
                    f"{c.label}: the {which.upper()} side data read from {calibration} is kltq:{s.bits:g} "
                    f"{'query-weighted' if s.weighted else 'plain'}, not the row's kltq:{bits:g} "
                    f"{'query-weighted' if weighted else 'plain'}; write it again with kvhal eval --calibrate"
                )

    def k_rate(self, tokens: int) -> float:
        """K bits per value of the quantized part (the sinks apart)."""
        return self.c.bits

    def bits(self, tokens: int) -> tuple[float, float, float]:
        s = min(self.c.sinks, tokens)
        v = self.c.v_bits if self.c.v_bits is not None else formats.get(self.c.v_format).bits_per_element
        k = (self.c.bits * (tokens - s) + 16 * s) / tokens
        v = (v * (tokens - s) + 16 * s) / tokens
        return k, v, (k + v) / 2

    def layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This layer's K and V as the codec reads them back (sinks: f16 of the values)."""
        s = self.c.sinks
        kd = kltq.dequantize(self.k_side, layer, kltq.quantize(self.k_side, layer, k))
        if self.v_side is not None:
            vd = kltq.dequantize(self.v_side, layer, kltq.quantize(self.v_side, layer, v))
        else:
            fmt = formats.get(self.c.v_format)
            vd = fmt.dequantize(fmt.quantize(v))
        if s:
            kd[:s], vd[:s] = round_f16(k[:s]), round_f16(v[:s])
        return kd, vd


def write_calibration(
    directory: str, cap: Capture, budgets: list[tuple[float, bool, int]], v: list[tuple[float, int]]
) -> list[str]:
    """Side data of every (K budget, weighted, sinks) and V budget on this capture, into ``directory`` (made if
    missing; its parent is not). A path that is no directory, or one that cannot be written, is a ``SpecError``."""
    output_dir(directory, "--calibrate")
    out = []
    try:
        if not os.path.isdir(directory):
            os.mkdir(directory)
        for bits, weighted, sinks in budgets:
            path = side_path(directory, bits, weighted, sinks)
            kltq.calibrate(cap.k, bits, cap.q if weighted else None, skip=min(sinks, cap.tokens - 2)).save(path)
            out.append(path)
        for bits, sinks in v:
            path = side_path(directory, bits, False, sinks, "v")
            kltq.calibrate(cap.v, bits, None, skip=min(sinks, cap.tokens - 2)).save(path)
            out.append(path)
    except OSError as e:
        raise SpecError(f"cannot write the kltq side data into {directory}: {e}") from None
    return out


def limit_keys(k: np.ndarray, q: np.ndarray, bits: float, sinks: int) -> np.ndarray:
    """K through the query-weighted Gaussian rate-distortion test channel at ``bits`` (first ``sinks`` exact)."""
    if bits <= 0:
        return np.zeros_like(k, dtype=np.float64)
    return kltq.rd_channel(k, q, bits, skip=sinks, seed=0)


__all__ = ["CodecChoice", "CodecRun", "is_codec", "limit_keys", "parse", "write_calibration"]
