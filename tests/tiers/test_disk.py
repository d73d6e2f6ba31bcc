"""DiskTier on real segment files: restarts in this and other processes, kill -9 while appending and compacting
(a hundred times), segments torn, corrupted or grown behind its back, the old one-file-per-block layout, a dead
writer's temp files, durability modes, the budget."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvhal
from kvhal.tiers import DiskTier, blob_size, encode_blob
from kvhal.tiers.segments import RECORD_HEADER, parse_header

from .conftest import NS_B, key, keys, payload

ROOT = Path(__file__).resolve().parents[2]


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("seg-*.kvs"))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in segments(root))


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)


def test_record_layout_and_restart_keeps_blocks_and_deletes(tmp_path: Path):
    ks, data = keys(5), [payload(i, 3000) for i in range(5)]
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.put(ks, data) == [True] * 5
        assert t.delete(ks[1:2]) == 1 and t.delete(ks[1:2]) == 0
        s = t.stats()
        # 5 records of blob_size bytes and one tombstone (a header alone), in one segment file
        assert (s.blocks, s.bytes_stored) == (4, 5 * blob_size(3000) + RECORD_HEADER) == (4, disk_bytes(tmp_path))
    [seg] = segments(tmp_path)
    raw = seg.read_bytes()
    kind, k0, n, _ = parse_header(raw[:RECORD_HEADER])  # type: ignore[misc]
    assert raw[:4] == b"KVSR" and (kind, k0, n) == (1, ks[0], 3000) and raw[RECORD_HEADER:][:3000] == data[0]
    with DiskTier(tmp_path, 1 << 20) as t:  # the tombstone keeps block 1 deleted
        assert [t.contains([k]) for k in ks] == [1, 0, 1, 1, 1]
        assert t.get(ks) == [data[0], None, *data[2:]]
    # restarted with a smaller budget: oldest segments go whole until the files fit
    with DiskTier(tmp_path, 1 << 20, segment_bytes=1) as t:  # one segment per put call
        for i in range(5, 9):
            t.put([key(i)], [payload(i, 3000)])
    with DiskTier(tmp_path, 3 * blob_size(3000)) as t:
        assert t.stats().evictions == 5 and disk_bytes(tmp_path) <= 3 * blob_size(3000)
        assert t.get(keys(3, start=6)) == [payload(i, 3000) for i in range(6, 9)]


def test_whole_segment_eviction_gives_used_blocks_a_second_chance(tmp_path: Path):
    one = blob_size(1000)
    with DiskTier(tmp_path, 4 * one, segment_bytes=2 * one) as t:
        ks = keys(8)
        data = [payload(i, 1000) for i in range(8)]
        assert t.put(ks[:4], data[:4]) == [True] * 4  # segments [0 1] [2 3]
        assert t.get(ks[1:2]) == data[1:2]  # 1 used since written
        assert t.put(ks[4:5], data[4:5]) == [True]  # reclaims [0 1]: 1 copied, 0 evicted
        assert [t.contains([k]) for k in ks[:5]] == [0, 1, 1, 1, 1]
        s = t.stats()
        assert s.evictions == 1 and s.bytes_stored == disk_bytes(tmp_path) == 4 * one
        assert t.put(ks[5:7], data[5:7]) == [True, True]  # 1's second chance is spent: cold blocks go first
        assert disk_bytes(tmp_path) <= 4 * one and t.get(ks[5:7]) == data[5:7]
        assert t.put([key(99)], [payload(99, 4 * one)]) == [False]  # larger than the budget: refused
        for i in range(40):  # the budget holds through many reclaims
            t.put([key(100 + i)], [payload(100 + i, 700 + 37 * i)])
            t.get([key(100 + i // 2)])
            assert t.stats().bytes_stored == disk_bytes(tmp_path) <= 4 * one
        present = [key(100 + i) for i in range(40) if t.contains([key(100 + i)])]
        assert present and t.get(present) == [payload(100 + int(i), 700 + 37 * int(i))
                                               for i in [next(j for j in range(40) if key(100 + j) == k) for k in present]]


def test_blocks_written_by_one_process_are_read_by_another(tmp_path: Path):
    writer = (
        "import sys; from kvhal.tiers import DiskTier; from tests.tiers.conftest import keys, payload\n"
        "t = DiskTier(sys.argv[1], 1 << 26)\n"
        "print(t.put(keys(40), [payload(i, 16384) for i in range(40)]).count(True))\n"
        "import os; os._exit(0)  # no close: what a put wrote is in the segment"
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


def test_one_tier_per_directory(tmp_path: Path):
    with DiskTier(tmp_path, 1 << 20):
        with pytest.raises(kvhal.TierError, match="in use by another DiskTier"):
            DiskTier(tmp_path, 1 << 20)
    DiskTier(tmp_path, 1 << 20).close()  # released at close
    t = DiskTier(tmp_path, 1 << 20)
    t.put([key(1)], [payload(1)])
    del t  # dropped without close: collected (its commit thread holds it weakly), the directory released
    import gc

    gc.collect()
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.get([key(1)]) == [payload(1)]


def test_torn_tail_corrupt_and_foreign_records(tmp_path: Path):
    ks, data = keys(6), [payload(i, 2000) for i in range(6)]
    with DiskTier(tmp_path, 1 << 20, segment_bytes=3 * blob_size(2000)) as t:
        assert t.put(ks[:3], data[:3]) == [True] * 3
        assert t.put(ks[3:], data[3:]) == [True] * 3
    first, last = segments(tmp_path)
    raw = bytearray(first.read_bytes())
    raw[RECORD_HEADER + 5] ^= 1  # block 0's payload: a bit flipped (found on read)
    first.write_bytes(raw)
    tail = last.read_bytes()
    last.write_bytes(tail[:-700])  # block 5 torn: cut at start, never returned
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.stats().corrupt_dropped == 1 and disk_bytes(tmp_path) == t.stats().bytes_stored
        assert last.stat().st_size == 2 * blob_size(2000)
        assert t.contains(ks[3:]) == 2
        assert t.get(ks) == [None, *data[1:5], None]
        assert t.stats().corrupt_dropped == 2 and t.contains(ks[:1]) == 0
        assert t.put(ks[::5], [data[0], data[5]]) == [True, True] and t.get(ks[::5]) == [data[0], data[5]]
    with open(last, "ab") as f:  # garbage appended behind the tier's back, and a foreign model's record
        f.write(os.urandom(500))
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.get(ks[1:]) == data[1:] and t.get([key(1, NS_B)]) == [None]
        assert t.stats().corrupt_dropped == 1


def test_the_old_one_file_per_block_layout_is_migrated(tmp_path: Path):
    ks, data = keys(3), [payload(i, 5000) for i in range(3)]
    ns_dir = tmp_path / ks[0].namespace.hex()[:16]
    ns_dir.mkdir()
    for k, d in zip(ks, data):
        (ns_dir / f"{k.block_hash.hex()}.kvb").write_bytes(encode_blob(k, d))
    bad = ns_dir / f"{key(7).block_hash.hex()}.kvb"
    bad.write_bytes(encode_blob(key(7), payload(7, 100))[:-3])  # a torn blob of the old layout
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ns_dir / f".{key(8).block_hash.hex()}.{dead.pid}.00ff.tmp").write_bytes(b"partial")
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.get(ks) == data and t.get([key(7)]) == [None]
        assert t.stats().corrupt_dropped == 2
    assert not ns_dir.exists() and len(segments(tmp_path)) == 1


def test_a_migration_that_cannot_append_keeps_the_old_files(tmp_path: Path):
    """The old layout's blocks are migrated into segments that cannot grow (a file size limit: EFBIG, as a full
    disk): the errors are counted and every old file stays, so the next start migrates them."""
    ks, data = keys(3), [payload(i, 5000) for i in range(3)]
    ns_dir = tmp_path / ks[0].namespace.hex()[:16]
    ns_dir.mkdir()
    for k, d in zip(ks, data):
        (ns_dir / f"{k.block_hash.hex()}.kvb").write_bytes(encode_blob(k, d))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # (Python ignores SIGXFSZ: a write fails with EFBIG)
    try:
        with DiskTier(tmp_path, 1 << 20) as t:
            assert t.stats().errors >= 1 and t.get(ks) == [None] * 3
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert len(list(ns_dir.iterdir())) == 3
    with DiskTier(tmp_path, 1 << 20) as t:  # room again: migrated, and the old files go
        assert t.get(ks) == data
    assert not ns_dir.exists()


def test_only_a_dead_writers_temp_files_are_removed(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_tmp = tmp_path / f".seg-{7:016x}.{dead.pid}.tmp"
    no_pid = tmp_path / f".seg-{9:016x}.{2**80}.tmp"  # no process has that id (an OverflowError for os.kill)
    live_tmp = tmp_path / f".seg-{8:016x}.{os.getpid()}.tmp"
    other = tmp_path / "notes.txt"
    for p in (dead_tmp, no_pid, live_tmp, other):
        p.write_bytes(b"partial")
    with DiskTier(tmp_path, 1 << 20) as t:
        assert not dead_tmp.exists() and not no_pid.exists() and live_tmp.exists() and other.exists()
        assert t.stats().corrupt_dropped == 2 and t.stats().blocks == 0


def test_a_smaller_budget_at_start_with_segments_that_cannot_be_removed(tmp_path: Path):
    """Restarted with a smaller budget in a directory whose segments cannot be unlinked (append-only, chattr +a):
    an error counted and the tier open, not an endless loop over the same segment."""
    with DiskTier(tmp_path, 1 << 20, segment_bytes=1) as t:  # one segment per put
        for i in range(4):
            t.put([key(i)], [payload(i, 3000)])
    code = (
        "import os, sys\n"
        "from kvhal.tiers import DiskTier\n"
        "from tests.tiers.conftest import key, payload\n"
        "def refuse(path, *args, **kwargs):\n"
        "    raise PermissionError(1, 'Operation not permitted', path)\n"
        "os.unlink = refuse\n"
        "t = DiskTier(sys.argv[1], 2 * 3100)\n"
        "print(t.stats().errors, t.put([key(9)], [payload(9, 3000)]) == [False], t.get([key(3)]) == [payload(3, 3000)])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr[-2000:]
    errors, put_refused, still_read = res.stdout.split()
    assert int(errors) >= 1 and put_refused == still_read == "True"


def test_a_forked_child_cannot_use_its_parents_tier(tmp_path: Path):
    """A forked child inherits the tier and its LOCK: its appends would move the segment's end under the parent's
    index (the parent's later blocks then read back as corrupt). Every call in the child is a TierError."""
    t = DiskTier(tmp_path, 1 << 20, durable=True)
    t.put([key(0)], [payload(0)])
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only
        code = 3
        try:
            for call in (lambda: t.put([key(1)], [payload(1)]), lambda: t.get([key(0)]), t.flush, t.stats):
                try:
                    call()
                    code = 1
                except kvhal.TierError as e:
                    code = code if "fork" in str(e) else 2
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3
    assert t.put(keys(2, start=2), [payload(2), payload(3)]) == [True, True]
    assert t.get(keys(4)) == [payload(0), None, payload(2), payload(3)] and t.stats().corrupt_dropped == 0
    t.close()


def test_a_segment_that_could_not_be_opened_for_reading_does_not_block_later_puts(tmp_path: Path, monkeypatch):
    """One failed open of a new segment's read descriptor (EMFILE) is one refused put: the segment's name was
    taken, so every later put had met EEXIST on it (and a write descriptor leaked)."""
    import errno

    from kvhal.tiers import disk

    real, failures = disk.open_segment, [OSError(errno.EMFILE, "Too many open files")]

    def flaky(path: str, flags: int = os.O_RDONLY) -> int:
        if failures:
            raise failures.pop()
        return real(path, flags)

    with DiskTier(tmp_path, 1 << 20, segment_bytes=1) as t:  # one segment per put
        monkeypatch.setattr(disk, "open_segment", flaky)
        assert t.put([key(1)], [payload(1)]) == [False] and t.stats().errors == 1
        assert t.put(keys(2, start=2), [payload(2), payload(3)]) == [True, True]
        assert t.put([key(4)], [payload(4)]) == [True] and t.stats().errors == 1
    with DiskTier(tmp_path, 1 << 20) as t:
        assert t.get(keys(5)) == [None, None, payload(2), payload(3), payload(4)]


def test_durability_modes(tmp_path: Path):
    with pytest.raises(kvhal.TierError, match="durable"):
        DiskTier(tmp_path, 1 << 20, durable=1)  # type: ignore[arg-type]
    for bad in ({"commit_bytes": 0}, {"commit_s": 0}, {"segment_bytes": 1.5}):
        with pytest.raises(kvhal.TierError):
            DiskTier(tmp_path, 1 << 20, **bad)  # type: ignore[arg-type]
    with DiskTier(tmp_path / "a", 1 << 20, durable=True) as t:
        t.put([key(1)], [payload(1)])
        assert t._unsynced == 0  # fsynced before put returned
    with DiskTier(tmp_path / "b", 1 << 20, durable=False) as t:
        t.put([key(1)], [payload(1)])
        assert t._unsynced > 0
        with pytest.raises(kvhal.TierError, match="durable"):
            t.put([key(2)], [payload(2)], durable="yes")  # type: ignore[arg-type]
        assert t.stats().puts == 1  # the bad call changed nothing
        t.put([key(2)], [payload(2)], durable=True)
        assert t._unsynced == 0
    with DiskTier(tmp_path / "c", 1 << 20, commit_s=0.05) as t:  # group commit: bounded by time
        for i in (1, 2):  # the flusher sleeps between batches and wakes for the next
            t.put([key(i)], [payload(i)])
            assert t._unsynced > 0
            deadline = time.monotonic() + 5
            while t._unsynced and time.monotonic() < deadline:
                time.sleep(0.01)
            assert t._unsynced == 0
            time.sleep(0.12)
    with DiskTier(tmp_path / "d", 1 << 20, commit_bytes=3 * blob_size(4096)) as t:  # and by bytes
        t.put(keys(2), [payload(0), payload(1)])
        assert t._unsynced == 2 * blob_size(4096)
        t.put(keys(1, start=5), [payload(5)])
        assert t._unsynced == 0


def test_a_call_that_waited_for_the_lock_while_another_thread_closed_the_tier_says_so(tmp_path: Path):
    """A call past its open check, waiting for the tier's lock while another thread closes it, must not write to
    (or read from) descriptors close() has just released: a TierError, nothing written, no error counted."""
    calls = {
        "put": lambda t: t.put([key(2)], [payload(2)]),
        "get": lambda t: t.get([key(1)]),
        "delete": lambda t: t.delete([key(1)]),
    }
    for name, call in calls.items():
        t = DiskTier(tmp_path / name, 1 << 20, durable=True)
        t.put([key(1)], [payload(1)])
        got: list[object] = []
        t._mu = gate = _Gate(t._mu)
        gate.lock.acquire()  # holds the call at the lock, after its open check
        th = threading.Thread(target=_outcome, args=(call, t, got))
        th.start()
        assert gate.reached.wait(60)  # (a sleep instead: on a loaded machine the call could be closed before it)
        t.close()  # (the lock is reentrant: this thread closes while the other waits)
        gate.lock.release()
        th.join()
        assert got and isinstance(got[0], kvhal.TierError) and "closed" in str(got[0]), (name, got)
        assert t._stats.errors == 0, t._stats.last_error
        with DiskTier(tmp_path / name, 1 << 20) as again:
            assert again.get(keys(3)) == [None, payload(1), None]


class _Gate:
    """A tier's lock that says when a thread other than the test's has reached it (past its open check)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.reached, self.main = lock, threading.Event(), threading.get_ident()

    def __enter__(self) -> None:
        if threading.get_ident() != self.main:
            self.reached.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _outcome(call: Callable[[DiskTier], object], t: DiskTier, out: list[object]) -> None:
    try:
        out.append(call(t))
    except Exception as e:
        out.append(e)


# A zygote process imports kvhal once, then forks a writer per trial and kills it with SIGKILL at a random
# moment: appends with durable puts (big budget: nothing evicted, every acknowledged block must be found) or
# appends, reads and compactions at a small budget. After each kill it reopens the directory and checks.
KILL_TRIALS = r"""
import json, os, random, signal, sys, time
from kvhal.tiers import DiskTier
from tests.tiers.conftest import key, payload
root, trials = sys.argv[1], int(sys.argv[2])
rng = random.Random(5)
SIZES = [3000, 9000, 20000]
def size(i): return SIZES[i % 3]
def on_disk(d):
    n = 0
    for f in os.listdir(d):
        try:
            n += os.path.getsize(os.path.join(d, f)) if f != "LOCK" else 0
        except FileNotFoundError:  # removed by the writer meanwhile
            pass
    return n
known = {}
out = {"trials": 0, "checked": 0, "committed": 0, "max_bytes_seen": 0, "bad": []}
for trial in range(trials):
    d = os.path.join(root, str(trial % 10))
    small = trial % 2 == 1
    budget = 12 * 9000 if small else 1 << 26
    os.makedirs(d, exist_ok=True)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t = DiskTier(d, budget, workers=2, segment_bytes=3 * 9000, commit_s=0.002)
        base = trial * 10000
        for j in range(0, 10000, 3):
            ks = [key(base + j + n) for n in range(3)]
            t.put(ks, [payload(base + j + n, size(base + j + n)) for n in range(3)], durable=not small)
            os.write(w, f"{base + j + 2}\n".encode())
            if small:
                t.get([key(base + max(0, j - rng.randrange(1, 12)))])  # recent blocks: hot in compaction
        os._exit(0)
    os.close(w)
    time.sleep(rng.uniform(0.02, 0.25) if small else rng.uniform(0.0, 0.08))
    out["max_bytes_seen"] = max(out["max_bytes_seen"], on_disk(d) / budget)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    acked = os.read(r, 1 << 20).decode().split()
    os.close(r)
    if on_disk(d) > budget:
        out["bad"].append(f"trial {trial}: {on_disk(d)} bytes over the budget {budget}")
    last = int(acked[-1]) if acked else trial * 10000 - 1
    for i in range(trial * 10000, last + 4):  # acknowledged, or in the put call in flight at the kill
        known[key(i)] = i
    with DiskTier(d, budget) as t:
        for k in list(t._index):  # every block the restarted tier reports present
            i = known.get(k)
            if i is None:
                out["bad"].append(f"trial {trial}: a block never written is present")
                continue
            g = t.get([k])[0]
            out["checked"] += g is not None
            if g is not None and g != payload(i, size(i)):
                out["bad"].append(f"trial {trial}: block {i} read back other bytes")
        if not small:
            for i in range(trial * 10000, last + 1):
                out["committed"] += 1
                if t.get([key(i)]) != [payload(i, size(i))]:
                    out["bad"].append(f"trial {trial}: committed block {i} lost")
        if t.stats().bytes_stored > budget or any(f.endswith(".tmp") for f in os.listdir(d)):
            out["bad"].append(f"trial {trial}: budget or temp files")
    out["trials"] += 1
print(json.dumps(out))
"""


@pytest.mark.parametrize("durable", [False, None])
def test_flush_makes_sealed_segments_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool | None):
    """flush() fsyncs every segment written since the last commit, the sealed ones too (a no-fsync tier closed
    them unsynced and never synced them)."""
    synced: set[int] = set()
    real = os.fsync

    def spy(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real(fd)

    with DiskTier(tmp_path, 1 << 20, durable=durable, segment_bytes=1, commit_s=1000) as t:  # a segment per put
        monkeypatch.setattr(os, "fsync", spy)
        for i in range(3):
            t.put([key(i)], [payload(i)])
        t.flush()
        assert len(segments(tmp_path)) == 3
        assert {p.stat().st_ino for p in segments(tmp_path)} <= synced
        assert t._unsynced == 0


def test_kill_9_during_appends_and_compaction(tmp_path: Path):
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", KILL_TRIALS, str(tmp_path), "100"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["bad"] == [] and out["trials"] == 100
    assert out["checked"] > 100 and out["committed"] > 0 and out["max_bytes_seen"] <= 1
    assert time.monotonic() - t0 < 90
