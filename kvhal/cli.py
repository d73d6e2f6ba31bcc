"""The kvhal command: ``kvhal info`` and ``kvhal bench`` (``--json`` on both)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import formats
from .backend import OPS
from .errors import KVHalError
from .registry import backends


def info_data() -> dict[str, Any]:
    out = []
    for b in backends():
        out.append(
            {
                "name": b.name,
                "available": b.available,
                "score": b.score,
                "device": b.device,
                "reason": b.reason,
                "formats": {f: [op for op in OPS if b.supports(f, op)] for f in formats.names()},
            }
        )
    fmts = [
        {
            "name": f.name,
            "bits_per_element": f.bits_per_element,
            "block_len": f.block_len,
            "block_bytes": f.block_bytes,
            "ggml_type": f.ggml_type,
        }
        for f in map(formats.get, formats.names())
    ]
    return {"backends": out, "formats": fmts}


def info_text(data: dict[str, Any]) -> str:
    names = [f["name"] for f in data["formats"]]
    lines = ["backends (best first; 'auto' picks the first available that runs the formats):"]
    for b in data["backends"]:
        state = f"score {b['score']}" if b["available"] else "unavailable"
        dev = f" [{b['device']}]" if b["device"] else ""
        lines.append(f"  {b['name']:<10} {state:<12}{dev} {b['reason']}")
    lines.append("")
    lines.append("support (S store, L load, A attention):")
    lines.append("  " + f"{'':<10} " + " ".join(f"{n:>5}" for n in names))
    for b in data["backends"]:
        cells = ["".join(op[0].upper() for op in b["formats"][n]) or "-" for n in names]
        lines.append("  " + f"{b['name']:<10} " + " ".join(f"{c:>5}" for c in cells))
    lines.append("")
    lines.append("formats: " + ", ".join(f"{f['name']} {f['bits_per_element']:g} bits" for f in data["formats"]))
    return "\n".join(lines)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _ints(text: str) -> list[int]:
    """A comma list of positive ints ('' is none)."""
    return [_positive(c.strip()) for c in text.split(",") if c.strip()]


def _threads(text: str) -> list[int]:
    """A comma list of thread counts; 'all' is every core."""
    counts = [
        (os.cpu_count() or 1) if c.strip() == "all" else _positive(c.strip()) for c in text.split(",") if c.strip()
    ]
    if not counts:
        raise argparse.ArgumentTypeError("expected thread counts such as 1,2,all")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvhal", description="Quantized paged KV cache: backends and benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="backends, why any is unavailable, and the formats each runs")
    pi.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pb = sub.add_parser("bench", help="store, load, decode and prefill attention per backend and format")
    pb.add_argument(
        "--backend",
        action="append",
        help="backend to run, or 'auto' (repeatable; default: every available one but the float64 reference)",
    )
    pb.add_argument(
        "--format", action="append", dest="formats", help="KV format (repeatable; default: all the backend runs)"
    )
    pb.add_argument("--contexts", type=_ints, default="4096,16384,32768", help="decode context lengths (comma list)")
    pb.add_argument(
        "--prefill-contexts",
        type=_ints,
        default="4096,16384",
        help="contexts the prefill queries attend over, causal (comma list; '' for none)",
    )
    pb.add_argument("--prefill-queries", type=_positive, default=512, help="queries per prefill call (default 512)")
    pb.add_argument("--no-prefill", action="store_true", help="skip prefill attention")
    pb.add_argument(
        "--threads",
        type=_threads,
        help="re-run every figure at these host thread counts, e.g. 1,2,all (the cpu backend's threads option "
        "and torch's; backends without the option run once)",
    )
    pb.add_argument("--repeats", type=_positive, default=5, help="timed runs per figure (median reported)")
    pb.add_argument("--no-sdpa", action="store_true", help="skip the PyTorch SDPA baseline")
    pb.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pb.add_argument("-o", "--output", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    try:
        if args.cmd == "info":
            data = info_data()
            print(json.dumps(data, indent=2) if args.json else info_text(data))
            return 0
        from . import bench

        available = [b for b in backends() if b.available]
        # the reference is the spec, not a contender: its float64 prefill at 16k takes minutes a call
        names = args.backend or [b.name for b in available if b.name != "reference"] or ["reference"]
        if "auto" in names:  # the backend KVCache(backend="auto") would pick for f16
            from .registry import resolve

            names = [resolve("auto", ["f16"]).name if n == "auto" else n for n in names]
        by_name = {b.name: b for b in backends()}
        jobs_formats = args.formats or formats.names()
        for n in names:
            if n not in by_name or not by_name[n].available:
                why = by_name[n].reason if n in by_name else "not installed"
                raise KVHalError(f"backend {n!r} is unavailable: {why} (see `kvhal info`)")
        jobs = [(n, f) for n in names for f in jobs_formats if by_name[n].supports(f, "attention")]
        if not jobs:
            raise KVHalError(f"none of {names} runs attention on {jobs_formats} (see `kvhal info`)")
        result = bench.run(
            jobs,
            args.contexts,
            args.repeats,
            show_progress=not args.json,
            sdpa=not args.no_sdpa,
            prefill_contexts=[] if args.no_prefill else args.prefill_contexts,
            prefill_queries=args.prefill_queries,
            threads=args.threads,
        )
        if args.output:
            with open(args.output, "w") as fh:
                json.dump(result, fh, indent=2)
        print(json.dumps(result, indent=2) if args.json else bench.table(result))
        return 0
    except KVHalError as e:
        print(f"kvhal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
