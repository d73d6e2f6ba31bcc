"""kvhal bench's plumbing on the reference backend with tiny contexts: which figures it makes and how they are derived.

Speed itself is what `kvhal bench` reports, never asserted here.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvhal import SpecError, backends, formats
from kvhal.tools import bench
from kvhal.tools.cli import main
from tests.oracle import attention_f64

TINY = dict(contexts=[32, 64], prefill_contexts=[64], prefill_queries=16, repeats=1, show_progress=False)


def by_key(result):
    return {(r["backend"], r["format"], r["op"], r["context"], r["threads"]): r for r in result["rows"]}


def test_sdpa_baseline_is_bottom_right_causal():
    """The SDPA prefill baseline computes kvhal's attention: query i at position n - n_q + i."""
    torch = pytest.importorskip("torch")
    work = bench.Workload.make(prefill_queries=16, seed=3)
    k, v = work.kv(40)
    out = bench.sdpa_call(torch, work.q_prefill, k, v, torch.float32, "cpu")()
    got = out[0].numpy().transpose(1, 0, 2)  # [1, H, n_q, D] -> [n_q, H, D]
    want = attention_f64(work.q_prefill, [k], [v], [16])
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_prefill_flops_counts_the_visible_keys():
    n, n_q = 100, 16
    visible = sum(int(np.sum(np.arange(n) <= n - n_q + i)) for i in range(n_q))
    assert bench.prefill_flops(n, n_q) == 4 * bench.N_HEADS * bench.HEAD_DIM * visible


def test_workload_kv_is_what_the_cache_stores():
    work = bench.Workload.make(prefill_queries=16)
    k, v = work.kv(bench.STORE_CHUNK + 7)
    assert k.shape == (bench.STORE_CHUNK + 7, bench.N_KV_HEADS, bench.HEAD_DIM)
    np.testing.assert_array_equal(k[bench.STORE_CHUNK :], work.k[:7])
    np.testing.assert_array_equal(v[:5], work.v[:5])


def test_run_makes_store_load_decode_and_prefill_rows():
    result = bench.run([("reference", "q8_0"), ("reference", "f32")], sdpa=False, bandwidth_bytes=1 << 20, **TINY)
    json.dumps(result)  # JSON-able as written by -o
    rows = by_key(result)
    for fmt in ("q8_0", "f32"):
        ops = {(op, ctx) for (b, f, op, ctx, _t) in rows if b == "reference" and f == fmt}
        loads = {(op, ctx) for op in ("load", "load-out", "load-bf16") for ctx in (32, 64)}
        assert ops == {("store-1", 1), ("store-512", 512), *loads, ("decode", 32), ("decode", 64), ("prefill", 64)}
    (host,) = result["bandwidth"]
    assert host["where"] == "host" and host["threads"] == os.cpu_count()
    for fmt in ("q8_0", "f32"):
        row_bytes = formats.get(fmt).row_bytes(bench.HEAD_DIM) * bench.N_KV_HEADS * 2
        for ctx in (32, 64):
            load = rows[("reference", fmt, "load", ctx, None)]
            assert load["gbps"] == pytest.approx(ctx * row_bytes / (load["median_ms"] / 1e3) / 1e9)
            assert load["frac_bw"] == pytest.approx(load["gbps"] / host["read_gbps"])
            # moved: the format's bytes and the output's (f32 new or reused, bf16 reused) over the same time
            for op, out_bytes in (("load", 4), ("load-out", 4), ("load-bf16", 2)):
                r = rows[("reference", fmt, op, ctx, None)]
                moved = ctx * (row_bytes + out_bytes * bench.N_KV_HEADS * bench.HEAD_DIM * 2)
                assert r["frac_moved"] == pytest.approx(moved / (r["median_ms"] / 1e3) / 1e9 / host["read_gbps"])
        pre = rows[("reference", fmt, "prefill", 64, None)]
        assert pre["gflops"] == pytest.approx(bench.prefill_flops(64, 16) / (pre["median_ms"] / 1e3) / 1e9)
        assert pre["tokens_per_s"] == pytest.approx(16 / (pre["median_ms"] / 1e3))
        assert pre["speedup_vs_sdpa_f32"] is None  # sdpa=False
    text = bench.table(result)
    assert "prefill" in text and "decode" in text and "the last 16 positions" in text
    # the two formats' decode at the largest context, timed in turn: that row only
    alternated = {(f, op, ctx) for (_, f, op, ctx, _t), r in rows.items() if r["alternating_ms"] is not None}
    assert alternated == {("q8_0", "decode", 64), ("f32", "decode", 64)}
    assert all(rows[("reference", f, "decode", 64, None)]["alternating_ms"] > 0 for f in ("q8_0", "f32"))
    assert "alt ms" in text and "median of 3 rounds" in text


def test_alternating_needs_two_formats_and_a_sequence_still_at_the_decode_context():
    one = bench.run([("reference", "q8_0")], sdpa=False, bandwidth_bytes=1 << 20, **TINY)
    longer = {**TINY, "prefill_contexts": [96]}  # the sequence ends past the largest decode context
    two = bench.run([("reference", "q8_0"), ("reference", "f32")], sdpa=False, bandwidth_bytes=1 << 20, **longer)
    assert all(r["alternating_ms"] is None for r in one["rows"] + two["rows"])


def test_alternating_times_calls_in_turn_after_three_warm_up_rounds():
    calls: list[str] = []
    syncs: list[int] = []
    medians = bench.alternating_times(
        [lambda: calls.append("a"), lambda: calls.append("b")], lambda: syncs.append(1), 4
    )
    assert calls == ["a", "b"] * 7 and len(syncs) == 14
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_run_with_sdpa_gives_ratios_against_the_same_shapes():
    pytest.importorskip("torch")
    result = bench.run([("reference", "q4_0")], sdpa=True, bandwidth_bytes=1 << 20, **TINY)
    rows = result["rows"]
    sdpa = {(r["format"], r["op"], r["context"]): r for r in rows if r["backend"] == "torch-sdpa"}
    assert set(sdpa) == {(dt, op, n) for dt in ("f32", "bf16") for op, n in
                         (("decode", 32), ("decode", 64), ("prefill", 64))}  # fmt: skip
    for r in rows:
        if r["backend"] == "reference" and r["op"] in ("decode", "prefill"):
            for dt in ("f32", "bf16"):
                want = sdpa[(dt, r["op"], r["context"])]["median_ms"] / r["median_ms"]
                assert r[f"speedup_vs_sdpa_{dt}"] == pytest.approx(want)


def test_threads_sweep_runs_a_backend_without_the_option_once_and_says_so():
    result = bench.run([("reference", "q8_0")], sdpa=False, threads=[1, 2], bandwidth_bytes=1 << 20, **TINY)
    assert result["threads"] == [1, 2]
    assert [r["threads"] for r in result["rows"]] == [None] * 11  # store x2, load x3 and decode at 32 and 64, prefill
    assert result["notes"] == ["threads: reference takes no threads option; it ran once, with its own default"]
    assert "note: threads: reference takes no threads option" in bench.table(result)


@pytest.mark.parametrize(
    "kw",
    [
        {"contexts": [0]},
        {"contexts": [True]},
        {"contexts": "4096"},
        {"contexts": [64.0]},
        {"prefill_contexts": [8]},  # fewer tokens than the 16 prefill queries
        {"prefill_queries": 0},
        {"threads": []},
        {"threads": [1, "all"]},
        {"repeats": 0},
    ],
)
def test_run_rejects_bad_arguments_before_measuring(kw):
    args = {**TINY, **kw}
    with pytest.raises(SpecError):
        bench.run([("reference", "q8_0")], sdpa=False, bandwidth_bytes=1 << 20, **args)


def test_run_rejects_jobs_that_are_not_name_pairs():
    with pytest.raises(SpecError, match="jobs"):
        bench.run("reference", [32], sdpa=False)


def test_cli_bench_json_threads_and_output_file(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "--backend", "reference", "--format", "q8_0", "--contexts", "32", "--prefill-contexts", "64",
               "--prefill-queries", "16", "--repeats", "1", "--no-sdpa", "--threads", "1,all", "--json", "-o", str(out)])  # fmt: skip
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["threads"] == list(dict.fromkeys([1, os.cpu_count()]))
    assert printed["shape"]["prefill_queries"] == 16
    assert {(r["op"], r["context"]) for r in printed["rows"]} >= {("load", 32), ("decode", 32), ("prefill", 64)}


def test_cli_no_prefill(capsys):
    rc = main(["bench", "--backend", "reference", "--format", "f16", "--contexts", "32", "--no-prefill",
               "--repeats", "1", "--no-sdpa", "--json"])  # fmt: skip
    assert rc == 0
    assert "prefill" not in {r["op"] for r in json.loads(capsys.readouterr().out)["rows"]}
    rc = main(["bench", "--backend", "reference", "--format", "f16", "--contexts", "", "--prefill-contexts", "64",
               "--prefill-queries", "8", "--repeats", "1", "--no-sdpa", "--json"])  # fmt: skip
    assert rc == 0  # prefill alone: no decode context is fine
    assert {r["op"] for r in json.loads(capsys.readouterr().out)["rows"]} >= {"prefill"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
        (["--threads", ","], "argument --threads: expected thread counts from 1 to 1024 such as 1,2,all"),
        (["--threads", "100000"], "argument --threads: expected thread counts from 1 to 1024"),
        (["--contexts", "4k"], "argument --contexts: expected a positive integer, got '4k'"),
        (["--repeats", "-1"], "argument --repeats: expected a positive integer, got '-1'"),
    ],
)
def test_cli_bench_rejects_bad_numbers(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--backend", "reference", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lifecycle", "--streaming"], "--lifecycle and --streaming are two runs"),
        (["--lifecycle", "--format", "q8_0"], "--format given 2 times"),
        (["--streaming", "--threads", "1"], "drop --threads"),
        (["--contexts", ",", "--no-prefill"], "nothing to measure"),
        (["-o", "."], "is a directory"),
        (["-o", "no/such/dir/x.json"], "does not exist"),
    ],
)
def test_cli_bench_refuses_what_it_would_ignore_or_fail_on_late(args, message, capsys):
    """Checked before any figure is taken: one line, exit 2, no traceback after minutes of work."""
    assert main(["bench", "--backend", "reference", "--format", "f16", "--contexts", "32", "--no-sdpa", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_prefill_shorter_than_its_queries_is_a_clear_error(capsys):
    rc = main(["bench", "--backend", "reference", "--format", "q8_0", "--contexts", "32", "--prefill-contexts",
               "100", "--no-sdpa"])  # fmt: skip
    assert rc == 2
    assert "prefill contexts must be >= the 512 prefill queries, got 100" in capsys.readouterr().err


def test_cli_bench_k_v_pairs_and_row_only_formats(capsys):
    """A K/V pair benches both formats' bytes; a per-channel K format runs as itself where the backend takes
    it as K (the reference, the cpu backend), and as ``f16/fmt`` where only its V rows run."""
    rc = main(["bench", "--backend", "reference", "--format", "q8_0/q4_0", "--format", "kivi4", "--contexts", "32",
               "--no-prefill", "--repeats", "1", "--no-sdpa", "--json"])  # fmt: skip
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    decode = {r["format"]: r for r in rows if r["op"] == "decode"}
    assert set(decode) == {"q8_0/q4_0", "kivi4"}
    per_token = (formats.get("q8_0").row_bytes(128) + formats.get("q4_0").row_bytes(128)) * bench.N_KV_HEADS
    r = decode["q8_0/q4_0"]
    assert r["gbps"] * r["median_ms"] * 1e6 == pytest.approx(32 * per_token, rel=1e-6)
    if any(b.name == "cpu" and b.available for b in backends()):
        assert bench.job_format("cpu", "kivi4") == "kivi4" and bench.job_format("cpu", "q4_0") == "q4_0"


def test_attention_rows_name_the_kernels_they_ran():
    """Each decode/prefill figure says which kernels ran it where the backend can tell (the cpu backend's
    attention_path: amx-bf16 on a CPU with AMX, avx512-vnni, ...), in the table and the JSON."""
    kvhal_cpu = pytest.importorskip("kvhal_cpu")
    result = bench.run([("cpu", "q8_0"), ("reference", "q8_0")], sdpa=False, **TINY)
    paths = {(r["backend"], r["op"]): r["path"] for r in result["rows"] if r["op"] in ("decode", "prefill")}
    assert paths[("reference", "prefill")] is None and paths[("reference", "decode")] is None
    spec = bench.CacheSpec(
        n_layers=1, n_kv_heads=bench.N_KV_HEADS, head_dim=bench.HEAD_DIM, k_format="q8_0", v_format="q8_0"
    )
    be = kvhal_cpu.CpuBackend()
    assert paths[("cpu", "prefill")] == be.attention_path(spec, bench.N_HEADS, TINY["prefill_queries"])
    assert paths[("cpu", "decode")] == be.attention_path(spec, bench.N_HEADS, 1)
    assert paths[("cpu", "prefill")] in {"amx-bf16", "avx512-vnni", "avx2-gemm", "avx2", "neon", "scalar"}
    lines = bench.table(result).splitlines()
    assert lines[2].split()[-1] == "path" and any(line.endswith(paths[("cpu", "prefill")]) for line in lines)
