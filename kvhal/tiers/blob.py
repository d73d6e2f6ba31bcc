"""The blob: one block as a tier stores it (disk file, Redis value). Layout in docs/design.md ("Tier blobs").

A blob is read back only if every header field matches the key asked for and the payload's CRC-32 matches:
a foreign (other model or block), torn (short), corrupt or older-version blob decodes to None, never to wrong
bytes. CRC-32 (zlib-ng's where installed, ``pip install 'kvhal[tiers]'``: tens of GB/s with carry-less multiply;
else zlib's, a few GB/s; the same checksum either way) is an integrity check against torn writes and
bit rot, not against an adversary: the blob sits in the tier's own directory or server, and the exact header
fields already keep other blocks' and other models' blobs out. It runs at about 2.5x sha256's speed (format 1).
"""

from __future__ import annotations

import importlib
import struct
import zlib
from collections.abc import Callable

from ..errors import TierError
from .keys import BlockKey, Payload, check_count, check_payload

# CRC-32 (zlib's polynomial) of ``data``, continuing from ``value``: zlib-ng's (SIMD, an order of magnitude
# faster) where installed, else zlib's, the same checksum. Bound directly, not wrapped: a wrapper's call costs
# as much as checksumming a few KiB, paid per record on the disk tier's put and get.
crc32: Callable[..., int]  # (data: bytes | memoryview, value: int = 0) -> int
try:
    crc32 = importlib.import_module("zlib_ng.zlib_ng").crc32
except ImportError:  # pragma: no cover - depends on the environment
    crc32 = zlib.crc32


MAGIC = b"KVHB"
VERSION = 2  # 1: sha256 of the payload (112-byte header); its blobs are misses now, deleted where found
# magic, format version, reserved (0), namespace, block hash, payload length, crc32(payload), reserved (0);
# little-endian
_HEADER = struct.Struct("<4sHH32s32sQII")
HEADER_SIZE = _HEADER.size


def blob_size(payload_len: int) -> int:
    """Bytes a blob of a ``payload_len``-byte block takes (what a byte budget counts)."""
    return HEADER_SIZE + check_count("payload_len", payload_len, minimum=0)  # a byte count: not True, -1 or 1.0


def blob_header(key: BlockKey, payload: bytes | memoryview) -> bytes:
    """The header of ``payload``'s blob (a writer may send it and the payload without joining them)."""
    return _HEADER.pack(MAGIC, VERSION, 0, key.namespace, key.block_hash, len(payload), crc32(payload), 0)


def payload_length(key: BlockKey, header: bytes | memoryview) -> int | None:
    """The payload length ``header`` announces if it is a current-version header of ``key``'s blob, else None."""
    if len(header) < HEADER_SIZE:
        return None
    magic, version, reserved, namespace, block_hash, length, _, reserved2 = _HEADER.unpack_from(header)
    if (magic, version, reserved, namespace, block_hash, reserved2) != (
        MAGIC,
        VERSION,
        0,
        key.namespace,
        key.block_hash,
        0,
    ):
        return None
    return int(length)


def payload_matches(header: bytes | memoryview, payload: bytes | memoryview) -> bool:
    """Whether ``payload`` is whole and intact: the length and CRC-32 ``header`` (already checked) records."""
    length, crc = _HEADER.unpack_from(header)[5:7]
    return len(payload) == length and crc32(payload) == crc


def encode_blob(key: BlockKey, payload: Payload) -> bytes:
    """``key``'s blob of ``payload``: header and payload in one join (the payload copied once)."""
    _check_key(key)
    data = check_payload(payload)
    return b"".join((blob_header(key, data), data))


def decode_blob(key: BlockKey, blob: Payload) -> bytes | None:
    """The payload of ``blob`` if it is an intact blob of ``key``, else None (foreign, torn, corrupt, other version).
    The checksum runs over a view; the payload is copied once, out of the blob."""
    _check_key(key)
    view = payload_view(key, check_payload(blob, "blob"))
    return None if view is None else bytes(view)


def payload_view(key: BlockKey, blob: bytes | memoryview) -> memoryview | None:
    """``decode_blob`` without the copy: a read-only view of the payload inside ``blob`` (which it keeps alive)."""
    view = memoryview(blob).toreadonly()
    if payload_length(key, view) is None or not payload_matches(view, view[HEADER_SIZE:]):
        return None
    return view[HEADER_SIZE:]


def _check_key(key: object) -> None:
    if not isinstance(key, BlockKey):
        raise TierError(f"key must be a BlockKey, got {type(key).__name__}")
