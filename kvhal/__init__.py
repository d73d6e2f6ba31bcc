"""kvhal: one quantized, paged KV cache format and API over every accelerator family.

``import kvhal`` loads numpy and kvhal's own modules only; a backend's vendor SDK is imported when
that backend is first used.
"""

from __future__ import annotations

from . import formats
from .backend import Backend, LayerPools, Probe
from .cache import CacheStats, KVCache
from .errors import (
    BackendUnavailableError,
    CapacityError,
    DTypeError,
    FormatError,
    KVHalError,
    NonFiniteError,
    PositionError,
    SequenceError,
    ShapeError,
    SpecError,
    UnsupportedError,
)
from .interop import to_like, to_numpy
from .registry import BackendInfo, backends
from .spec import CacheSpec

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CacheSpec",
    "CacheStats",
    "CapacityError",
    "DTypeError",
    "FormatError",
    "KVCache",
    "KVHalError",
    "LayerPools",
    "NonFiniteError",
    "PositionError",
    "Probe",
    "SequenceError",
    "ShapeError",
    "SpecError",
    "UnsupportedError",
    "backends",
    "formats",
    "to_like",
    "to_numpy",
]
