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


def blob_header(key: BlockKey, payload: bytes | memoryview) -> bytes:
    """The header of ``payload``'s blob (a writer may send it and the payload without joining them)."""
    return _HEADER.pack(
        MAGIC, VERSION, 0, key.namespace, key.block_hash, len(payload), hashlib.sha256(payload).digest()
    )


def payload_length(key: BlockKey, header: bytes | memoryview) -> int | None:
    """The payload length ``header`` announces if it is a current-version header of ``key``'s blob, else None."""
    if len(header) < HEADER_SIZE:
        return None
    magic, version, reserved, namespace, block_hash, length, _ = _HEADER.unpack_from(header)
    if (magic, version, reserved, namespace, block_hash) != (MAGIC, VERSION, 0, key.namespace, key.block_hash):
        return None
    return int(length)


def payload_matches(header: bytes | memoryview, payload: bytes | memoryview) -> bool:
    """Whether ``payload`` is whole and intact: the length and sha256 ``header`` (already checked) records."""
    _, _, _, _, _, length, digest = _HEADER.unpack_from(header)
    return len(payload) == length and hashlib.sha256(payload).digest() == digest


def encode_blob(key: BlockKey, payload: Payload) -> bytes:
    _check_key(key)
    data = check_payload(payload)
    return b"".join((blob_header(key, data), data))


def decode_blob(key: BlockKey, blob: Payload) -> bytes | None:
    """The payload of ``blob`` if it is an intact blob of ``key``, else None (foreign, torn, corrupt, other version)."""
    _check_key(key)
    view = memoryview(check_payload(blob, "blob"))
    if payload_length(key, view) is None or not payload_matches(view, view[HEADER_SIZE:]):
        return None
    return bytes(view[HEADER_SIZE:])


def _check_key(key: object) -> None:
    if not isinstance(key, BlockKey):
        raise TierError(f"key must be a BlockKey, got {type(key).__name__}")
