"""kvhal bench --streaming's plumbing on the reference backend with a short sequence: what it streams and
reports. Speed itself is what the command prints, never asserted here."""

from __future__ import annotations

import json

import pytest

from kvhal import SpecError
from kvhal.tools import bench_streaming
from kvhal.tools.cli import main


def test_run_streams_all_but_the_resident_tail_through_the_arena():
    r = bench_streaming.run("reference", "q4_0", tokens=3000, arena=256, resident=300, repeats=1, show_progress=False)
    assert r["backend"] == "reference" and r["format"] == "q4_0" and r["tokens"] == 3000
    assert r["arena_tokens"] == 256 and 300 <= r["resident_tokens"] < 300 + 16  # whole blocks stay
    assert r["offloaded_tokens"] + r["resident_tokens"] == 3000 and r["offloaded_tokens"] % 16 == 0
    assert r["arena_passes"] == -(-r["offloaded_tokens"] // 256)
    spec_bytes = r["kv_bytes"] / 3000  # K+V bytes per token
    # pools: the resident capacity (plus one store chunk of room) and the arena, never the sequence
    assert r["device_bytes"] == (-(-(300 + 512 + 16) // 16) + 256 // 16) * 16 * spec_bytes < r["kv_bytes"]
    assert r["max_abs_diff"] <= 1e-6
    assert r["ratio"] == pytest.approx(r["streamed_ms"] / r["resident_ms"])
    assert "x all resident" in bench_streaming.table(r)


@pytest.mark.parametrize(
    "kw", [{"tokens": 100, "resident": 100}, {"arena": 0}, {"tokens": 2.5}, {"repeats": True}, {"resident": -1}]
)
def test_bad_arguments_are_spec_errors(kw):
    with pytest.raises(SpecError):
        bench_streaming.run("reference", **{"tokens": 1000, "arena": 64, "resident": 64, **kw})


def test_cli_streaming_json_and_output_file(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = main(["bench", "--streaming", "--backend", "reference", "--format", "q8_0", "--streaming-tokens", "1200",
               "--arena-tokens", "128", "--repeats", "1", "--json", "-o", str(out)])  # fmt: skip
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["format"] == "q8_0" and printed["arena_tokens"] == 128 and printed["offloaded_tokens"] > 0
