"""DiskTier on real files: restarts in this and in other processes, kill -9 while writing, files corrupted,
truncated, replaced or deleted behind its back, a dead writer's temp files, I/O errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvhal.tiers import BlockKey, DiskTier, blob_size, encode_blob

from .conftest import NS_B, key, keys, payload, version1_blob

ROOT = Path(__file__).resolve().parents[2]


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kvb"))


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)


def test_restart_keeps_every_block_and_the_lru_order(tmp_path: Path):
    ks = keys(4)
    data = [payload(i, 3000) for i in range(4)]
    with DiskTier(tmp_path, 10 * blob_size(3000)) as t:
        assert t.put(ks, data) == [True] * 4
    now = time.time()
    for i, f in enumerate(block_files_of(tmp_path, ks)):  # written 40, 30, 20, 10 minutes ago
        os.utime(f, (now - 2400 + 600 * i, now - 2400 + 600 * i))
    with DiskTier(tmp_path, 4 * blob_size(3000)) as t:
        assert t.contains(ks) == 4
        s = t.stats()
        assert (s.blocks, s.bytes_stored, s.corrupt_dropped) == (4, 4 * blob_size(3000), 0)
        assert t.get(ks[:1]) == data[:1]  # block 0 read now: its mtime is refreshed (it was over a minute old)
    assert block_files_of(tmp_path, ks)[0].stat().st_mtime > now - 60
    # restart with room for 3: the least recently used (block 1: written before 2 and 3, read never) goes
    with DiskTier(tmp_path, 3 * blob_size(3000)) as t:
        assert [t.contains([k]) for k in ks] == [1, 0, 1, 1]
        assert t.stats().evictions == 1 and len(block_files(tmp_path)) == 3
        assert t.get(ks) == [data[0], None, data[2], data[3]]


def block_files_of(root: Path, ks: list[BlockKey]) -> list[Path]:
    return [root / k.namespace.hex()[:16] / f"{k.block_hash.hex()}.kvb" for k in ks]


def test_blocks_written_by_one_process_are_read_by_another(tmp_path: Path):
    writer = (
        "import sys; from kvhal.tiers import DiskTier; from tests.tiers.conftest import keys, payload\n"
        "t = DiskTier(sys.argv[1], 1 << 26)\n"
        "print(t.put(keys(40), [payload(i, 16384) for i in range(40)]).count(True)); t.close()"
    )
    reader = (
        "import sys, json, hashlib; from kvhal.tiers import DiskTier; from tests.tiers.conftest import keys\n"
        "t = DiskTier(sys.argv[1], 1 << 26)\n"
        "got = t.get(keys(41))\n"
        "print(json.dumps([t.contains(keys(41)), [g and hashlib.sha256(g).hexdigest() for g in got]]))"
    )
    assert run_python(writer, str(tmp_path)).stdout.strip() == "40"
    n, digests = json.loads(run_python(reader, str(tmp_path)).stdout)
    import hashlib

    assert n == 40
    assert digests == [hashlib.sha256(payload(i, 16384)).hexdigest() for i in range(40)] + [None]


def test_kill_9_while_writing_leaves_no_torn_block(tmp_path: Path):
    writer = (
        "import sys; from kvhal.tiers import DiskTier; from tests.tiers.conftest import keys, payload\n"
        "t = DiskTier(sys.argv[1], 1 << 30, workers=4); base = int(sys.argv[2])\n"
        "print('ready', flush=True)\n"
        "for j in range(0, 10**6, 8):\n"
        "    t.put(keys(8, start=base + j), [payload(base + i, 262144) for i in range(j, j + 8)])\n"
    )
    rng = random.Random(0)
    written_bases = []
    for trial in range(6):
        base = trial * 100_000
        child = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), str(base)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        written_bases.append(base)
        temps = list(tmp_path.glob("*/.*.tmp"))
        # every visible block file is whole: it decodes to exactly the bytes its writer meant
        by_hash = {key(b + i).block_hash.hex(): b + i for b in written_bases for i in range(4000)}
        for f in block_files(tmp_path):
            i = by_hash[f.name[:-4]]
            assert f.read_bytes() == encode_blob(key(i), payload(i, 262144)), f
        with DiskTier(tmp_path, 1 << 30) as t:
            assert not list(tmp_path.glob("*/.*.tmp"))  # the dead writer's temp files are gone
            assert t.stats().corrupt_dropped == len(temps)
            present = {by_hash[f.name[:-4]] - base for f in block_files(tmp_path)} - set(range(-base, 0))
            # a batch's blocks land in any order: contains stops at the first one missing
            assert t.contains(keys(4000, start=base)) == min(set(range(4001)) - present)
            assert t.get([key(base + i) for i in sorted(present)]) == [payload(base + i, 262144) for i in sorted(present)]
            assert t.stats().corrupt_dropped == len(temps)


def test_corrupt_truncated_foreign_and_missing_files_are_misses_and_deleted(tmp_path: Path):
    ks = keys(6)
    data = [payload(i, 2000) for i in range(6)]
    t = DiskTier(tmp_path, 1 << 20)
    assert t.put(ks, data) == [True] * 6
    files = dict(zip(ks, block_files_of(tmp_path, ks)))
    assert sorted(files.values()) == block_files(tmp_path)
    raw = bytearray(files[ks[0]].read_bytes())
    raw[-7] ^= 1
    files[ks[0]].write_bytes(raw)  # a flipped payload bit
    files[ks[1]].write_bytes(files[ks[1]].read_bytes()[:-100])  # truncated
    files[ks[2]].write_bytes(encode_blob(key(2, NS_B), data[2]))  # another model's blob under this name
    files[ks[3]].write_bytes(encode_blob(key(77), payload(77, 2000)))  # another block's blob
    files[ks[4]].unlink()  # deleted behind the tier's back
    assert t.contains(ks[4:]) == 0
    assert t.get(ks) == [None] * 5 + [data[5]]
    assert block_files(tmp_path) == [files[ks[5]]]
    s = t.stats()
    assert (s.corrupt_dropped, s.errors, s.hits, s.misses, s.blocks, s.bytes_stored) == (
        4, 0, 1, 5, 1, blob_size(2000))
    assert t.put(ks[:2], data[:2]) == [True, True] and t.get(ks[:2]) == data[:2]  # stored afresh
    # a short file at start is dropped then; a long corrupt one when read
    files[ks[0]].write_bytes(b"KVHB")
    t.close()
    with DiskTier(tmp_path, 1 << 20) as t2:
        assert t2.stats().corrupt_dropped == 1 and t2.contains(ks[:2]) == 0 and t2.contains(ks[1:2]) == 1


def test_a_format_1_blob_is_a_miss_and_deleted(tmp_path: Path):
    ks, data = keys(2), [payload(0, 5000), payload(1, 5000)]
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.put(ks, data) == [True, True]
        old = block_files_of(tmp_path, ks[:1])[0]
        old.write_bytes(version1_blob(ks[0], data[0]))  # the sha256 format a previous release wrote
    with DiskTier(tmp_path, 1 << 20) as t:  # indexed at start like any block file
        assert t.contains(ks) == 2
        assert t.get(ks) == [None, data[1]]
        assert not old.exists() and t.stats().corrupt_dropped == 1 and t.stats().errors == 0
        assert t.put(ks[:1], data[:1]) == [True] and t.get(ks[:1]) == data[:1]  # written afresh, in format 2
        assert old.read_bytes()[4:6] == b"\x02\x00"


@pytest.mark.parametrize("one_sync", [True, False])
def test_both_durability_paths_publish_whole_blobs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_sync: bool):
    """One syncfs per put (Linux), or an fsync per file where the C library has no syncfs: either way every
    block is under its final name afterwards, readable by a fresh tier, and no temp file is left."""
    import kvhal.tiers.disk as disk

    if one_sync and disk._syncfs_fn() is None:
        pytest.skip("no syncfs(2) here: the per-file path is the one this platform runs")
    if not one_sync:
        monkeypatch.setattr(disk, "_syncfs_fn", lambda: None)
    ks, data = keys(40), [payload(i, 9000) for i in range(40)]
    with DiskTier(tmp_path, 1 << 20, workers=4) as t:
        assert t.put(ks[:25], data[:25]) == [True] * 25 and t.put(ks[25:], data[25:]) == [True] * 15
        assert t.stats().puts == 40 and t.stats().errors == 0
    assert block_files(tmp_path) == sorted(block_files_of(tmp_path, ks))
    assert not list(tmp_path.glob("*/.*.tmp"))
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.get(ks) == data


def test_only_a_dead_writers_temp_files_are_removed(tmp_path: Path):
    with DiskTier(tmp_path, 1 << 20) as t:
        t.put([key(1)], [payload(1)])
    ns_dir = tmp_path / key(1).namespace.hex()[:16]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    h = key(5).block_hash.hex()
    dead_tmp = ns_dir / f".{h}.{dead.pid}.00ff.tmp"
    live_tmp = ns_dir / f".{h}.{os.getpid()}.00fe.tmp"
    other = ns_dir / "notes.txt"
    for p in (dead_tmp, live_tmp, other):
        p.write_bytes(b"partial")
    with DiskTier(tmp_path, 1 << 20) as t:
        assert not dead_tmp.exists() and live_tmp.exists() and other.exists()
        assert t.stats().corrupt_dropped == 1 and t.stats().blocks == 1


def test_io_errors_are_false_flags_and_counted(tmp_path: Path):
    with DiskTier(tmp_path, 1 << 20) as t:
        blocker = tmp_path / key(1).namespace.hex()[:16]
        blocker.write_bytes(b"")  # a file where the namespace's directory must go
        assert t.put(keys(2), [payload(0), payload(1)]) == [False, False]
        assert t.contains(keys(2)) == 0 and t.get(keys(1)) == [None]
        s = t.stats()
        assert s.errors >= 2 and s.rejected == 2 and s.blocks == 0 and s.last_error
        blocker.unlink()
        assert t.put(keys(2), [payload(0), payload(1)]) == [True, True]
        assert t.get(keys(2)) == [payload(0), payload(1)]


def test_a_put_at_the_budget_writes_into_the_files_it_evicts(tmp_path: Path):
    """The evicted blocks' files are reused (same inodes, overwritten and cut to size) for the blocks written,
    whatever the sizes; extra evicted files are removed; a block evicted and put again in one call survives."""
    sizes = [5000, 3000, 8000, 4000]
    ks, data = keys(8), [payload(i, sizes[i % 4]) for i in range(8)]
    budget = sum(blob_size(s) for s in sizes)
    with DiskTier(tmp_path, budget, workers=2) as t:
        assert t.put(ks[:4], data[:4]) == [True] * 4
        inodes = {f.stat().st_ino for f in block_files(tmp_path)}
        # 4 and 5 (8000 + 4000 bytes) push out 0, 1 and 2 (16000): two files reused, one removed
        assert t.put(ks[4:6], [payload(4, 8000), payload(5, 4000)]) == [True, True]
        assert {f.stat().st_ino for f in block_files_of(tmp_path, ks[4:6])} <= inodes
        assert block_files(tmp_path) == sorted(block_files_of(tmp_path, ks[3:6]))
        assert t.get(ks[3:6]) == [data[3], payload(4, 8000), payload(5, 4000)]
        # 3 is the oldest now: a call that pushes it out and then stores it again keeps it, written afresh
        assert t.put([ks[6], ks[3]], [payload(6, 3000), data[3]]) == [True, True]
        assert t.get([ks[6], ks[3]]) == [payload(6, 3000), data[3]]
        s = t.stats()
        assert s.bytes_stored == sum(f.stat().st_size for f in block_files(tmp_path)) <= budget
        assert not list(tmp_path.glob("*/.*.tmp")) and s.errors == 0
    with DiskTier(tmp_path, budget) as t:  # what a restart finds is whole
        found = [k for k in ks if t.contains([k])]
        want = {3: data[3], 4: payload(4, 8000), 5: payload(5, 4000), 6: payload(6, 3000)}
        assert t.get(found) == [want[ks.index(k)] for k in found]
        assert t.stats().corrupt_dropped == 0


def test_a_block_another_process_wrote_counts_against_the_budget_within_a_put(tmp_path: Path):
    """Indexing a block found on disk mid-put may push out a block the same call was about to write: that one
    is then not written (a false flag), so the files never exceed the budget."""
    ks, data = keys(2), [payload(0, 3000), payload(1, 3000)]
    with DiskTier(tmp_path, blob_size(3000)) as t:
        with DiskTier(tmp_path, 1 << 20) as other:  # block 1 written after t indexed the directory
            assert other.put(ks[1:], data[1:]) == [True]
        assert t.put(ks, data) == [False, True]  # 0 pending, then 1 found on disk and indexed: 0 is pushed out
        s = t.stats()
        assert s.bytes_stored == sum(f.stat().st_size for f in block_files(tmp_path)) == blob_size(3000)
        assert t.get(ks) == [None, data[1]]
