"""What every tier does the same way: round trips, consecutive hits, deletes, argument checks, close."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvhal
from kvhal.tiers import BlockKey, DiskTier, HostTier, RedisTier, Tier

from .conftest import NS_B, key, keys, payload


@pytest.fixture(params=["host", "disk", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "host":
        t: Tier = HostTier(1 << 24)
    elif request.param == "disk":
        t = DiskTier(tmp_path / "disk", 1 << 24)
    else:
        t = RedisTier(request.getfixturevalue("redis_server").url)
    yield t
    t.close()


def test_round_trip_and_consecutive_hits(tier: Tier):
    ks = keys(6)
    data = [payload(i, 1000 * (i + 1)) for i in range(6)]
    assert tier.contains(ks) == 0
    assert tier.put([ks[0], ks[1], ks[3]], [data[0], bytearray(data[1]), memoryview(data[3])]) == [True] * 3
    assert tier.contains(ks) == 2  # stops at the first miss (2), though 3 is there
    assert tier.contains(ks[3:]) == 1
    assert tier.contains([]) == 0 and tier.get([]) == [] and tier.put([], []) == []
    got = tier.get(ks)
    assert got == [data[0], data[1], None, data[3], None, None]
    for g in (g for g in got if g is not None):  # bytes, or a read-only view nobody can write through
        assert isinstance(g, bytes) or (isinstance(g, memoryview) and g.readonly and g.format == "B")
    # the same block again: held, not written twice
    assert tier.put([ks[0], ks[2]], [data[0], data[2]]) == [True, True]
    assert tier.contains(ks) == 4
    # the namespace keeps models apart: same block hash, other model
    other = [key(i, NS_B) for i in range(2)]
    assert tier.contains(other) == 0 and tier.get(other) == [None, None]
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.rejected, s.errors, s.corrupt_dropped) == (3, 5, 4, 0, 0, 0)
    assert tier.delete([ks[1], ks[5]]) == 1
    assert tier.contains(ks) == 1 and tier.get([ks[1]]) == [None]
    assert tier.stats().deletes == 1


def test_first_writer_wins_and_no_aliasing(tier: Tier):
    buf = bytearray(payload(1))
    assert tier.put([key(1)], [buf]) == [True]
    buf[0] ^= 0xFF  # the caller reuses its buffer: the stored block must not change
    assert tier.put([key(1)], [bytes(buf)]) == [True]  # a block's bytes never change: the first write stays
    assert tier.get([key(1)]) == [payload(1)]
    assert tier.stats().puts == 1


def test_numpy_block_through_memoryview(tier: Tier):
    block = np.random.default_rng(0).integers(0, 255, (4, 16, 34), dtype=np.uint8)
    assert tier.put([key(1)], [memoryview(block)]) == [True]
    got = tier.get([key(1)])[0]
    assert got is not None and np.array_equal(np.frombuffer(got, np.uint8).reshape(block.shape), block)


def test_bad_arguments_raise_before_anything_changes(tier: Tier):
    k = key(1)
    bad_calls = [
        (tier.contains, (k,), "wrap a single key"),
        (tier.contains, ("abc",), "list of BlockKey"),
        (tier.get, ([k, k.block_hash],), r"keys\[1\] must be a BlockKey"),
        (tier.put, ([k], [payload(1), payload(2)]), "one payload per key"),
        (tier.put, ([k], ["text"]), "bytes, bytearray or memoryview"),
        (tier.put, ([k], payload(1)), "payloads must be a list"),
        (tier.put, ([k], [np.zeros(8, np.uint8)]), "memoryview"),
        (tier.delete, (None,), "list of BlockKey"),
    ]
    for fn, args, match in bad_calls:
        with pytest.raises(kvhal.TierError, match=match):
            fn(*args)
    assert tier.contains([k]) == 0
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.rejected, s.deletes, s.errors) == (0, 0, 0, 0, 0, 0)


def test_closed_tier_says_so(tier: Tier):
    tier.close()
    tier.close()  # idempotent
    for call in (lambda: tier.contains([key(1)]), lambda: tier.get([key(1)]), tier.stats):
        with pytest.raises(kvhal.TierError, match="closed"):
            call()


def test_constructor_arguments(tmp_path: Path):
    for bad in (True, 1.5, "10", 0, -1):
        with pytest.raises(kvhal.TierError, match="max_bytes"):
            HostTier(bad)  # type: ignore[arg-type]
        with pytest.raises(kvhal.TierError, match="max_bytes"):
            DiskTier(tmp_path, bad)  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="path"):
        DiskTier(123, 10)  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="workers"):
        DiskTier(tmp_path, 10, workers=False)
    with pytest.raises(kvhal.TierError, match="commit_s"):
        DiskTier(tmp_path, 1 << 20, commit_s=2**2000)  # beyond float: a TierError, not OverflowError
    # numpy ints are counts, held as plain ints
    for t in (HostTier(np.int64(1 << 20)), DiskTier(tmp_path / "np", np.int64(1 << 20), workers=np.int64(2))):
        assert t.put([key(1)], [payload(1)]) == [True] and t.get([key(1)]) == [payload(1)]
        t.close()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvhal.TierError, match="writable directory"):
        DiskTier(tmp_path / "file" / "sub", 10)
    with pytest.raises(kvhal.TierError, match="writable directory"):
        DiskTier(str(tmp_path / "nul\0"), 10)  # a ValueError inside


def test_import_kvhal_and_tiers_without_redis():
    code = "import sys, kvhal, kvhal.tiers; print('redis' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_pickled_key_finds_its_entry_in_another_process(tmp_path):
    """BlockKey caches its hash, and bytes hash differently per process: unpickling must recompute it."""
    k = BlockKey(b"n" * 32, b"h" * 32)
    (tmp_path / "d.pkl").write_bytes(pickle.dumps({k: 7}))
    code = (
        "import pickle, sys; from kvhal.tiers import BlockKey; "
        "d = pickle.load(open(sys.argv[1], 'rb')); print(d[BlockKey(b'n' * 32, b'h' * 32)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.pkl")], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "7", out.stderr
