"""The kvhal command: ``info``, ``bench``, ``stress``, ``plan``, ``eval``, ``snapshot``, ``convert`` and ``tiers`` (``--json``
on each)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from .. import formats
from ..backend import FUSED, OPS
from ..errors import KVHalError, SpecError
from ..registry import backends
from ..spec import CacheSpec
from . import convert, fidelity, plan
from .output import output_path, write_json

SPEC_DEFAULTS: dict[str, Any] = {"n_layers": 32, "n_kv_heads": 8, "head_dim": 128, "k_format": "f16", "v_format": "f16"}


def parse_spec(text: str) -> CacheSpec:
    """``head_dim=512,k_format=q8_0`` over a Llama-8B-like default spec."""
    fields = dict(SPEC_DEFAULTS)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in CacheSpec.__dataclass_fields__:
            names = ", ".join(CacheSpec.__dataclass_fields__)
            raise SpecError(f"--spec item {item!r} is not FIELD=VALUE with a CacheSpec field ({names})")
        fields[key] = _spec_field(key, value)
    return CacheSpec(**fields)


def _spec_field(key: str, value: str) -> Any:
    """A --spec value as the field takes it: names and paths as text, a scale as a number or "calibrate"."""
    if key.endswith(("_format", "_rotation", "_side")) or value == "calibrate":
        return value
    try:
        return float(value) if key.endswith("_scale") else int(value)
    except ValueError:
        kind = 'a number or "calibrate"' if key.endswith("_scale") else "an integer"
        raise SpecError(f"--spec {key}={value!r}: {key} takes {kind}") from None


def _v_only(b: Any) -> dict[str, str]:
    """Per-channel K formats (kivi) that ``b`` runs as V only: format -> why it refuses them as K."""
    out = {}
    for f in formats.names():
        if b.available and f in b.formats and formats.get(f).k_page is not None:
            as_k = CacheSpec(**{**SPEC_DEFAULTS, "k_format": f, "v_format": f})
            as_v = CacheSpec(**{**SPEC_DEFAULTS, "v_format": f})
            why = b.refusal(as_k)
            if why is not None and b.refusal(as_v) is None:
                out[f] = why
    return out


def info_data(spec: CacheSpec | None = None) -> dict[str, Any]:
    out = []
    for b in backends():
        row: dict[str, Any] = {
            "name": b.name,
            "available": b.available,
            "score": b.score,
            "device": b.device,
            "reason": b.reason,
            "formats": {f: list(OPS) if f in b.formats else [] for f in formats.names()},
            "v_only": _v_only(b),
            # FUSED ops it runs natively; the others run on the host in float64 (over load)
            "fused": sorted(b.cls.fused) if b.cls is not None else [],
            "host_fallback": [op for op in FUSED if b.cls is None or op not in b.cls.fused],
        }
        if spec is not None:
            row["spec_refused"] = b.refusal(spec)  # None: takes it
        out.append(row)
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
    data: dict[str, Any] = {"backends": out, "formats": fmts}
    if spec is not None:
        # kltq side data by its digest, as the fingerprint has it: asdict would give its arrays (not JSON)
        data["spec"] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        for name in ("k_side", "v_side"):
            data["spec"][name] = None if getattr(spec, name) is None else getattr(spec, name).digest()
    return data


def info_text(data: dict[str, Any]) -> str:
    names = [f["name"] for f in data["formats"]]
    lines = ["backends (best first; 'auto' picks the first available that runs the formats):"]
    for b in data["backends"]:
        state = f"score {b['score']}" if b["available"] else "unavailable"
        dev = f" [{b['device']}]" if b["device"] else ""
        lines.append(f"  {b['name']:<10} {state:<12}{dev} {b['reason']}")
    lines.append("")
    lines.append("support (S store, L load, A attention; * as V only, K refused; of attention_lse, attention_mass and")
    lines.append("value transforms, native: run by the backend; host f64: run on the host in float64):")
    width = {n: max(5, len(n)) for n in names}
    lines.append("  " + f"{'':<10} " + " ".join(f"{n:>{width[n]}}" for n in names) + f"  {'native':<14} host f64")
    for b in data["backends"]:
        cells = ["".join(op[0].upper() for op in b["formats"][n]) if b["available"] else "-" for n in names]
        cells = [(c or "-") + ("*" if n in b["v_only"] else "") for c, n in zip(cells, names)]
        row = " ".join(f"{c:>{width[n]}}" for c, n in zip(cells, names))
        native, host = (",".join(o.removeprefix("attention_") for o in b[k]) or "-" for k in ("fused", "host_fallback"))
        lines.append("  " + f"{b['name']:<10} " + row + f"  {native:<14} {host}")
    lines.append("")
    lines.append("formats: " + ", ".join(f"{f['name']} {f['bits_per_element']:g} bits" for f in data["formats"]))
    if "spec" in data:
        lines.append("")
        lines.append("spec " + ", ".join(f"{k}={v}" for k, v in data["spec"].items()) + ":")
        for b in data["backends"]:
            lines.append(
                f"  {b['name']:<10} " + ("takes it" if b["spec_refused"] is None else f"refuses: {b['spec_refused']}")
            )
    return "\n".join(lines)


def snapshot_text(r: dict[str, Any]) -> str:
    fp, spec = r["fingerprint"] or {}, r["spec"] or {}
    verdict = "ok: restorable into a cache of this fingerprint" if r["ok"] else f"REFUSED: {r['error']}"
    lines = [
        f"{r['path']}: {r['bytes']} bytes, snapshot v{r['snapshot_version']}, format v{r['format_version']}",
        f"  fingerprint  model={fp.get('model')!r} extra={fp.get('extra')} digest={str(fp.get('digest'))[:16]}...",
        "  spec         " + ", ".join(f"{k}={v}" for k, v in spec.items()),
        f"  blocks       {r['n_blocks']}",
    ]
    for i, s in enumerate(r["seqs"]):
        lines.append(f"  seq {i:<8} {s['tokens']} tokens, {s['hashed_blocks']} hashed blocks")
    bad = {k: v for k, v in r["checksums"].items() if v != "ok"}
    lines.append(f"  checksums    {len(r['checksums']) - len(bad)}/{len(r['checksums'])} tensors ok")
    lines += [f"    {k}: {v}" for k, v in bad.items()]
    lines.append(f"  verdict      {verdict}")
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


def _non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


MAX_THREADS = 1024  # past this a pool is all thread start-up (100000 did not finish in 90 s)


def _threads(text: str) -> list[int]:
    """A comma list of thread counts; 'all' is every core."""
    counts = [
        min(os.cpu_count() or 1, MAX_THREADS) if c.strip() == "all" else _positive(c.strip())
        for c in text.split(",")
        if c.strip()
    ]
    if not counts or max(counts) > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected thread counts from 1 to {MAX_THREADS} such as 1,2,all")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvhal", description="Quantized paged KV cache: backends and benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="backends, why any is unavailable, and the formats each runs")
    pi.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pi.add_argument(
        "--spec",
        metavar="FIELD=VALUE,...",
        help="also show which backends take this CacheSpec and why the others refuse "
        f"(over {','.join(f'{k}={v}' for k, v in SPEC_DEFAULTS.items())})",
    )
    pb = sub.add_parser("bench", help="store, load, decode and prefill attention per backend and format")
    pb.add_argument(
        "--backend",
        action="append",
        help="backend to run, or 'auto' (repeatable; default: every available one but the float64 reference)",
    )
    pb.add_argument(
        "--format",
        action="append",
        dest="formats",
        help="KV format or K/V pair such as f16/kivi4 (repeatable; default: all the backend runs)",
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
    pb.add_argument(
        "--lifecycle",
        action="store_true",
        help="instead: snapshot save/restore GB/s and prefix-hit time vs storing again (32x8x128 shape, q8_0 "
        "unless --format)",
    )
    pb.add_argument("--lifecycle-tokens", type=_positive, default=16384, help="tokens of the --lifecycle sequence")
    pb.add_argument(
        "--streaming",
        action="store_true",
        help="instead: decode attention over a long sequence streamed from host memory through a small arena vs "
        "the same sequence all resident (q4_0 unless --format)",
    )
    pb.add_argument("--streaming-tokens", type=_positive, default=262144, help="tokens of the --streaming sequence")
    pb.add_argument(
        "--arena-tokens", type=_positive, default=16384, help="--streaming: arena and resident-tail tokens each"
    )
    pst = sub.add_parser("stress", help="audit a cache past its capacity: every surviving token's bytes checked")
    pst.add_argument("--backend", default="reference", help="backend name (default: reference)")
    pst.add_argument("--k-format", default="q8_0")
    pst.add_argument("--v-format", default="q4_0")
    pst.add_argument("--steps", type=_positive, default=2000)
    pst.add_argument("--seed", type=_non_negative, default=0, help="replays a run exactly")
    pst.add_argument("--capacity", type=_positive, default=512, help="capacity_tokens of the cache")
    pst.add_argument("--block-size", type=_positive, default=8)
    pst.add_argument(
        "--tiers",
        default="",
        help="comma list of block tiers the cache writes down to and pulls back from "
        "(host,disk,redis; redis starts a private redis-server), every block audited byte for byte",
    )
    pst.add_argument(
        "--faults",
        action="store_true",
        help="with --tiers: kill -9 and restart the Redis server, truncate disk segments",
    )
    pst.add_argument("--json", action="store_true", help="print JSON instead of text")
    plan.add_parser(sub)
    fidelity.add_parser(sub)
    ps = sub.add_parser("snapshot", help="snapshot files: inspect FILE")
    ps_sub = ps.add_subparsers(dest="snapshot_cmd", required=True)
    psi = ps_sub.add_parser("inspect", help="header, fingerprint, tokens, blocks; every checksum verified")
    psi.add_argument("file")
    psi.add_argument("--json", action="store_true", help="print JSON instead of text")
    convert.add_parser(sub)
    from . import tiers_bench

    tiers_bench.add_arguments(sub.add_parser("tiers", help="block tiers (host RAM, disk, Redis): `kvhal tiers bench`"))
    args = p.parse_args(argv)
    try:
        if args.cmd == "tiers":
            return tiers_bench.main(args)
        if args.cmd == "plan":
            return plan.cli(args)
        if args.cmd == "eval" and args.evict:
            from . import evict_eval

            return evict_eval.cli(args)
        if args.cmd == "eval":
            if args.kvpress is not None:
                raise SpecError("--kvpress runs kvpress's presses beside the eviction policies: add --evict")
            return fidelity.cli(args)
        if args.cmd == "convert":
            return convert.cli(args)
        if args.cmd == "stress":
            from . import stress

            rep = stress.run(
                args.backend,
                args.k_format,
                args.v_format,
                args.steps,
                args.seed,
                args.capacity,
                args.block_size,
                show_progress=not args.json,
                tiers=args.tiers,
                faults=args.faults,
            )
            print(json.dumps(rep.as_dict(), indent=2) if args.json else stress.text(rep))
            return 1 if rep.failure or rep.tokens_lost else 0
        if args.cmd == "snapshot":
            from ..snapshot import inspect

            report = inspect(args.file)
            print(json.dumps(report, indent=2) if args.json else snapshot_text(report))
            return 0 if report["ok"] else 1
        if args.cmd == "info":
            data = info_data(parse_spec(args.spec) if args.spec is not None else None)
            print(json.dumps(data, indent=2) if args.json else info_text(data))
            return 0
        output_path(args.output)
        _check_bench_options(args)
        if args.lifecycle:
            from . import bench_lifecycle

            backend = (args.backend or ["auto"])[0]
            fmt = (args.formats or ["q8_0"])[0]
            life = bench_lifecycle.run(backend, fmt, args.lifecycle_tokens, repeats=args.repeats)
            write_json(args.output, life)
            print(json.dumps(life, indent=2) if args.json else bench_lifecycle.table(life))
            return 0
        if args.streaming:
            from . import bench_streaming

            res = bench_streaming.run(
                (args.backend or ["auto"])[0],
                (args.formats or ["q4_0"])[0],
                args.streaming_tokens,
                args.arena_tokens,
                args.arena_tokens,
                repeats=args.repeats,
                show_progress=not args.json,
            )
            write_json(args.output, res)
            print(json.dumps(res, indent=2) if args.json else bench_streaming.table(res))
            return 0
        from . import bench

        available = [b for b in backends() if b.available]
        # the reference is the spec, not a contender: its float64 prefill at 16k takes minutes a call
        names = args.backend or [b.name for b in available if b.name != "reference"] or ["reference"]
        if "auto" in names:  # the backend KVCache(backend="auto") would pick for f16
            from ..registry import resolve

            auto_spec = CacheSpec(**SPEC_DEFAULTS)
            names = [resolve("auto", auto_spec).name if n == "auto" else n for n in names]
        by_name = {b.name: b for b in backends()}
        jobs_formats = args.formats or formats.plain_names()  # kltq (a K format with side data): --format kltq:B/q8_0
        for n in names:
            if n not in by_name or not by_name[n].available:
                why = by_name[n].reason if n in by_name else "not installed"
                raise KVHalError(f"backend {n!r} is unavailable: {why} (see `kvhal info`)")
        jobs = [
            (n, bench.job_format(n, f))
            for n in names
            for f in jobs_formats
            if all(part in by_name[n].formats for part in f.split("/"))  # a format, or a K/V pair
        ]
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
        write_json(args.output, result)
        print(json.dumps(result, indent=2) if args.json else bench.table(result))
        return 0
    except KVHalError as e:
        print(f"kvhal: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # a size this machine cannot hold, found where it was allocated
        print(f"kvhal: error: not enough memory for the sizes asked ({e}); ask for less", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvhal info | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _check_bench_options(args: argparse.Namespace) -> None:
    """The bench's modes take one backend and format each; options of another mode are refused, not ignored."""
    if args.lifecycle and args.streaming:
        raise KVHalError("--lifecycle and --streaming are two runs: pass one")
    mode = "--lifecycle" if args.lifecycle else "--streaming" if args.streaming else None
    if mode:
        for opt, value in (("--backend", args.backend), ("--format", args.formats)):
            if value and len(value) > 1:
                raise KVHalError(f"{mode} runs one backend and one format: {opt} given {len(value)} times")
        if args.threads:
            raise KVHalError(f"{mode} runs at the backend's default threads: drop --threads")
    elif not args.contexts and (args.no_prefill or not args.prefill_contexts):
        raise KVHalError("nothing to measure: give --contexts or --prefill-contexts at least one length, such as 4096")


if __name__ == "__main__":
    sys.exit(main())
