"""Snapshots on real files and real processes: round trips, restarts, kill -9 during save, bad files."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvhal
from tests.unit.test_prefix_cache import BS, SPEC, kv_for, make, prefill

ROOT = Path(__file__).resolve().parents[2]


def state(c: kvhal.KVCache) -> tuple:
    pools = [x.copy() for x in c.pools.k + c.pools.v]
    seqs = {s: (list(c.seq_table.get(s).blocks), list(c.seq_table.get(s).lens), c.tokens(s)) for s in c.seqs}
    return pools, c.stats(), seqs, {h: list(b) for h, b in c.seq_table.allocator.block_of.items()}


def assert_unchanged(before: tuple, c: kvhal.KVCache) -> None:
    after = state(c)
    for x, y in zip(before[0], after[0]):
        np.testing.assert_array_equal(x, y)
    assert before[1:] == after[1:]


def test_save_restore_round_trip_shares_blocks_and_is_matchable(tmp_path):
    c = make()
    tokens = list(range(20, 34))
    a = prefill(c, tokens)
    b = c.seq_cp(a, 0, 9)  # shares blocks 0..2 with a
    c.append_tokens(b, [])  # nothing new
    path = tmp_path / "snap.kvs"
    c.save(path, seqs=[a, b])
    d = make()
    other = prefill(d, [1, 2, 3])  # restore goes into whatever blocks are free
    ra, rb = d.restore(path)
    assert d.seqs == [other, ra, rb]
    for layer in (0, 1):
        for x, y in zip(d.load(ra, layer), c.load(a, layer)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(d.load(rb, layer)[1], c.load(b, layer)[1])
    assert d.seq_table.get(rb).blocks == d.seq_table.get(ra).blocks[:3]  # still shared, stored once
    assert d.stats().blocks_used == 1 + 4 and d.stats().blocks_shared == 3
    t, n = d.match_prefix(tokens + [0])
    assert n == 12 and d.seq_table.get(t).blocks == d.seq_table.get(ra).blocks[:3]
    q = np.random.default_rng(1).standard_normal((2, 4, 32), dtype=np.float32)
    np.testing.assert_array_equal(
        kvhal.to_numpy(d.attention(1, q, [ra], [2])), kvhal.to_numpy(c.attention(1, q, [a], [2]))
    )


RESTART_CHILD = """
import sys, json, numpy as np, kvhal
sys.path.insert(0, {root!r})
from tests.unit.test_prefix_cache import make, prefill, kv_for
c = make()
if sys.argv[1] == "save":
    s = prefill(c, list(range(1000, 1000 + 2 * 16 + 3)))
    c.save(sys.argv[2], seqs=[s])
    q = np.random.default_rng(7).standard_normal((1, 4, 32), dtype=np.float32)
    np.save(sys.argv[3], kvhal.to_numpy(c.attention(1, q, [s])))
else:
    [r] = c.restore(sys.argv[2])
    prompt = list(range(1000, 1000 + 2 * 16 + 3)) + [5, 6, 7, 8, 9]
    t, n = c.match_prefix(prompt)
    before = c.stats()
    prefill(c, prompt, seq=t, start=n)
    q = np.random.default_rng(7).standard_normal((1, 4, 32), dtype=np.float32)
    print(json.dumps({{"n": n, "stored": c.seq_len(t) - n, "hit_tokens": before.prefix_hit_tokens,
                      "recomputed": before.prefix_recomputed_tokens, "shared": c.stats().blocks_shared,
                      "restored_attention": kvhal.to_numpy(c.attention(1, q, [r])).tolist()}}))
"""


def test_restart_reuses_every_full_block(tmp_path):
    """Process 1 prefills and saves; process 2 restores and a longer prompt matches every full block."""
    code = RESTART_CHILD.format(root=str(ROOT))
    snap, att = tmp_path / "s.kvs", tmp_path / "att.npy"
    subprocess.run([sys.executable, "-c", code, "save", str(snap), str(att)], check=True, cwd=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code, "restore", str(snap)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "99"},
    ).stdout
    r = json.loads(out)
    assert r["n"] == 32 and r["stored"] == 8  # 35 saved tokens = 8 full blocks of 4; 40 - 32 new
    assert r["hit_tokens"] == 32 and r["recomputed"] == 8 and r["shared"] == 8
    np.testing.assert_array_equal(np.array(r["restored_attention"], np.float32), np.load(att))  # bit for bit


SAVER = """
import sys, numpy as np, kvhal
sys.path.insert(0, {root!r})
from tests.unit.test_prefix_cache import make, prefill
c = make(cap=512)
a = prefill(c, list(range(0, 300)))
b = prefill(c, list(range(5000, 5200)))
print("ready", flush=True)
i = 0
while True:
    c.save(sys.argv[1], seqs=[a] if i % 2 else [b])
    i += 1
"""


def test_kill_9_during_save_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "live.kvs"
    make_a = make(cap=512)
    a = prefill(make_a, list(range(0, 300)))
    make_a.save(path, seqs=[a])  # a valid old file to start from
    rng = np.random.default_rng(0)
    code = SAVER.format(root=str(ROOT))
    seen = set()
    for _ in range(12):
        p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, cwd=ROOT)
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.0, 0.25)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        d = make(cap=512)
        [r] = d.restore(path)  # always a whole, valid snapshot: the old one or a new one
        seen.add(d.seq_len(r))
        assert d.seq_len(r) in (300, 200)
    assert seen <= {300, 200}
    make_a.save(path, seqs=[a])  # the next save into the directory removes the killed writers' temp files
    assert not list(tmp_path.glob(".live.kvs.*.tmp"))


@pytest.fixture()
def saved(tmp_path):
    c = make()
    s = prefill(c, list(range(40, 50)))
    path = tmp_path / "good.kvs"
    c.save(path, seqs=[s])
    target = make()
    prefill(target, [7, 7, 7, 7, 7])
    return path, target


def _rewrite_meta(path: Path, out: Path, edit, text=None, crc: bool | None = True) -> None:
    """Rewrite the safetensors header's kvhal metadata (the tensors stay as they are), its checksum recomputed
    (a deliberate edit) unless ``crc`` is False (a bit flip) or None (removed, as version 1 wrote);
    ``text``: metadata text used as is."""
    import zlib

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    if text is None:
        meta = json.loads(header["__metadata__"]["kvhal"])
        edit(meta)
        text = json.dumps(meta)
    header["__metadata__"]["kvhal"] = text
    if crc:
        header["__metadata__"]["kvhal_crc32"] = f"{zlib.crc32(text.encode()):08x}"
    elif crc is None:
        header["__metadata__"].pop("kvhal_crc32", None)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    out.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_bad_files_are_typed_errors_and_change_nothing(saved, tmp_path):
    path, c = saved
    raw = path.read_bytes()
    before = state(c)
    cases: list[tuple[type, Path]] = []

    def add(err: type, name: str, data: bytes) -> None:
        p = tmp_path / name
        p.write_bytes(data)
        cases.append((err, p))

    add(kvhal.SnapshotCorruptError, "truncated.kvs", raw[: len(raw) - 100])
    add(kvhal.SnapshotCorruptError, "header-only.kvs", raw[:50])
    flipped = bytearray(raw)
    flipped[-40] ^= 0x10  # inside the last tensor's bytes
    add(kvhal.SnapshotCorruptError, "flipped.kvs", bytes(flipped))
    add(kvhal.SnapshotCorruptError, "text.kvs", b"this is not a snapshot at all\n" * 10)
    add(kvhal.SnapshotCorruptError, "empty.kvs", b"")
    for name, err, edit in (
        ("version.kvs", kvhal.SnapshotVersionError, lambda m: m.update(format_version=99)),
        # another model's digest under this file's (stale) model name: the file disagrees with itself
        ("model.kvs", kvhal.SnapshotCorruptError, lambda m: m["fingerprint"].update(digest="00" * 32)),
        ("spec.kvs", kvhal.SnapshotCorruptError, lambda m: m["spec"].update(head_dim=64)),
        ("chain.kvs", kvhal.SnapshotCorruptError, lambda m: m["seqs"][0]["hashes"].reverse()),
        ("meta.kvs", kvhal.SnapshotCorruptError, lambda m: m.pop("seqs")),
    ):
        p = tmp_path / name
        _rewrite_meta(path, p, edit)
        cases.append((err, p))
    other_model = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=kvhal.Fingerprint("another-model"))
    s = prefill(other_model, list(range(40, 50)))
    other_model.save(tmp_path / "other.kvs", seqs=[s])
    cases.append((kvhal.FingerprintMismatchError, tmp_path / "other.kvs"))
    import dataclasses

    other_spec = kvhal.KVCache(
        dataclasses.replace(SPEC, v_format="q8_0"), 64, backend="reference", fingerprint=kvhal.Fingerprint("test-model")
    )
    s = prefill(other_spec, list(range(40, 50)))
    other_spec.save(tmp_path / "other-spec.kvs", seqs=[s])
    cases.append((kvhal.FingerprintMismatchError, tmp_path / "other-spec.kvs"))
    for err, p in cases:
        with pytest.raises(err) as info:
            c.restore(p)
        assert isinstance(info.value, kvhal.SnapshotError) and len(str(info.value)) > 30, p.name
        assert_unchanged(before, c)
    with pytest.raises(kvhal.SnapshotError, match="no snapshot file"):
        c.restore(tmp_path / "missing.kvs")
    from kvhal.snapshot import inspect

    for read in (c.restore, inspect):  # a name longer than the file system takes: its OSError, not a raw one
        with pytest.raises(kvhal.SnapshotError, match="cannot look up"):
            read(tmp_path / ("x" * 300))
    with pytest.raises(kvhal.SnapshotError):
        c.restore(123)  # type: ignore[arg-type]
    from kvhal import snapshot

    with pytest.raises(kvhal.SnapshotError, match="must be a kvhal.KVCache"):
        snapshot.save(None, tmp_path / "none.kvs")  # type: ignore[arg-type]
    with pytest.raises(kvhal.SnapshotError, match="must be a kvhal.KVCache"):
        snapshot.restore(1, path)  # type: ignore[arg-type]
    with pytest.raises(kvhal.SnapshotError, match="inspect"):
        snapshot.validate(path)  # type: ignore[arg-type]
    assert_unchanged(before, c)
    for typo in ({"capcity_tokens": 64}, {"fingerprint": kvhal.Fingerprint("x")}):  # the fingerprint is the file's
        with pytest.raises(kvhal.SpecError, match="no option"):
            kvhal.KVCache.from_snapshot(path, "reference", **typo)
    fresh, ids = kvhal.KVCache.from_snapshot(path, "reference", observe_window=8, capacity_tokens=256)
    assert len(ids) == len(c.seqs) and fresh.observe_window == 8


def test_restore_needs_free_blocks_not_contiguous_ones(saved):
    path, _ = saved
    c = make(cap=4 * BS)  # 4 blocks; the snapshot needs 3
    s = c.new_seq()
    k, v = kv_for(list(range(16)))
    for layer in (0, 1):
        c.store(s, layer, k, v)  # all 4 blocks used
    c.seq_rm(s, 4, 8)  # shifts down; frees the last block -> 1 free
    before = state(c)
    with pytest.raises(kvhal.CapacityError, match="needs 3 free blocks but 1"):
        c.restore(path)
    assert_unchanged(before, c)
    c2 = make(cap=6 * BS)
    seqs = [prefill(c2, [i] * 4) for i in range(6)]
    for x in seqs[::2]:
        c2.free_seq(x)  # free blocks 0, 2, 4: scattered
    [r] = c2.restore(path)
    assert sorted(c2.seq_table.get(r).blocks) == [0, 2, 4]


def test_restored_blocks_are_written_through_to_the_tiers(saved):
    """With write_through, eviction writes down no block (each was put down when it got its hash): restored blocks
    get theirs at restore, so they are put down then, or their space would be reused with nothing kept."""
    from kvhal.tiers import HostTier

    path, _ = saved
    tier = HostTier(1 << 20)
    c = kvhal.KVCache(
        SPEC, 3 * BS, backend="reference", fingerprint=kvhal.Fingerprint("test-model"), tiers=[tier], write_through=True
    )
    [r] = c.restore(path)
    assert tier.stats().blocks == 2  # the two full blocks of 40..49
    c.free_seq(r)
    prefill(c, [1] * 12)  # reuses all three blocks
    assert c.stats().prefix_evicted_blocks == 2
    c.seq_keep(c.new_seq())
    t, n = c.match_prefix(list(range(40, 50)))
    assert n == 8 and c.stats().tier_hit_blocks == 2
    for layer in (0, 1):
        np.testing.assert_array_equal(
            c.load(t, layer)[0], kvhal.KVCache.from_snapshot(path, "reference")[0].load(0, layer)[0][:8]
        )


def test_snapshot_inspect_cli(saved, tmp_path, capsys):
    from kvhal.tools.cli import main

    path, _ = saved
    assert main(["snapshot", "inspect", str(path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["checksums_ok"] and r["n_blocks"] == 3 and r["seqs"] == [{"tokens": 10, "hashed_blocks": 2}]
    assert r["fingerprint"]["model"] == "test-model" and r["spec"]["k_format"] == "q8_0"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(bytes(raw))
    assert main(["snapshot", "inspect", str(bad)]) == 1
    assert "fails its checksum" in capsys.readouterr().out
    assert main(["snapshot", "inspect", str(tmp_path / "nope.kvs")]) == 2


def _set_tensor(path: Path, out: Path, name: str, values: np.ndarray) -> None:
    """Overwrite tensor ``name``'s bytes (same size) and recompute its checksum and the metadata's: a file that
    every checksum passes, with a value no save writes."""
    import zlib

    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    lo, hi = header[name]["data_offsets"]
    data = np.ascontiguousarray(values).tobytes()
    assert len(data) == hi - lo
    raw[8 + n + lo : 8 + n + hi] = data
    tmp = out.with_suffix(".tmp-raw")
    tmp.write_bytes(bytes(raw))
    _rewrite_meta(tmp, out, lambda m: m["checksums"].update({name: zlib.crc32(data)}))
    tmp.unlink()


def _verdicts(c: kvhal.KVCache, p: Path) -> tuple[str | None, str | None]:
    """(restore's error or None, inspect's error or None); inspect's raising counts as its verdict too."""
    from kvhal.snapshot import inspect

    before = state(c)
    try:
        c.restore(p)
        got = None
    except kvhal.SnapshotError as e:
        got = type(e).__name__
        assert_unchanged(before, c)
    try:
        rep = inspect(p)
        seen = None if rep["ok"] else "refused"
    except kvhal.SnapshotError as e:
        seen = type(e).__name__
    return got, seen


def test_fuzz_findings_are_typed_errors_and_inspect_agrees(saved, tmp_path, capsys):
    from kvhal.tools.cli import main

    path, c = saved
    cases = {
        "nested-deep": dict(text='{"snapshot_version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "nested": dict(edit=lambda m: m["fingerprint"].update(extra={"a": json.loads("[" * 40 + "]" * 40)})),
        "checksums-list": dict(edit=lambda m: m.update(checksums=[])),
        "fingerprint-null": dict(edit=lambda m: m.update(fingerprint=None)),
        "lens-flip": dict(edit=lambda m: m["seqs"][0].update(lens=[11, 10]), crc=False),  # one bit: 10 -> 11
        "lens-str": dict(edit=lambda m: m["seqs"][0].update(lens=["10", 10])),
        "seq-null": dict(edit=lambda m: m.update(seqs=[None])),
        "n-blocks-bool": dict(edit=lambda m: m.update(n_blocks=True)),
        "hashes-ints": dict(edit=lambda m: m["seqs"][0].update(hashes=[1, 2])),
        "n-tokens": dict(edit=lambda m: m["seqs"][0].update(n_tokens=11)),
        "extra-short": dict(edit=lambda m: m["seqs"][0].update(extra="00")),
        "version-str": dict(edit=lambda m: m.update(snapshot_version="2")),
        "meta-list": dict(text="[1, 2]"),
    }
    for name, kw in cases.items():
        p = tmp_path / f"{name}.kvs"
        _rewrite_meta(path, p, kw.get("edit"), text=kw.get("text"), crc=kw.get("crc", True))
        restore_says, inspect_says = _verdicts(c, p)
        assert restore_says == "SnapshotCorruptError" and inspect_says is not None, name
        assert main(["snapshot", "inspect", str(p)]) in (1, 2), name  # a verdict or a typed error, no traceback
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err and ("REFUSED" in out.out or "kvhal:" in out.err), name
    # a negative token id past the hashed blocks, every checksum recomputed: refused
    tokens = np.array(list(range(40, 49)) + [-5], np.int32)
    _set_tensor(path, tmp_path / "negative.kvs", "seq0.tokens", tokens)
    assert _verdicts(c, tmp_path / "negative.kvs") == ("SnapshotCorruptError", "refused")
    assert main(["snapshot", "inspect", str(tmp_path / "negative.kvs")]) == 1
    assert "negative token id" in capsys.readouterr().out
    # the bit-flipped lens: inspect no longer says all is well
    rep = json.loads(
        (main(["snapshot", "inspect", str(tmp_path / "lens-flip.kvs"), "--json"]), capsys.readouterr().out)[1]
    )
    assert rep["checksums_ok"] and not rep["ok"] and "metadata fails its checksum" in rep["error"]
    rep = json.loads(
        (main(["snapshot", "inspect", str(tmp_path / "fingerprint-null.kvs"), "--json"]), capsys.readouterr().out)[1]
    )
    assert rep["fingerprint"] is None and not rep["ok"] and "fingerprint" in rep["error"]


def test_random_metadata_mutations_restore_and_inspect_agree(saved, tmp_path):
    """A seeded fuzz: a field replaced by a value of another type or shape; restore either succeeds or raises a
    SnapshotError, never anything else, and inspect's verdict is restore's."""
    path, _ = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["kvhal"])
    rng = np.random.default_rng(11)
    values = [None, True, -1, 0, 3, 2**31, 1.5, "", "zz", "00" * 32, [], [0], [-1, 1], {}, {"a": 1}, [[1]]]

    def paths(x, at=()):
        yield at
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            yield from paths(v, (*at, k))

    spots = [p for p in paths(meta) if p and p[0] != "snapshot_version"]
    restored = 0
    for trial in range(120):
        spot = spots[int(rng.integers(len(spots)))]
        value = values[int(rng.integers(len(values)))]

        def edit(m, spot=spot, value=value):
            x = m
            for k in spot[:-1]:
                x = x[k]
            x[spot[-1]] = value

        p = tmp_path / f"fuzz{trial}.kvs"
        _rewrite_meta(path, p, edit)
        restore_says, inspect_says = _verdicts(make(), p)
        assert (restore_says is None) == (inspect_says is None), (spot, value, restore_says, inspect_says)
        restored += restore_says is None
        p.unlink()
    assert restored < 120


def test_version_1_files_are_still_read(saved, tmp_path):
    path, c = saved

    def to_v1(m):
        m["snapshot_version"] = 1
        for s in m["seqs"]:
            del s["n_tokens"]

    _rewrite_meta(path, tmp_path / "v1.kvs", to_v1, crc=None)
    [r] = c.restore(tmp_path / "v1.kvs")
    assert c.tokens(r) == list(range(40, 50))
    from kvhal.snapshot import inspect

    assert inspect(tmp_path / "v1.kvs")["ok"] and inspect(tmp_path / "v1.kvs")["snapshot_version"] == 1


def test_save_onto_a_directory_and_dead_savers_temp_files(saved, tmp_path):
    path, c = saved
    with pytest.raises(kvhal.SnapshotError, match="is a directory"):
        c.save(tmp_path)
    os.mkfifo(tmp_path / "fifo")  # (as /dev/null: os.replace would put a file in its place)
    with pytest.raises(kvhal.SnapshotError, match="not a regular file"):
        c.save(tmp_path / "fifo")
    assert (tmp_path / "fifo").is_fifo()
    with pytest.raises(kvhal.SnapshotError, match="cannot look up"):
        c.save(tmp_path / ("x" * 300))
    with pytest.raises(kvhal.SequenceError, match="twice"):  # a restore would make two sequences of it
        c.save(tmp_path / "twice.kvs", seqs=[c.seqs[0], c.seqs[0]])
    assert not (tmp_path / "twice.kvs").exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_tmp = tmp_path / f".good.kvs.kvhal-{dead.pid}-00ff00ff.tmp"
    live_tmp = tmp_path / f".good.kvs.kvhal-{os.getppid()}-00ff00fe.tmp"
    no_pid = tmp_path / f".good.kvs.kvhal-{2**80}-00ff00fd.tmp"  # no process has that id (OverflowError for os.kill)
    other = tmp_path / ".good.kvs.abcdef.tmp"  # not kvhal's naming: left alone
    for p in (dead_tmp, live_tmp, no_pid, other):
        p.write_bytes(b"partial")
    c.save(tmp_path / "next.kvs")
    assert not dead_tmp.exists() and not no_pid.exists() and live_tmp.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.glob(".*kvhal-*.tmp")) == [live_tmp.name]


def test_a_save_that_cannot_write_is_a_snapshot_error_and_leaves_the_old_file(saved, tmp_path):
    """A full disk (here: a file size limit, EFBIG) or an unusable path is a SnapshotError, not safetensors' own
    error or an OSError; the temp file is gone and the file already at the target is unchanged."""
    import resource

    path, c = saved
    old = path.read_bytes()
    assert len(old) > 2048
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # (Python ignores SIGXFSZ: a write fails with EFBIG)
    try:
        with pytest.raises(kvhal.SnapshotError, match="cannot write"):
            c.save(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert path.read_bytes() == old and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(kvhal.SnapshotError, match="cannot write"):
        c.save(str(tmp_path / "nul\0.kvs"))
    c.save(path)  # and a save that can write still does
    assert c.restore(path)
