"""The cache's value transforms: per-head scales and a fixed Walsh-Hadamard rotation.

A cache stores ``R(x / scale)`` and attends with ``R q * k_scale`` (exact: ``R`` is orthogonal and the
scale is one number per KV head), so every backend gets the transforms without kernel changes.
``R = W D``: ``W`` the normalized Walsh-Hadamard matrix of order ``head_dim`` (a power of two), ``D`` a
fixed diagonal of signs derived from sha256, identical in every process and on every machine.
"""

from __future__ import annotations

import hashlib
from functools import cache

import numpy as np

from .errors import SpecError

ROTATIONS = ("hadamard",)


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


def check_dim(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise SpecError(f"a Hadamard rotation needs head_dim to be a power of two, got {n}; pass rotation None")


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


def rotate(x: np.ndarray) -> np.ndarray:
    """``R x = W (D x)`` over the last axis, float64."""
    check_dim(x.shape[-1])
    return _wht(np.asarray(x, np.float64) * signs(x.shape[-1]))


def unrotate(x: np.ndarray) -> np.ndarray:
    """``R^T x = D (W x)`` over the last axis, float64: the inverse of ``rotate``."""
    check_dim(x.shape[-1])
    return _wht(np.asarray(x, np.float64)) * signs(x.shape[-1])
