"""``kvhal eval``'s KVarN rows: Muller et al.'s variance-normalized KV quantizer (arXiv 2606.03458), evaluated
by a numpy transcription on the host, not a registry format.

Each head's K (and V where asked) goes through, per tile of ``T`` consecutive tokens (after the f16 sinks):

1. the Hadamard rotation of ``:rot`` (``kvhal.transforms.rotate``) over head_dim;
2. Sinkhorn variance normalization: log scales ``a`` per token and ``b`` per channel start at 0; each of
   ``ITERS`` steps adds the log of each channel's std (over the tile's tokens, centred, ``n - 1``) of
   ``x / exp(a + b)`` to ``b``, then the log of each token's std (over channels) to ``a`` (stds clamped to
   [1e-3, 1e3]); the scales kept are those of the step (step 0 included) with the least imbalance
   ``max/min`` of the channel stds plus ``max/min`` of the token stds, then ``b`` shifted to mean 0 and ``a`` up
   by as much (the same ``a + b``: the iteration drifts the two apart, past f16's range);
3. asymmetric round-to-nearest at ``B`` bits of ``y = x / exp(a + b)``: K per channel over the tile's tokens,
   V per token over the channels (``s = (max - min) / (2^B - 1)``, ``m = min``, ``c = round((y - m) / s)``);
4. stored: the codes, ``exp(a)`` per token and ``exp(b) * s``, ``exp(b) * m`` per channel for K (V: ``exp(b)``
   per channel, ``exp(a) * s``, ``exp(a) * m`` per token), each side value in f16. Read back as
   ``x' = R^T (exp(a) (exp(b) s c + exp(b) m))`` (K) with the f16 side values.

Bits per value of a tile of ``n`` tokens and head_dim ``D``: K ``B + 16/D + 32/n``, V ``B + 32/D + 16/n``
(``kvarn:4`` at ``T`` = 128, ``D`` = 64: 4.5 and 4.625). Descriptor: ``kvarn:B`` (B = 2..8) then ``:gT`` (tile
tokens, default 128), ``:sinkN`` (first N tokens in f16, counted), ``:v=FMT`` (V in a registry format; default
q8_0) or ``:v=kvarnB`` (V through KVarN at B bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import formats
from ..errors import FormatError, SpecError
from ..formats.ggml import round_f16
from ..transforms import rotate, unrotate
from .fidelity_capture import Capture

PREFIX = "kvarn"
DEFAULT_V = "q8_0"
DEFAULT_TILE = 128
ITERS = 16
BITS = range(2, 9)


@dataclass(frozen=True)
class KVarnChoice:
    """A KVarN row: K bits, tile tokens, f16 sinks, and V (a registry format or KVarN bits)."""

    label: str
    bits: int
    tile: int = DEFAULT_TILE
    sinks: int = 0
    v_format: str = DEFAULT_V
    v_bits: int | None = None

    @property
    def k_label(self) -> str:
        return f"{PREFIX}:{self.bits}:g{self.tile}"

    @property
    def v_label(self) -> str:
        return f"{PREFIX}:{self.v_bits}:g{self.tile}" if self.v_bits is not None else self.v_format

    @property
    def options(self) -> dict[str, int]:
        return {"sinks": self.sinks, "tile": self.tile}

    def runner(self, cap: Capture, calibration: str | None = None) -> KVarnRun:
        """Calibration-free: ``calibration`` is not read."""
        return KVarnRun(self, cap)


def is_kvarn(text: str) -> bool:
    return isinstance(text, str) and text.strip().startswith(PREFIX + ":")


def _bits(label: str, text: str) -> int:
    if not text.isdigit() or int(text) not in BITS:
        raise FormatError(f"format descriptor {label!r}: KVarN bits are an integer 2..8, got {text!r}")
    return int(text)


def parse(text: str) -> KVarnChoice:
    label = text.strip()
    parts = label.split(":")
    bits = _bits(label, parts[1])
    tile, sinks, v_format, v_bits = DEFAULT_TILE, 0, DEFAULT_V, None
    for mod in parts[2:]:
        if mod.startswith("g") and mod[1:].isdigit() and int(mod[1:]) >= 2:
            tile = int(mod[1:])
        elif mod.startswith("sink") and mod[4:].isdigit():
            sinks = int(mod[4:])
        elif mod.startswith("v=" + PREFIX):
            v_bits = _bits(label, mod[2 + len(PREFIX) :])
        elif mod.startswith("v=") and mod[2:] in formats.names():
            v_format = mod[2:]
        elif mod.startswith("v="):
            raise FormatError(f"format descriptor {label!r}: unknown V format {mod[2:]!r}; known: {formats.names()}")
        else:
            raise SpecError(
                f"format descriptor {label!r}: unknown modifier {mod!r}; a kvarn row takes :gT (tile tokens >= 2), "
                ":sinkN, :v=FMT, :v=kvarnB"
            )
    return KVarnChoice(label, bits, tile, sinks, v_format, v_bits)


def _std(x: np.ndarray, axis: int) -> np.ndarray:
    n = x.shape[axis]
    return np.clip(np.std(x, axis=axis, ddof=1 if n > 1 else 0), 1e-3, 1e3)


def normalize(x: np.ndarray, iters: int = ITERS) -> tuple[np.ndarray, np.ndarray]:
    """Sinkhorn log scales ``(a, b)`` of one tile ``x[n, D]``: per token ``a[n]``, per channel ``b[D]``."""
    a, b = np.zeros(x.shape[0]), np.zeros(x.shape[1])

    def stds() -> tuple[np.ndarray, np.ndarray]:
        y = x * np.exp(-a[:, None] - b[None, :])
        return _std(y, 0), _std(y, 1)

    col, row = stds()
    best, best_ab = col.max() / col.min() + row.max() / row.min(), (a.copy(), b.copy())
    for _ in range(iters):
        b = b + np.log(col)
        a = a + np.log(_std(x * np.exp(-a[:, None] - b[None, :]), 1))
        col, row = stds()
        imbalance = col.max() / col.min() + row.max() / row.min()
        if imbalance <= best:
            best, best_ab = imbalance, (a.copy(), b.copy())
    a, b = best_ab  # y depends on a + b only: centre b so that every stored scale is well inside f16's range
    return a + b.mean(), b - b.mean()


def _f16(z: np.ndarray) -> np.ndarray:
    return round_f16(z.astype(np.float32)).astype(np.float64)


def tile_roundtrip(x: np.ndarray, bits: int, axis: int, iters: int = ITERS) -> np.ndarray:
    """One rotated tile ``x[n, D]`` through normalization, ``bits``-bit asymmetric RTN along ``axis`` (0: per
    channel over tokens, K; 1: per token over channels, V) and back, with f16 side values (float64)."""
    x = np.asarray(x, np.float64)
    a, b = normalize(x, iters)
    y = x * np.exp(-a[:, None] - b[None, :])
    lo, hi = y.min(axis=axis, keepdims=True), y.max(axis=axis, keepdims=True)
    s = (hi - lo) / (2**bits - 1)
    codes = np.clip(np.rint((y - lo) / np.where(s > 0, s, 1.0)), 0, 2**bits - 1)
    if axis == 0:  # K: token scale apart; channel scale folded into the step and the minimum
        outer, inner = np.exp(a)[:, None], np.exp(b)[None, :]
    else:  # V: channel scale apart; token scale folded in
        outer, inner = np.exp(b)[None, :], np.exp(a)[:, None]
    return _f16(outer) * (_f16(inner * s) * codes + _f16(inner * lo))


def roundtrip(x: np.ndarray, bits: int, tile: int, sinks: int, axis: int) -> np.ndarray:
    """``x[tokens, kv_heads, D]`` as KVarN reads it back: the first ``sinks`` tokens f16, the rest in tiles."""
    out = np.empty(x.shape, np.float64)
    out[:sinks] = round_f16(np.asarray(x[:sinks], np.float32))
    r = rotate(x[sinks:])
    body = np.empty_like(r)
    for start in range(0, r.shape[0], tile):
        for h in range(r.shape[1]):
            body[start : start + tile, h] = tile_roundtrip(r[start : start + tile, h], bits, axis)
    out[sinks:] = unrotate(body)
    return out


def side_bits(tokens: int, tile: int, d: int, per_token: int, per_channel: int) -> float:
    """Side bits per value over ``tokens`` in tiles of ``tile``: f16 values per token and per channel per tile."""
    if tokens <= 0:
        return 0.0
    n_tiles = -(-tokens // tile)
    return (16 * per_token * tokens + 16 * per_channel * d * n_tiles) / (tokens * d)


class KVarnRun:
    """One KVarN row over a capture: ``bits`` and per-layer reconstruction, as ``fidelity_codec.CodecRun``."""

    def __init__(self, c: KVarnChoice, cap: Capture) -> None:
        if c.sinks >= cap.tokens:
            raise SpecError(f"{c.label}: {c.sinks} sinks leave none of the capture's {cap.tokens} tokens to quantize")
        self.c, self.d = c, cap.head_dim

    def k_rate(self, tokens: int) -> float:
        """K bits per value of the quantized part (the sinks apart)."""
        return self.c.bits + side_bits(tokens - self.c.sinks, self.c.tile, self.d, 1, 2)

    def bits(self, tokens: int) -> tuple[float, float, float]:
        s, n = self.c.sinks, tokens - self.c.sinks
        if self.c.v_bits is not None:
            v = self.c.v_bits + side_bits(n, self.c.tile, self.d, 2, 1)
        else:
            v = formats.get(self.c.v_format).bits_per_element
        k = (self.k_rate(tokens) * n + 16 * s) / tokens
        v = (v * n + 16 * s) / tokens
        return k, v, (k + v) / 2

    def layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self.c
        kd = roundtrip(k, c.bits, c.tile, c.sinks, 0)
        if c.v_bits is not None:
            vd = roundtrip(v, c.v_bits, c.tile, c.sinks, 1)
        else:
            fmt = formats.get(c.v_format)
            vd = np.asarray(fmt.dequantize(fmt.quantize(v)), np.float64)
            vd[: c.sinks] = round_f16(np.asarray(v[: c.sinks], np.float32))
        return kd, vd


__all__ = ["KVarnChoice", "KVarnRun", "is_kvarn", "normalize", "parse", "roundtrip", "tile_roundtrip"]
