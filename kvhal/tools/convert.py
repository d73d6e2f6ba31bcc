"""``kvhal convert IN OUT``: llama.cpp sequence-state files (``.ggsq``) <-> kvhal snapshots (``.kvs``), byte for byte.

The format comes from each file's extension. A ``.ggsq`` file is what ``llama_state_seq_save_file`` writes
(magic, version, token ids, the sequence's KV state); a ``.kvs`` file is a kvhal snapshot holding one sequence.
The head split comes from ``--kv-heads N`` or the GGUF model itself (``--model M.gguf``, which also checks the
state is that model's and names it in the snapshot's fingerprint). A quantized state needs
``--llama-rotation on|off``: llama.cpp rotates quantized K/V unless run with ``LLAMA_ATTN_ROT_DISABLE=1``, and
the file does not say.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..errors import SpecError
from .output import output_path

KINDS = {".ggsq": "llama.cpp", ".kvs": "kvhal"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "convert",
        help="llama.cpp sequence-state files (.ggsq) <-> kvhal snapshots (.kvs), byte for byte",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", metavar="IN", help="a .ggsq (llama_state_seq_save_file) or .kvs (kvhal snapshot) file")
    p.add_argument("output", metavar="OUT", help="the file to write, of the other kind")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--kv-heads", type=int, help="the model's KV heads (splits a token's row into heads)")
    heads.add_argument("--model", help="the GGUF model the state belongs to: KV heads, layers, fingerprint")
    p.add_argument(
        "--llama-rotation",
        choices=("on", "off"),
        help="whether llama.cpp rotated quantized K/V (on: its default; off: LLAMA_ATTN_ROT_DISABLE=1); "
        "required for a quantized .ggsq",
    )
    p.add_argument(
        "--v-layout",
        choices=("rows", "transposed"),
        default=None,
        help="V as llama.cpp holds it (.kvs -> .ggsq): rows with flash attention (default, llama.cpp's default "
        "on CPU), transposed without (f16/f32/bf16 only)",
    )
    p.add_argument("--block-size", type=int, default=None, help="tokens per kvhal page (.ggsq -> .kvs; default 16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _kind(path: str) -> str:
    kind = KINDS.get(Path(path).suffix.lower())
    if kind is None:
        raise SpecError(
            f"{path!r}: kvhal convert takes .ggsq (llama.cpp sequence state) and .kvs (kvhal snapshot) files"
        )
    return kind


def _check_options(args: argparse.Namespace, src: str) -> None:
    """Refuse the options that do not apply to this direction (they would be ignored), and bad values."""
    given = {
        "--v-layout": args.v_layout is not None,
        "--block-size": args.block_size is not None,
    }
    other = {"llama.cpp": ["--v-layout"], "kvhal": ["--block-size"]}[src]
    wrong = [flag for flag in other if given[flag]]
    if wrong:
        direction = ".ggsq -> .kvs" if src == "llama.cpp" else ".kvs -> .ggsq"
        applies = ".kvs -> .ggsq" if src == "llama.cpp" else ".ggsq -> .kvs"
        raise SpecError(f"{' and '.join(wrong)} applies to {applies} only, not to this {direction} conversion")
    if args.kv_heads is not None and args.kv_heads <= 0:
        raise SpecError(f"--kv-heads must be a positive number of KV heads, got {args.kv_heads}")
    if args.block_size is not None and args.block_size <= 0:
        raise SpecError(f"--block-size must be a positive number of tokens, got {args.block_size}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..cache import KVCache
    from ..interop import llamacpp

    src, dst = _kind(args.input), _kind(args.output)
    if src == dst:
        raise SpecError(f"IN and OUT are both {src} files; convert moves between .ggsq and .kvs")
    if not Path(args.input).is_file():
        raise SpecError(f"{args.input!r} does not exist")
    _check_options(args, src)
    output_path(args.output, "OUT")
    rotation = None if args.llama_rotation is None else args.llama_rotation == "on"
    model = llamacpp.model_info(args.model) if args.model else None
    t0 = time.perf_counter()
    if src == "llama.cpp":
        state = llamacpp.read_file(args.input)
        if model is not None:
            llamacpp.check_model(state, model)
        kv_heads = model["n_kv_heads"] if model is not None else args.kv_heads
        if kv_heads is None:
            raise SpecError("a .ggsq state needs the head split: pass --kv-heads N or --model M.gguf")
        cache, seq = llamacpp.import_state(
            state,
            kv_heads=kv_heads,
            llama_rotation=rotation,
            backend="reference",
            block_size=16 if args.block_size is None else args.block_size,
            model=model["fingerprint"] if model is not None else "",
        )
        cache.save(args.output, [seq])
        n, hashed = state.n_tokens, len(cache.seq_table.get(seq).hashes)
    else:
        cache, seqs = KVCache.from_snapshot(args.input, backend="reference")
        if len(seqs) != 1:
            raise SpecError(f"{args.input!r} holds {len(seqs)} sequences; a .ggsq file holds one")
        spec = cache.spec
        if args.kv_heads is not None and args.kv_heads != spec.n_kv_heads:
            raise SpecError(
                f"--kv-heads {args.kv_heads}, but the snapshot {args.input!r} holds {spec.n_kv_heads} KV heads: it "
                "is another model's cache (or drop --kv-heads: a .kvs file knows its heads)"
            )
        if rotation is not None:
            rotated = any(r == "hadamard-llama" for r in (spec.k_rotation, spec.v_rotation))
            quantized = any(f not in llamacpp.PLAIN for f in (spec.k_format, spec.v_format))
            if quantized and rotated != rotation:
                raise SpecError(
                    f"--llama-rotation {args.llama_rotation}, but the snapshot's K/V are "
                    f"{'rotated' if rotated else 'not rotated'} (k_rotation={spec.k_rotation!r}, "
                    f"v_rotation={spec.v_rotation!r}); llama.cpp must run "
                    f"{'with its default rotation' if rotated else 'with LLAMA_ATTN_ROT_DISABLE=1'}"
                )
        state = llamacpp.export_state(cache, seqs[0], v_trans=args.v_layout == "transposed")
        if model is not None:
            llamacpp.check_model(state, model)
        state.save(args.output)
        n, hashed = state.n_tokens, len(cache.seq_table.get(seqs[0]).hashes)
    spec = cache.spec
    return {
        "input": args.input,
        "output": args.output,
        "from": src,
        "to": dst,
        "tokens": n,
        "token_ids": len(cache.tokens(cache.seqs[0])),
        "hashed_blocks": hashed,
        "n_layers": spec.n_layers,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "k_format": spec.k_format,
        "v_format": spec.v_format,
        "k_rotation": spec.k_rotation,
        "v_rotation": spec.v_rotation,
        "model": cache.fingerprint.model,
        "bytes_in": Path(args.input).stat().st_size,
        "bytes_out": Path(args.output).stat().st_size,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def text(r: dict[str, Any]) -> str:
    rot = f"K {r['k_rotation'] or 'none'}, V {r['v_rotation'] or 'none'}"
    return "\n".join(
        [
            f"kvhal convert: {r['input']} ({r['from']}) -> {r['output']} ({r['to']})",
            f"  tokens        {r['tokens']} ({r['token_ids']} token ids, {r['hashed_blocks']} hashed blocks)",
            f"  layout        {r['n_layers']} layers x {r['n_kv_heads']} KV heads x {r['head_dim']}, "
            f"K {r['k_format']}, V {r['v_format']}",
            f"  rotation      {rot}",
            f"  model         {r['model'] or '(unnamed: pass --model M.gguf to name it)'}",
            f"  bytes         {r['bytes_in']} -> {r['bytes_out']} in {r['seconds']} s",
        ]
    )


def cli(args: argparse.Namespace) -> int:
    r = run(args)
    print(json.dumps(r, indent=2) if args.json else text(r))
    return 0
