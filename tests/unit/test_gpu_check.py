"""ci/gpu-check.sh where no GPU is: one clear line and a non-zero exit; its summary block from real outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvhal.tools import bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "gpu-check.sh"
BASH = shutil.which("bash")


def run_script(path_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(path_dir), "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_without_nvidia_smi_it_fails_with_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    p = run_script(empty, tmp_path)
    assert p.returncode == 3
    assert p.stdout + p.stderr == "gpu-check: no NVIDIA GPU (nvidia-smi not found)\n"
    assert not (tmp_path / "out").exists()  # nothing installed or written


def test_with_a_driver_that_is_not_loaded_it_names_nvidia_smis_reason(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # what nvidia-smi prints on a machine whose kernel module is not loaded
    smi.write_text(
        "#!/bin/sh\n"
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\n"
        'echo "Make sure that the latest NVIDIA driver is installed and running."\n'
        "exit 9\n"
    )
    smi.chmod(0o755)
    p = run_script(bin_dir, tmp_path)
    assert p.returncode == 3
    assert p.stdout + p.stderr == (
        "gpu-check: no NVIDIA GPU (nvidia-smi failed: "
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.)\n"
    )


def test_summary_block_from_a_real_bench_json_and_junit_xml(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = bench.run([("reference", "q8_0"), ("reference", "q4_0")], [32, 64], 1, show_progress=False, sdpa=False,
                       prefill_contexts=[64], prefill_queries=16, bandwidth_bytes=1 << 20)  # fmt: skip
    (out / "bench-cuda.json").write_text(json.dumps(result))
    suite = tmp_path / "test_three.py"
    suite.write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False\n"
        "def test_skip(): pytest.skip('no device')\n"
    )
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
                    f"--junitxml={out / 'contract.xml'}"], cwd=tmp_path, capture_output=True)  # fmt: skip
    (out / "tests.log").write_text("collected 3 items\nFAILED test_three.py::test_fail\n1 failed, 1 passed, 1 skipped\n")
    p = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "gpu_check_summary.py"), "--out", str(out), "--gpu", "NVIDIA H200, 580.65.06",
         "--driver-cuda", "13.0", "--cuda", "13", "--budget", "450", "--step", "install=ok=90",
         "--step", "tests=failed (exit 1)=30", "--step", "bench=ok=100"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = p.stdout.splitlines()
    assert lines[0].strip("= ") == "gpu-check"
    assert "gpu       NVIDIA H200, 580.65.06; driver CUDA 13.0 -> a venv with cupy-cuda13x" in lines
    assert any(x.startswith("tests     failed (exit 1), 30 s: 1 passed, 1 failed, 1 skipped") for x in lines)
    assert "          | 1 failed, 1 passed, 1 skipped" in lines
    rows = {(r["format"], r["op"], r["context"]): r for r in result["rows"]}
    decode = next(x for x in lines if x.strip().startswith("q8_0") and "(" in x)
    for n in (32, 64):
        r = rows[("q8_0", "decode", n)]
        assert f"{r['median_ms']:.3f} ({r['frac_bw']:.2f})" in decode
    assert any("prefill 64 ms" in x and "load 64 GB/s" in x for x in lines)
    assert lines[-3:] == ["total     220 s of a 450 s budget", f"outputs   {out}", "result    FAIL"]


def test_merge_joins_per_format_runs_and_gives_every_row_the_sdpa_ratios(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    kw = dict(show_progress=False, sdpa=False, prefill_contexts=[64], prefill_queries=16, bandwidth_bytes=1 << 20)
    first = bench.run([("reference", "q8_0")], [64], 1, **kw)
    # the run that timed SDPA: its baseline rows stand in as measured f32 / bf16 cache rows (no GPU torch here)
    dense = bench.run([("reference", "f32"), ("reference", "bf16")], [64], 1, **kw)["rows"]
    first["rows"] += [dict(r, backend="torch-sdpa-cuda") for r in dense if r["op"] in ("decode", "prefill")]
    second = bench.run([("reference", "q4_0")], [64], 1, **kw)
    (parts / "q8_0.json").write_text(json.dumps(first))
    os.utime(parts / "q8_0.json", (1, 1))  # ran first
    (parts / "q4_0.json").write_text(json.dumps(second))
    merged_path = tmp_path / "bench-cuda.json"
    subprocess.run([sys.executable, str(ROOT / "ci" / "gpu_check_summary.py"), "--merge", str(parts), "-o",
                    str(merged_path)], check=True)  # fmt: skip
    merged = json.loads(merged_path.read_text())
    ratios = ("speedup_vs_sdpa_f32", "speedup_vs_sdpa_bf16")
    strip = [{k: v for k, v in r.items() if k not in ratios} for r in merged["rows"]]
    assert strip == [{k: v for k, v in r.items() if k not in ratios} for r in first["rows"] + second["rows"]]
    assert merged["bandwidth"] == first["bandwidth"] + second["bandwidth"]
    base = {(r["format"], r["op"], r["context"]): r["median_ms"] for r in first["rows"] if "sdpa" in r["backend"]}
    q4 = [r for r in merged["rows"] if r["format"] in ("q8_0", "q4_0") and r["op"] in ("decode", "prefill")]
    assert len(q4) == 4 and all(
        r["speedup_vs_sdpa_f32"] == base[("f32", r["op"], r["context"])] / r["median_ms"]
        and r["speedup_vs_sdpa_bf16"] == base[("bf16", r["op"], r["context"])] / r["median_ms"]
        for r in q4
    )
    empty = tmp_path / "none"
    empty.mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "ci" / "gpu_check_summary.py"), "--merge", str(empty), "-o",
                        str(tmp_path / "x.json")], capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 1 and "no bench results" in p.stderr


def test_targets_block_marks_each_format_ok_below_or_unmeasured(tmp_path):
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import gpu_check_summary as s
    finally:
        sys.path.pop(0)

    def row(fmt, op, ctx, **kw):
        return {"backend": "cuda", "format": fmt, "op": op, "context": ctx, **kw}

    rows = [
        row("q8_0", "prefill", s.PREFILL_CTX, speedup_vs_sdpa_bf16=0.9),
        row("q8_0", "decode", s.DECODE_CTX, frac_bw=0.5),
        row("q4_0", "prefill", s.PREFILL_CTX, speedup_vs_sdpa_bf16=0.3),
        row("q4_0", "decode", s.DECODE_CTX, frac_bw=0.85),
        {**row("fp8_e4m3", "decode", s.DECODE_CTX, frac_bw=0.99), "backend": "torch-sdpa-cuda"},  # a baseline row
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    head, q8, fp8, q4 = s.targets(path, "sdpa")
    assert "prefill route: sdpa" in head and "16k >= 0.7x" in head and "32k >= 0.8" in head
    assert q8.split() == ["q8_0", "prefill", "0.90x", "ok", "decode", "0.50", "below"]
    assert fp8.split() == ["fp8_e4m3", "prefill", "-", "decode", "-"]
    assert q4.split() == ["q4_0", "prefill", "0.30x", "below", "decode", "0.85", "ok"]
