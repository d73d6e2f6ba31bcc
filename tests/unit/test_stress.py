"""kvhal stress finds what it is meant to find: a clean run passes, a broken allocator fails with step and seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvhal.blocks import BlockAllocator
from kvhal.tools import stress
from kvhal.tools.cli import main


def test_clean_run_audits_every_op(capsys):
    assert main(["stress", "--steps", "400", "--seed", "3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["tokens_lost"] == 0 and rep["failure"] == "" and rep["steps_run"] == 400
    assert all(n > 0 for n in rep["ops"].values()), rep["ops"]  # every kind of op ran
    assert rep["rejected_calls"] > 0  # it really went past capacity
    assert rep["peak_tokens"] >= rep["advertised_tokens"] * 0.8
    assert rep["prefix_hit_tokens"] > 0 and 0 < rep["prefix_hit_rate"] < 1
    again = stress.run(steps=400, seed=3, show_progress=False)
    assert again.as_dict() | {"seconds": 0, "ops_per_s": 0} == rep | {"seconds": 0, "ops_per_s": 0}  # replayable


@pytest.mark.parametrize("fault", ["leak", "double_free"])
def test_a_broken_allocator_is_caught_with_step_and_seed(monkeypatch, capsys, fault):
    real = BlockAllocator.release
    calls = {"n": 0, "done": False}

    def broken(self, blocks):
        blocks = list(blocks)
        calls["n"] += 1
        shared = np.flatnonzero(self.ref >= 2)
        if calls["n"] >= 40 and not calls["done"]:
            if fault == "leak" and blocks:  # a block that never comes back
                calls["done"] = True
                blocks = blocks[1:]
            elif fault == "double_free" and shared.size:  # freed while two sequences still hold it
                calls["done"] = True
                self.ref[shared[0]] = 1
                blocks = [*blocks, int(shared[0])]
        return real(self, blocks)

    monkeypatch.setattr(BlockAllocator, "release", broken)
    assert main(["stress", "--steps", "3000", "--seed", "7", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert calls["done"] and rep["tokens_lost"] >= 1 and rep["steps_run"] < 3000
    assert rep["failure"].startswith(f"step {rep['steps_run'] - 1} (replay: kvhal stress --seed 7 --steps")


def test_tiers_with_faults_are_audited(capsys):
    """Blocks written down to host, disk and a real redis-server and pulled back are checked byte for byte, while
    the server is killed (-9) and restarted and disk segments are cut behind the tier's back."""
    from tests.tiers.conftest import require_redis

    require_redis()
    assert main(["stress", "--steps", "800", "--seed", "3", "--tiers", "host,disk,redis", "--faults", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["failure"] == "" and rep["tokens_lost"] == 0 and rep["tiers"] == ["host", "disk", "redis"]
    assert rep["tier_hit_blocks"] > 0 and rep["tier_blocks_checked"] >= rep["tier_hit_blocks"]
    assert all(st["puts"] > 0 for st in rep["tier_stats"].values())  # every tier took blocks
    assert rep["faults"]["redis_kills"] >= 1 and rep["faults"]["disk_truncations"] >= 1


def test_a_tier_returning_other_bytes_is_caught(monkeypatch, capsys):
    import kvhal.tiers.disk as disk

    real = disk.read_run

    def flipped(keys, run):
        out = real(keys, run)
        return [(st, bytes([v[0] ^ 1]) + bytes(v[1:]) if st == disk.OK and len(v) else v) for st, v in out]

    monkeypatch.setattr(disk, "read_run", flipped)
    assert main(["stress", "--steps", "1500", "--seed", "3", "--tiers", "disk", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert "disk tier: block" in rep["failure"] and "read back other bytes" in rep["failure"]
    assert rep["failure"].startswith(f"step {rep['steps_run'] - 1} (replay:")


def test_tier_arguments(capsys):
    assert main(["stress", "--steps", "5", "--faults"]) == 2
    assert "name the tiers" in capsys.readouterr().err
    assert main(["stress", "--steps", "5", "--tiers", "host,tape"]) == 2
    assert "host,disk,redis" in capsys.readouterr().err


def test_a_per_channel_k_format_is_audited_by_the_caches_page_rule(capsys):
    """kivi K pages are quantized once full: the newest tokens sit in the f16 tail, the pages hold whole blocks only
    (floor(n / block_size) of them, not ceil), K bytes are per-channel pages; the audit checks each by that rule."""
    argv = ["stress", "--steps", "250", "--seed", "1", "--k-format", "kivi4", "--capacity", "4096", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["failure"] == "" and rep["tokens_lost"] == 0 and rep["steps_run"] == 250
    assert all(rep["ops"][op] > 0 for op in ("prefill", "append", "fork", "remove", "evict", "free"))
    assert rep["prefix_hit_tokens"] > 0


def test_a_per_channel_k_format_past_capacity():
    rep = stress.run(k_format="kivi4", steps=60, seed=0, capacity_tokens=64, show_progress=False)
    assert rep.failure == "", rep.failure


def test_the_replay_command_repeats_every_option_of_the_run(monkeypatch):
    real, calls = BlockAllocator.release, {"n": 0}

    def leaky(self, blocks):  # the 30th release keeps one block: a leak the audit must report, with its replay
        calls["n"] += 1
        return real(self, list(blocks)[1:] if calls["n"] == 30 else blocks)

    monkeypatch.setattr(BlockAllocator, "release", leaky)
    rep = stress.run(k_format="kivi4", steps=3000, seed=0, capacity_tokens=64, show_progress=False)
    assert rep.failure.startswith(
        f"step {rep.steps_run - 1} (replay: kvhal stress --seed 0 --steps {rep.steps_run} --k-format kivi4 --capacity 64):"
    )
    got = stress._replay_args(
        backend="cpu",
        k_format="q8_0",
        v_format="f16",
        capacity_tokens=512,
        block_size=16,
        n_layers=3,
        n_kv_heads=2,
        head_dim=32,
        tiers="host,disk",
        faults=True,
    )
    assert got == (
        " --backend cpu --v-format f16 --block-size 16 --tiers host,disk --faults; "
        "with kvhal.tools.stress.run(n_layers=3)"
    )
    defaults = dict(backend="reference", k_format="q8_0", v_format="q4_0", capacity_tokens=512, block_size=8)
    assert stress._replay_args(**defaults, n_layers=2, n_kv_heads=2, head_dim=32, tiers="", faults=False) == ""
