"""The summary block of ci/gpu-check.sh, from its step results, pytest's JUnit XML and kvhal bench's JSON.

    python3 ci/gpu_check_summary.py --out DIR --step install=ok=95 --step tests=ok=60 ... [--gpu ...]
    python3 ci/gpu_check_summary.py --merge PARTS -o bench-cuda.json   # one kvhal bench JSON of per-format runs

Stdlib only: it runs with the system python3, also when the venv could not be made.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TARGET = 0.8  # decode at 32k+ should read the cache at this fraction of the measured HBM bandwidth
# the performance targets the summary checks: prefill (512 queries) at PREFILL_CTX against torch SDPA bf16 on the
# same K/V, decode at DECODE_CTX against the HBM read bandwidth, for these formats
TARGET_FORMATS = ("q8_0", "fp8_e4m3", "q4_0")
PREFILL_CTX, PREFILL_TARGET = 16384, 0.7
DECODE_CTX = 32768


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def contract(xml: Path) -> str:
    if not xml.is_file():
        return "no results"
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"


def bench(path: Path) -> list[str]:
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    rows = [r for r in result["rows"] if not r["backend"].startswith("torch-sdpa")]
    device = [b for b in result["bandwidth"] if b["where"] != "host"]
    gbps = sorted(b["read_gbps"] for b in device)
    lines = [
        f"HBM read {gbps[len(gbps) // 2]:.0f} GB/s ({device[0]['where']}; median of {len(gbps)} readings, "
        f"{gbps[0]:.0f}-{gbps[-1]:.0f})"
        if device
        else "no device bandwidth measured"
    ]
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    by = {(r["format"], r["op"], r["context"]): r for r in rows}
    decode = sorted({r["context"] for r in rows if r["op"] == "decode"})
    prefill = sorted({r["context"] for r in rows if r["op"] == "prefill"})
    if decode:
        lines.append("decode ms (fraction of HBM read bandwidth)")
        lines.append(f"  {'format':<10}" + "".join(f"{_ctx(n):>14}" for n in decode))
        for f in fmts:
            cells = [by.get((f, "decode", n)) for n in decode]
            lines.append(
                f"  {f:<10}"
                + "".join(f"{c['median_ms']:>7.3f} ({c['frac_bw']:.2f})" if c else f"{'-':>14}" for c in cells)
            )
    top, ptop = max(decode, default=0), max(prefill, default=0)

    def ratio(c: dict | None) -> str:
        x = c and c.get("speedup_vs_sdpa_bf16")
        return f"{x:>8.2f}x" if x else f"{'-':>9}"

    if prefill or top:
        head = "".join(f"{'prefill ' + _ctx(n) + ' ms':>16}{'TFLOP/s':>9}" for n in prefill)
        head += f"{'load ' + _ctx(top) + ' GB/s':>18}{'of bw':>7}"
        head += "   vs torch SDPA bf16:" + (f" prefill {_ctx(ptop)}," if ptop else "") + f" decode {_ctx(top)}"
        lines.append(f"  {'format':<10}{head}")
        for f in fmts:
            cells = ""
            for n in prefill:
                c = by.get((f, "prefill", n))
                cells += f"{c['median_ms']:>16.3f}{c['gflops'] / 1e3:>9.2f}" if c else f"{'-':>16}{'-':>9}"
            ld = by.get((f, "load", top))
            cells += f"{ld['gbps']:>18.1f}{ld['frac_bw']:>7.2f}" if ld else f"{'-':>18}{'-':>7}"
            cells += "   " + (ratio(by.get((f, "prefill", ptop))) if ptop else "") + ratio(by.get((f, "decode", top)))
            lines.append(f"  {f:<10}{cells}")
    long = [n for n in decode if n >= 32768]
    if long:
        fracs = {f: [by[(f, "decode", n)]["frac_bw"] for n in long if (f, "decode", n) in by] for f in fmts}
        worst = {f: min(x) for f, x in fracs.items() if x}
        lines.append(
            f"decode at {_ctx(long[0])}+ vs the {TARGET} target: "
            + ", ".join(f"{f} {w:.2f}{'' if w >= TARGET else ' (below)'}" for f, w in worst.items())
        )
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return lines


def merge(parts: Path, out: Path) -> int:
    """One bench result of the per-format runs in ``parts`` (in the order they ran): their rows and bandwidth
    readings together, and each row's SDPA ratios from the one run that timed SDPA."""
    files = sorted(parts.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    if not files:
        print(f"gpu-check: no bench results in {parts}", file=sys.stderr)
        return 1
    results = [json.loads(f.read_text()) for f in files]
    merged = dict(results[0], rows=[], bandwidth=[], notes=[])
    for r in results:
        merged["rows"] += r["rows"]
        merged["bandwidth"] += r["bandwidth"]
        merged["notes"] += [n for n in r["notes"] if n not in merged["notes"]]
    base = {
        (r["format"], r["op"], r["context"]): r["median_ms"]
        for r in merged["rows"]
        if r["backend"].startswith("torch-sdpa")
    }
    for r in merged["rows"]:
        if not r["backend"].startswith("torch-sdpa") and ("f32", r["op"], r["context"]) in base:
            r["speedup_vs_sdpa_f32"] = base[("f32", r["op"], r["context"])] / r["median_ms"]
            r["speedup_vs_sdpa_bf16"] = base[("bf16", r["op"], r["context"])] / r["median_ms"]
    out.write_text(json.dumps(merged, indent=2))
    return 0


def targets(path: Path, route: str) -> list[str]:
    """One line per target format: prefill at PREFILL_CTX as a multiple of torch SDPA bf16, decode at DECODE_CTX as a
    fraction of the HBM read bandwidth, each marked ok / below, or "-" where it was not measured."""
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    by = {(r["format"], r["op"], r["context"]): r for r in rows if not r["backend"].startswith("torch-sdpa")}

    def cell(x: float | None, target: float, unit: str) -> str:
        return f"{'-':>6}{'':<9}" if x is None else f"{x:>6.2f}{unit} {'ok' if x >= target else 'below':<6}"

    lines = [
        f"targets (prefill route: {route}): prefill {_ctx(PREFILL_CTX)} >= {PREFILL_TARGET}x torch SDPA bf16, "
        f"decode {_ctx(DECODE_CTX)} >= {TARGET} of HBM read"
    ]
    for f in TARGET_FORMATS:
        pre = by.get((f, "prefill", PREFILL_CTX), {}).get("speedup_vs_sdpa_bf16")
        dec = by.get((f, "decode", DECODE_CTX), {}).get("frac_bw")
        lines.append(f"  {f:<10}prefill {cell(pre, PREFILL_TARGET, 'x')}  decode {cell(dec, TARGET, ' ')}")
    return lines


def tail(log: Path, n: int = 3) -> list[str]:
    if not log.is_file():
        return []
    return [line[:160] for line in log.read_text(errors="replace").splitlines()[-n:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", type=Path, help="merge the bench JSONs in this folder into -o, then exit")
    ap.add_argument("-o", type=Path, dest="merged")
    ap.add_argument("--python", default="", help="venv, or system: the image's python3 and its cupy")
    ap.add_argument("--step", action="append", default=[], help="NAME=STATUS=SECONDS, in order")
    ap.add_argument("--gpu", default="")
    ap.add_argument("--driver-cuda", default="")
    ap.add_argument("--cuda", default="")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--prefill-route", default="unknown", help="sdpa or kernel: what the cuda backend's prefill ran")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.merged:
            ap.error("--merge needs -o FILE")
        return merge(args.merge, args.merged)
    if not args.out:
        ap.error("--out is required")
    steps = [s.split("=", 2) for s in args.step]
    lines = ["=" * 30 + " gpu-check " + "=" * 30]
    if args.gpu:
        via = "the image's python3 and cupy" if args.python == "system" else f"a venv with cupy-cuda{args.cuda}x"
        lines.append(f"gpu       {args.gpu}; driver CUDA {args.driver_cuda} -> {via}")
    total = 0
    for name, status, secs in steps:
        total += int(secs)
        line = f"{name:<9} {status}" + (f", {secs} s" if status != "not run" else "")
        if name == "tests" and status != "not run":
            line += f": {contract(args.out / 'contract.xml')} (tests/contract + backends/cuda/tests, KVHAL_STRICT=1)"
        lines.append(line)
        if name == "bench" and status != "not run":
            lines += [" " * 10 + b for b in bench(args.out / "bench-cuda.json")]
            lines += [" " * 10 + t for t in targets(args.out / "bench-cuda.json", args.prefill_route)]
        if status not in ("ok", "not run"):
            lines += [" " * 10 + "| " + t for t in tail(args.out / f"{name}.log")]
    ok = bool(steps) and all(s == "ok" for _, s, _ in steps)
    lines.append(f"total     {total} s" + (f" of a {args.budget} s budget" if args.budget else ""))
    lines.append(f"outputs   {args.out}")
    lines.append(f"result    {'PASS' if ok else 'FAIL'}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
