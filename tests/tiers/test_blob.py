"""The blob format against the layout docs/design.md gives, built here by hand."""

from __future__ import annotations

import binascii
import hashlib
import struct

import numpy as np
import pytest

import kvhal
from kvhal.tiers import HEADER_SIZE, BlockKey, blob_size, decode_blob, encode_blob
from kvhal.tiers.blob import payload_view

from .conftest import NS, NS_B, key, payload, version1_blob


def documented_blob(ns: bytes, block_hash: bytes, data: bytes, version: int = 2) -> bytes:
    # magic "KVHB", u16 version, u16 reserved 0, namespace[32], block_hash[32], u64 length, u32 crc32(payload),
    # u32 reserved 0
    header = b"KVHB" + struct.pack("<HH", version, 0) + ns + block_hash + struct.pack("<Q", len(data))
    return header + struct.pack("<II", binascii.crc32(data), 0) + data


def test_layout_matches_the_documented_one():
    k, data = key(1), payload(1, 1000)
    assert encode_blob(k, data) == documented_blob(k.namespace, k.block_hash, data)
    assert HEADER_SIZE == 88
    assert decode_blob(k, documented_blob(k.namespace, k.block_hash, data)) == data


@pytest.mark.parametrize("size", [0, 1, 4096, 65536])
def test_round_trip_from_any_buffer(size: int):
    k, data = key(2), payload(2, size)
    for buf in (data, bytearray(data), memoryview(data), memoryview(np.frombuffer(data, np.uint8))):
        blob = encode_blob(k, buf)
        assert decode_blob(k, blob) == data
        assert decode_blob(k, bytearray(blob)) == data
    f16 = np.arange(64, dtype=np.float16)
    assert decode_blob(k, encode_blob(k, memoryview(f16))) == f16.tobytes()


def test_every_mismatch_is_none():
    k, data = key(3), payload(3, 512)
    blob = encode_blob(k, data)
    assert decode_blob(key(4), blob) is None  # other block
    assert decode_blob(BlockKey(NS_B, k.block_hash), blob) is None  # other model
    assert decode_blob(k, documented_blob(NS, k.block_hash, data, version=3)) is None
    assert decode_blob(k, version1_blob(k, data)) is None  # format 1 (sha256): a miss
    assert decode_blob(k, documented_blob(NS, k.block_hash, data, version=1)) is None
    assert decode_blob(k, b"XXXX" + blob[4:]) is None
    assert decode_blob(k, blob[:6] + b"\x01\x00" + blob[8:]) is None  # reserved field
    assert decode_blob(k, blob[:84] + b"\x01\x00\x00\x00" + blob[88:]) is None  # second reserved field
    for cut in (0, 50, HEADER_SIZE, len(blob) - 1):
        assert decode_blob(k, blob[:cut]) is None, cut
    assert decode_blob(k, blob + b"\x00") is None
    for pos in (80, 83, HEADER_SIZE, len(blob) - 1):  # checksum bytes, payload bytes
        flipped = bytearray(blob)
        flipped[pos] ^= 0x40
        assert decode_blob(k, flipped) is None, pos


def test_bad_arguments_are_tier_errors():
    k = key(1)
    for bad in ("text", 5, np.zeros(4, np.uint8), [1, 2]):
        with pytest.raises(kvhal.TierError, match="bytes, bytearray or memoryview"):
            encode_blob(k, bad)  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="C-contiguous"):
        encode_blob(k, memoryview(np.zeros((4, 4), np.uint8)[:, ::2]))
    with pytest.raises(kvhal.TierError, match="BlockKey"):
        encode_blob(b"k" * 32, b"x")  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="BlockKey"):
        decode_blob("k", b"x")  # type: ignore[arg-type]
    for bad in (True, -1, 1.0, "1"):
        with pytest.raises(kvhal.TierError, match="payload_len"):
            blob_size(bad)  # type: ignore[arg-type]
    assert blob_size(np.int64(5)) == HEADER_SIZE + 5 and type(blob_size(np.int64(5))) is int


def test_block_key_validation():
    h = hashlib.sha256(b"x").digest()
    BlockKey(NS, h)
    with pytest.raises(kvhal.TierError, match="32 bytes"):
        BlockKey(NS[:16], h)
    with pytest.raises(kvhal.TierError, match="must be bytes"):
        BlockKey(NS.hex(), h)  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="must be bytes"):
        BlockKey(NS, bytearray(h))  # type: ignore[arg-type]
    assert isinstance(kvhal.TierError("x"), kvhal.KVHalError)
    assert BlockKey(NS, h) == BlockKey(bytes(NS), bytes(h)) and len({BlockKey(NS, h), BlockKey(NS, h)}) == 1


def test_payload_view_is_the_payload_in_place():
    k, data = key(5), payload(5, 3000)
    blob = bytearray(encode_blob(k, data))
    view = payload_view(k, blob)
    assert view is not None and view == data and view.readonly and view.nbytes == 3000
    blob[HEADER_SIZE] ^= 0xFF  # the view reads the blob's own bytes: nothing was copied
    assert view[0] == blob[HEADER_SIZE] != data[0]
    assert payload_view(k, bytes(blob)) is None and payload_view(key(6), encode_blob(k, data)) is None
