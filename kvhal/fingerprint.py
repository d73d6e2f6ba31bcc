"""Model fingerprints and block hashes: the names of cached K/V, equal across processes and machines.

A block hash is ``sha256(domain || parent || extra digest || token ids as little-endian int64)``; the
chain's root parent is the cache's fingerprint digest, which covers the model identity, the spec and
kvhal's storage format version. No random seed and no Python ``hash`` anywhere, so two processes (any
``PYTHONHASHSEED``) name the same prefix alike, and different models, specs or tenants never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import SpecError
from .spec import CacheSpec

# Bump when stored bytes of any format change meaning: it is part of every fingerprint digest.
FORMAT_VERSION = 1
_BLOCK_DOMAIN = b"kvhal-block-v1\0"
NO_EXTRA = bytes(32)
_TRANSFORMS = ("k_scale", "v_scale", "k_rotation", "v_rotation")


def _lists(value: Any) -> Any:
    """Tuples (per-head and per-layer scales) as the lists JSON gives back, nested ones too."""
    return [_lists(x) for x in value] if isinstance(value, (tuple, list)) else value


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(f"{where} is {value!r}; fingerprint values must be finite")
        return
    if isinstance(value, (list, tuple)):
        for i, x in enumerate(value):
            _check_json(x, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, x in value.items():
            if not isinstance(k, str):
                raise SpecError(f"{where} has key {k!r}; keys must be strings")
            _check_json(x, f"{where}[{k!r}]")
        return
    raise SpecError(
        f"{where} is a {type(value).__name__}; fingerprint and extra-key values must be JSON "
        "(str, int, float, bool, None, lists and dicts of them)"
    )


def _plain(value: Any) -> Any:
    """Checked JSON values with every Mapping a dict (json writes no other Mapping), copied: later changes to the
    caller's dicts do not reach a fingerprint."""
    if isinstance(value, Mapping):
        return {k: _plain(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(x) for x in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, shortest float repr (stable across versions)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def extra_digest(extra: Mapping[str, Any] | None) -> bytes:
    """The digest of a sequence's extra keys (LoRA id, cache salt, ...): 32 zero bytes when there are none."""
    if extra is not None and not isinstance(extra, Mapping):  # extra=0 or [] is a mistake, not "no keys"
        raise SpecError(f"extra must be a dict of JSON values (e.g. {{'lora': 'id'}}), got {type(extra).__name__}")
    if not extra:
        return NO_EXTRA
    _check_json(extra, "extra")
    return hashlib.sha256(b"kvhal-extra\0" + canonical_json(_plain(extra))).digest()


@dataclass(frozen=True)
class Fingerprint:
    """What makes cached K/V reusable: the model (name plus weights digest, say) and anything else that
    changes K/V bytes (``extra``: RoPE settings, dtype of the run...). The cache adds its spec."""

    model: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise SpecError(f"Fingerprint.model must be a str (e.g. 'org/model@<weights sha256>'), got {self.model!r}")
        if not isinstance(self.extra, Mapping):
            raise SpecError(f"Fingerprint.extra must be a dict, got {type(self.extra).__name__}")
        _check_json(self.extra, "Fingerprint.extra")
        object.__setattr__(self, "extra", _plain(self.extra))

    def as_dict(self, spec: CacheSpec | None = None) -> dict[str, Any]:
        if spec is not None and not isinstance(spec, CacheSpec):
            raise SpecError(f"spec must be a kvhal.CacheSpec or None, got {type(spec).__name__}")
        out: dict[str, Any] = {"format_version": FORMAT_VERSION, "model": self.model, "extra": dict(self.extra)}
        if spec is not None:
            d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
            # kltq side data by its digest (the snapshot carries the arrays)
            for name in ("k_side", "v_side"):
                side = getattr(spec, name)
                d[name] = None if side is None else side.digest()
            # transforms at their identity are left out, so caches without them keep their digests
            # (and sinks at 0, k_side/v_side None: specs without a sink head or side data keep their digests)
            out["spec"] = {
                k: _lists(v)
                for k, v in d.items()
                if not (k in _TRANSFORMS + ("k_side", "v_side") and v is None) and not (k == "sinks" and v == 0)
            }
        return out

    def digest(self, spec: CacheSpec | None = None) -> bytes:
        """sha256 of the canonical JSON of model, extra, kvhal's format version and (given) the spec."""
        return hashlib.sha256(b"kvhal-fingerprint\0" + canonical_json(self.as_dict(spec))).digest()


def block_hash(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA) -> bytes:
    """The hash of one full block: its parent's hash, its extra-key digest and its token ids."""
    ids = np.asarray(tokens, dtype="<i8")
    return hashlib.sha256(_BLOCK_DOMAIN + parent + extra + ids.tobytes()).digest()


def hash_chain(
    root: bytes, tokens: Sequence[int] | np.ndarray, block_size: int, extra: bytes = NO_EXTRA
) -> list[bytes]:
    """Hashes of every full block of ``tokens``, each chained to the previous (the first to ``root``)."""
    out: list[bytes] = []
    parent = root
    ids = np.asarray(tokens, dtype="<i8").tobytes()  # converted once; each block hashes a slice of it
    step = 8 * block_size
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(_BLOCK_DOMAIN + parent + extra + ids[i * step : (i + 1) * step]).digest()
        out.append(parent)
    return out
