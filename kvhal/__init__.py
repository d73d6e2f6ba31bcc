"""kvhal: one quantized, paged KV cache format and API over every accelerator family.

``import kvhal`` loads numpy and kvhal's own modules only; a backend's vendor SDK is imported when
that backend is first used.
"""

from __future__ import annotations

from . import formats
from .backend import AttentionBatch, AttentionShape, Backend, HostPoolsBackend, Pools, Probe
from .cache import CacheStats, KVCache
from .errors import (
    BackendUnavailableError,
    CacheMismatchError,
    CapacityError,
    DTypeError,
    FingerprintMismatchError,
    FormatError,
    KVHalError,
    LlamaStateCorruptError,
    LlamaStateError,
    LlamaStateMismatchError,
    LlamaStateUnsupportedError,
    LlamaStateVersionError,
    NonFiniteError,
    PlanError,
    PositionError,
    SequenceError,
    ShapeError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotVersionError,
    SpecError,
    TierError,
    UnsupportedError,
)
from .fingerprint import Fingerprint
from .interop import to_like, to_numpy
from .registry import BackendInfo, backends
from .spec import CacheSpec

__version__ = "0.1.0"

__all__ = [
    "AttentionBatch",
    "AttentionShape",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CacheSpec",
    "CacheStats",
    "CacheMismatchError",
    "CapacityError",
    "DTypeError",
    "Fingerprint",
    "FingerprintMismatchError",
    "FormatError",
    "KVCache",
    "KVHalError",
    "LlamaStateCorruptError",
    "LlamaStateError",
    "LlamaStateMismatchError",
    "LlamaStateUnsupportedError",
    "LlamaStateVersionError",
    "HostPoolsBackend",
    "Pools",
    "NonFiniteError",
    "PlanError",
    "PositionError",
    "Probe",
    "SequenceError",
    "ShapeError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotVersionError",
    "SpecError",
    "TierError",
    "UnsupportedError",
    "backends",
    "formats",
    "to_like",
    "to_numpy",
]
