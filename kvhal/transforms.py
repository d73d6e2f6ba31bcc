"""The cache's value transforms: per-head scales and a fixed Walsh-Hadamard rotation.

A cache stores ``R(x / scale)`` and attends with ``R q * k_scale`` (exact: ``R`` is orthogonal and the
scale is one number per KV head), so every backend gets the transforms without kernel changes.

Rotations (``CacheSpec.k_rotation`` / ``v_rotation``):

* ``"hadamard"``: ``R = W D``, ``W`` the normalized Walsh-Hadamard matrix of order ``head_dim`` (a power of
  two), ``D`` a fixed diagonal of signs derived from sha256, identical in every process and on every machine.
* ``"hadamard-llama"``: llama.cpp's KV rotation (its PR #21038, ``llama-kv-cache.cpp``): the plain normalized
  Walsh-Hadamard matrix (Sylvester order, no signs) applied to consecutive blocks of ``n`` values of each
  head (``head_dim`` a multiple of 64). For K, ``n`` is the largest power of two dividing ``head_dim``
  (``build_input_k_rot``); for V, ``n = 64`` (``build_input_v_rot``). ``W`` is symmetric, so ``R^T = R``.
"""

from __future__ import annotations

import hashlib
from functools import cache

import numpy as np

from .errors import SpecError

ROTATIONS = ("hadamard", "hadamard-llama")


@cache
def signs(n: int) -> np.ndarray:
    """The rotation's fixed ±1 diagonal for ``head_dim`` ``n``: bit i of sha256 blocks of a fixed label."""
    out = bytearray()
    counter = 0
    while len(out) * 8 < n:
        out += hashlib.sha256(f"kvhal-hadamard-signs\0{n}\0{counter}".encode()).digest()
        counter += 1
    bits = np.unpackbits(np.frombuffer(bytes(out), np.uint8), bitorder="little")[:n]
    s = np.where(bits == 1, -1.0, 1.0)
    s.flags.writeable = False
    return s


def check_dim(n: int, mode: str = "hadamard") -> None:
    if mode == "hadamard-llama":
        if n < 64 or n % 64:
            raise SpecError(
                f"the hadamard-llama rotation needs head_dim to be a multiple of 64 (as llama.cpp), got {n}; "
                "pass rotation None (llama.cpp does not rotate such heads either)"
            )
        return
    if n < 1 or n & (n - 1):
        raise SpecError(f"a Hadamard rotation needs head_dim to be a power of two, got {n}; pass rotation None")


def llama_block(n: int, which: str) -> int:
    """The order of llama.cpp's Hadamard blocks for ``head_dim`` ``n``: for K the largest power of two
    dividing ``n`` (at least 64), for V always 64."""
    if which == "v":
        return 64
    b = 64
    while n % (2 * b) == 0:
        b *= 2
    return b


def _wht(x: np.ndarray) -> np.ndarray:
    """Normalized fast Walsh-Hadamard transform over the last axis (float64, symmetric and orthogonal)."""
    n = x.shape[-1]
    y = np.array(x, np.float64, copy=True).reshape(-1, n)
    h = 1
    while h < n:
        z = y.reshape(-1, n // (2 * h), 2, h)
        a, b = z[:, :, 0, :].copy(), z[:, :, 1, :]
        z[:, :, 0, :] += b
        z[:, :, 1, :] = a - b
        h *= 2
    return (y / np.sqrt(n)).reshape(x.shape)


def _blocks(x: np.ndarray, which: str) -> np.ndarray:
    """llama.cpp's rotation: ``W`` over consecutive blocks of the last axis (its own inverse)."""
    n = x.shape[-1]
    check_dim(n, "hadamard-llama")
    b = llama_block(n, which)
    y = np.asarray(x, np.float64)
    return _wht(y.reshape(*y.shape[:-1], n // b, b)).reshape(y.shape)


def _check_mode(mode: str, which: str) -> None:
    # a typo ("hadamard_llama") would otherwise run the other rotation, and "q" K's blocks, without a word
    if not isinstance(mode, str) or mode not in ROTATIONS:
        raise SpecError(f"rotation {mode!r} is not one of {ROTATIONS}")
    if not isinstance(which, str) or which not in ("k", "v"):
        raise SpecError(f'which must be "k" or "v" (the block size of "hadamard-llama"), got {which!r}')


def rotate(x: np.ndarray, mode: str = "hadamard", which: str = "k") -> np.ndarray:
    """``R x`` over the last axis, float64 (``which``: "k" or "v", for the block size of "hadamard-llama")."""
    _check_mode(mode, which)
    if mode == "hadamard-llama":
        return _blocks(x, which)
    check_dim(x.shape[-1])
    return _wht(np.asarray(x, np.float64) * signs(x.shape[-1]))


def unrotate(x: np.ndarray, mode: str = "hadamard", which: str = "k") -> np.ndarray:
    """``R^T x`` over the last axis, float64: the inverse of ``rotate``."""
    _check_mode(mode, which)
    if mode == "hadamard-llama":
        return _blocks(x, which)
    check_dim(x.shape[-1])
    return _wht(np.asarray(x, np.float64)) * signs(x.shape[-1])
