"""Block keys and the argument checks every tier entry point shares."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import TierError
from ..validate import is_int

DIGEST_BYTES = 32  # sha256: the fingerprint digest and the block content hash

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One block of one model/cache: ``namespace`` is the 32-byte fingerprint digest, ``block_hash`` the block's
    32-byte content hash (sha256). Tiers store and find blocks by this pair only."""

    namespace: bytes
    block_hash: bytes
    # computed once: a put or get looks each key up in several dicts (the generated hash rebuilt a tuple each time)
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[BlockKey], tuple[bytes, bytes]]:
        return BlockKey, (self.namespace, self.block_hash)  # bytes hash per process: recomputed on unpickling

    def __post_init__(self) -> None:
        for name in ("namespace", "block_hash"):
            value = getattr(self, name)
            if not isinstance(value, bytes):
                raise TierError(
                    f"BlockKey.{name} must be bytes (a {DIGEST_BYTES}-byte digest), got {type(value).__name__}"
                )
            if len(value) != DIGEST_BYTES:
                raise TierError(
                    f"BlockKey.{name} must be {DIGEST_BYTES} bytes (a sha256 digest), got {len(value)}; "
                    "pass hashlib.sha256(...).digest()"
                )
        object.__setattr__(self, "_hash", hash((self.namespace, self.block_hash)))


def check_keys(keys: object) -> list[BlockKey]:
    """``keys`` as a list of BlockKey, or TierError: a single key or a string is not a sequence of keys."""
    if isinstance(keys, BlockKey) or isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise TierError(f"keys must be a list of BlockKey, got {type(keys).__name__}; wrap a single key as [key]")
    if set(map(type, keys)) - {BlockKey}:  # (one pass in C: a put or get of 64 KiB blocks is ~1 µs per block)
        for i, k in enumerate(keys):
            if not isinstance(k, BlockKey):
                raise TierError(f"keys[{i}] must be a BlockKey, got {type(k).__name__}")
    return list(keys)


def check_payload(payload: object, what: str = "payload") -> bytes | memoryview:
    """A block's bytes: ``bytes`` as is, a bytearray/memoryview as a flat byte view (copied by the tier on store)."""
    if isinstance(payload, bytes):
        return payload
    if not isinstance(payload, bytearray | memoryview):
        raise TierError(
            f"{what} must be bytes, bytearray or memoryview, got {type(payload).__name__}; "
            "pass memoryview(array) for a numpy block"
        )
    view = memoryview(payload)
    if not view.c_contiguous:
        raise TierError(f"{what} must be C-contiguous; pass a contiguous copy (numpy.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_payloads(payloads: object, n: int) -> list[bytes | memoryview]:
    if isinstance(payloads, str | bytes | bytearray | memoryview) or not isinstance(payloads, Sequence):
        raise TierError(f"payloads must be a list of bytes, got {type(payloads).__name__}; wrap one block as [data]")
    if len(payloads) != n:
        raise TierError(f"put got {n} keys but {len(payloads)} payloads; pass one payload per key")
    if set(map(type, payloads)) <= {bytes}:
        return list(payloads)
    return [check_payload(p, f"payloads[{i}]") for i, p in enumerate(payloads)]


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """A positive int argument (a bool is not a count; a numpy int is, stored as a plain int)."""
    if not is_int(value):
        raise TierError(f"{name} must be an int, got {type(value).__name__}")
    n = int(value)  # type: ignore[call-overload]  # is_int: an int or numpy int
    if n < minimum:
        raise TierError(f"{name} must be >= {minimum}, got {n}")
    return n


def check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):  # numpy's numbers too
        raise TierError(f"{name} must be a number of seconds, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond float's range (its thousand digits would drown the message)
        raise TierError(f"{name} must be a finite number of seconds > 0, got an int beyond float's range") from None
    if not seconds > 0 or seconds == float("inf"):
        raise TierError(f"{name} must be a finite number of seconds > 0, got {value}")
    return seconds
