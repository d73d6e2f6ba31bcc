"""`kvhal tiers bench` runs end to end (tiny sizes; speed is measured by the bench itself, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal.tools.cli import main
from kvhal.tools.tiers_server import free_port

from .conftest import require_redis


def test_bench_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    require_redis()
    out = tmp_path / "tiers.json"
    argv = ["tiers", "bench", "--block-sizes", "16K,20000", "--total", "256K", "--batch", "4", "--repeats", "1"]
    assert main([*argv, "--disk-path", str(tmp_path), "--redis", "auto", "--json", "-o", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    assert result["machine"]["redis"].startswith("redis://127.0.0.1:")
    rows = {(r["tier"], r["block_bytes"], r["op"], r["ceiling"]): r for r in result["rows"]}
    ceilings = {
        ("host", "put"): [None], ("host", "get"): [None], ("disk", "put"): ["append+fsync"], ("disk", "get"): ["read"],
        ("disk-nosync", "put"): ["append+fsync", "append"], ("disk-nosync", "get"): ["read"],
        ("redis", "put"): ["SET"], ("redis", "get"): ["GET"],
    }
    assert len(rows) == len(result["rows"])
    assert set(rows) == {(t, b, op, c) for (t, op), cs in ceilings.items() for b in (16384, 20000) for c in cs}
    for (tier, block, _, ceiling), r in rows.items():
        assert r["gbps"] > 0 and r["blocks_per_s"] == pytest.approx(r["gbps"] * 1e9 / block)
        if tier == "host":
            assert r["ceiling_gbps"] is None and r["ratio"] is None
        else:
            assert r["ceiling_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["ceiling_gbps"])
        # the no-fsync append is shown beside disk-nosync's put, not held to a target
        target = None if ceiling == "append" else {"host": None, "disk": 0.5, "disk-nosync": 0.8, "redis": 0.5}[tier]
        assert r["target"] == target
        assert r["meets_target"] == (None if target is None else r["ratio"] >= target)
    # the two disk-nosync put rows are one measurement held to two ceilings
    for b in (16384, 20000):
        fsync, plain = (rows[("disk-nosync", b, "put", c)] for c in ("append+fsync", "append"))
        assert fsync["gbps"] == plain["gbps"] and fsync["ceiling_gbps"] != plain["ceiling_gbps"]
        assert fsync["ceiling_gbps"] == rows[("disk", b, "put", "append+fsync")]["ceiling_gbps"]
    assert list(tmp_path.iterdir()) == [out]  # its temp files are gone


def test_bench_table_and_errors(tmp_path: Path):
    cmd = [sys.executable, "-m", "kvhal", "tiers", "bench", "--tier", "disk", "--block-sizes", "16K", "--total",
           "64K", "--repeats", "1", "--disk-path", str(tmp_path), "--redis", "none"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    head = ["tier", "block", "op", "GB/s", "blocks/s", "ceiling", "GB/s", "ratio", "target"]
    assert r.stdout.splitlines()[1].split() == head
    assert [line.split()[:3] + line.split()[5:6] for line in r.stdout.splitlines()[2:]] == [
        ["disk", "16K", "put", "append+fsync"], ["disk", "16K", "get", "read"],
        ["disk-nosync", "16K", "put", "append+fsync"], ["disk-nosync", "16K", "put", "append"],
        ["disk-nosync", "16K", "get", "read"]]
    bad = subprocess.run([*cmd[:-6], "--block-sizes", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "positive byte count" in bad.stderr
    for extra, why in (
        (["--disk-path", str(tmp_path / "nope")], "not a writable directory"),
        (["--disk-path", "/proc"], "not a writable directory"),  # a directory no file can be made in
        (["--block-sizes", ","], "at least one size"),
        (["--total", "1K"], "less than one block"),
        (["-o", str(tmp_path)], "is a directory"),
        (["-o", str(tmp_path / "nope" / "x.json")], "does not exist"),
    ):
        bad = subprocess.run([*cmd, *extra], capture_output=True, text=True)
        assert bad.returncode == 2 and why in bad.stderr and "Traceback" not in bad.stderr, (extra, bad.stderr)
    bad = subprocess.run([*cmd, "--tier", "redis"], capture_output=True, text=True)  # with --redis none
    assert bad.returncode == 2 and "cannot bench the redis tier: --redis none" in bad.stderr
    nobody = [*cmd[:-2], "--tier", "redis", "--redis", f"redis://127.0.0.1:{free_port()}"]  # nothing listens there
    bad = subprocess.run(nobody, capture_output=True, text=True)
    assert bad.returncode == 2 and "no Redis answers there" in bad.stderr and "Traceback" not in bad.stderr
