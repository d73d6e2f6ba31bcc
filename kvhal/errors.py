"""Every error kvhal raises is a KVHalError; each message says what to do next."""

from __future__ import annotations


class KVHalError(Exception):
    """Base class of all kvhal errors."""


class ShapeError(KVHalError, ValueError):
    """An array has the wrong shape for the cache it is given to."""


class DTypeError(KVHalError, TypeError):
    """An array has a dtype kvhal does not take."""


class NonFiniteError(KVHalError, ValueError):
    """Input holds NaN or ±inf, or a value the format cannot represent."""


class FormatError(KVHalError, ValueError):
    """Unknown format name or a format that does not fit the spec."""


class UnsupportedError(KVHalError):
    """The chosen backend cannot run this format/operation; the message names backends that can."""


class BackendUnavailableError(KVHalError):
    """The requested backend is not installed or its probe refused this machine."""


class CapacityError(KVHalError):
    """The cache has no free blocks left for the requested store or copy."""


class SequenceError(KVHalError, KeyError):
    """Unknown or freed sequence id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PositionError(KVHalError, IndexError):
    """A position or range outside the sequence."""


class SpecError(KVHalError, ValueError):
    """An invalid CacheSpec or KVCache argument."""


class PlanError(KVHalError, ValueError):
    """A model shape, config.json, memory budget or device that ``kvhal plan`` cannot use."""


class SnapshotError(KVHalError):
    """A snapshot file cannot be written or restored; the cache is left exactly as it was."""


class SnapshotCorruptError(SnapshotError):
    """The file is not a complete kvhal snapshot: truncated, bit-flipped, or not safetensors at all."""


class SnapshotVersionError(SnapshotError):
    """The file was written by a kvhal whose storage format version this one does not read."""


class FingerprintMismatchError(SnapshotError):
    """The snapshot's K/V belong to another model, spec or format version than this cache's."""


class TierError(KVHalError):
    """A block tier (kvhal.tiers) got a bad argument or cannot be set up; lookups themselves never raise."""


class LlamaStateError(KVHalError):
    """A llama.cpp sequence state cannot be read, imported or written (kvhal.interop.llamacpp); nothing was
    imported."""


class LlamaStateCorruptError(LlamaStateError, ValueError):
    """The bytes are not a complete llama.cpp sequence state: truncated, bit-flipped, or not one at all."""


class LlamaStateVersionError(LlamaStateError):
    """A sequence-state file of another version than the one kvhal reads (llama.cpp's LLAMA_STATE_SEQ_VERSION)."""


class LlamaStateMismatchError(LlamaStateError):
    """The state does not fit the model or cache it is given to (layers, KV heads, formats, rotation)."""


class LlamaStateUnsupportedError(LlamaStateError):
    """A valid state kvhal cannot hold: positions not contiguous from 0, a ggml type kvhal does not share,
    per-cell extension data (M-RoPE), quantized transposed V."""


class CacheMismatchError(KVHalError, TypeError):
    """A framework's cache and attention function that do not go together (kvhal attention over another
    cache); the message says which to pass instead."""
