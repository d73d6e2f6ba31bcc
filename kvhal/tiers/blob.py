"""The blob: one block as a tier stores it (disk file, Redis value). Layout in docs/design.md ("Tier blobs").

A blob is read back only if every header field matches the key asked for and the payload's sha256 matches:
a foreign (other model or block), torn (short) or corrupt blob decodes to None, never to wrong bytes.
"""

from __future__ import annotations

import hashlib
import struct

from ..errors import TierError
from .keys import BlockKey, Payload, check_payload

MAGIC = b"KVHB"
VERSION = 1
# magic, format version, reserved (0), namespace, block hash, payload length, sha256(payload); little-endian
_HEADER = struct.Struct("<4sHH32s32sQ32s")
HEADER_SIZE = _HEADER.size


def blob_size(payload_len: int) -> int:
    """Bytes a blob of a ``payload_len``-byte block takes (what a byte budget counts)."""
    return HEADER_SIZE + payload_len


def encode_blob(key: BlockKey, payload: Payload) -> bytes:
    if not isinstance(key, BlockKey):
        raise TierError(f"key must be a BlockKey, got {type(key).__name__}")
    data = check_payload(payload)
    header = _HEADER.pack(MAGIC, VERSION, 0, key.namespace, key.block_hash, len(data), hashlib.sha256(data).digest())
    return b"".join((header, data))


def decode_blob(key: BlockKey, blob: Payload) -> bytes | None:
    """The payload of ``blob`` if it is an intact blob of ``key``, else None (foreign, torn, corrupt, other version)."""
    if not isinstance(key, BlockKey):
        raise TierError(f"key must be a BlockKey, got {type(key).__name__}")
    view = check_payload(blob, "blob")
    if len(view) < HEADER_SIZE:
        return None
    magic, version, reserved, namespace, block_hash, length, digest = _HEADER.unpack_from(view)
    if (magic, version, reserved, namespace, block_hash) != (MAGIC, VERSION, 0, key.namespace, key.block_hash):
        return None
    if len(view) != HEADER_SIZE + length:
        return None
    payload = memoryview(view)[HEADER_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    return bytes(payload)
