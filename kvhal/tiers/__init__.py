"""Block tiers behind the prefix cache: host RAM, local disk, Redis/Valkey.

Each stores whole blocks by ``BlockKey(namespace, block_hash)`` behind one small interface (``Tier``):
``contains`` (consecutive hits from the first key), ``get``, ``put``, ``delete``, ``stats``, ``close``.
Not thread-safe: one tier object per thread. ``redis`` is imported only when a RedisTier is made.
"""

from __future__ import annotations

from .base import Tier, TierStats
from .blob import HEADER_SIZE, blob_size, decode_blob, encode_blob
from .disk import DiskTier
from .host import HostTier
from .keys import BlockKey
from .redis_tier import RedisTier

__all__ = [
    "HEADER_SIZE",
    "BlockKey",
    "DiskTier",
    "HostTier",
    "RedisTier",
    "Tier",
    "TierStats",
    "blob_size",
    "decode_blob",
    "encode_blob",
]
