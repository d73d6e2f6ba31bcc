"""Generate with a transformers model through kvhal: decode tokens/s and cache bytes next to DynamicCache.

The model is a Llama with seeded random weights, shaped so attention matters at long context (32 query
heads over 8 KV heads of head_dim 128, small hidden and MLP). Each run is one ``model.generate`` call
(greedy, batch 1) on a random prompt of ``context`` tokens; a logits processor stamps every step, and
tokens/s is one over the median step after the warm-up steps. Cache bytes are those holding the tokens
at the end: the f32 tensors of transformers' caches (DynamicCache grows by concatenation, StaticCache is
allocated for the whole generation up front), kvhal's pages in use. Both baselines run SDPA.

    python examples/transformers_generate.py                        # q8_0 vs DynamicCache, 1k context
    python examples/transformers_generate.py --backend cpu --formats f32,q8_0,q4_0 --contexts 1024,8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
)

from kvhal.integrations.transformers import KVHalCache
from kvhal.progress import progress


class StepClock(LogitsProcessor):
    """Stamps each generation step (the processor runs once per new token)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


BASELINES = {"dynamic": "DynamicCache f32", "static": "StaticCache f32"}


def bench_model(layers: int, max_len: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max_len,
    )
    return LlamaForCausalLM(config).eval()


def cache_bytes(cache: Any) -> int:
    if isinstance(cache, KVHalCache):
        st = cache.kv.stats()
        return st.blocks_used * st.block_size * st.bytes_per_token
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run_one(
    model: LlamaForCausalLM, prompt: torch.Tensor, fmt: str, backend: str, warmup: int, steps: int
) -> dict[str, Any]:
    context = prompt.shape[1]
    new_tokens = warmup + steps + 1
    if fmt == "dynamic":
        model.set_attn_implementation("sdpa")
        cache: Any = DynamicCache(config=model.config)
    elif fmt == "static":
        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=model.config, max_cache_len=context + new_tokens)
    else:
        model.set_attn_implementation("kvhal")
        cache = KVHalCache.from_model(
            model, k_format=fmt, v_format=fmt, capacity_tokens=context + warmup + steps + 16, backend=backend
        )
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    step_s = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][warmup:]
    return {
        "cache": BASELINES.get(fmt, f"kvhal {fmt}"),
        "backend": cache.kv.backend.name if isinstance(cache, KVHalCache) else "torch",
        "context": context,
        "tokens_per_s": 1.0 / statistics.median(step_s),
        "cache_bytes": cache_bytes(cache),
        "tokens": out[0, context:].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", help="kvhal backend (default: auto)")
    p.add_argument("--formats", default="q8_0", help="comma list of kvhal K/V formats (default: q8_0)")
    p.add_argument("--contexts", default="1024", help="comma list of prompt lengths (default: 1024)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps not timed (default: 4)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed, median reported (default: 32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    kinds = [*BASELINES, *(f for f in args.formats.split(",") if f)]
    model = bench_model(args.layers, max(contexts) + args.warmup + args.steps + 16)
    prompts = {
        n: torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        for n in contexts
    }
    jobs = [(n, k) for n in contexts for k in kinds]
    rows = [
        run_one(model, prompts[n], k, args.backend, args.warmup, args.steps)
        for n, k in progress(jobs, len(jobs), "generate", not args.json)
    ]
    for r in rows:  # same prompt, same weights: the f32 DynamicCache run is the reference
        ref = next(x for x in rows if x["context"] == r["context"] and x["cache"] == "DynamicCache f32")
        r["speed_vs_dynamic"] = r["tokens_per_s"] / ref["tokens_per_s"]
        r["bytes_vs_dynamic"] = r["cache_bytes"] / ref["cache_bytes"]
        r["same_tokens_as_dynamic"] = sum(a == b for a, b in zip(r["tokens"], ref["tokens"])) / len(ref["tokens"])
    for r in rows:
        del r["tokens"]
    cfg = model.config
    result = {
        "model": f"Llama, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads / {cfg.num_key_value_heads} "
        f"kv heads / head_dim {cfg.head_dim}, hidden {cfg.hidden_size}, random weights",
        "torch_threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "steps": args.steps,
        "rows": rows,
    }
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['model']}; torch threads {result['torch_threads']}; median of {args.steps} decode steps after {args.warmup}"
    )
    print(
        f"{'cache':<18} {'backend':<9} {'context':>7} {'tok/s':>8} {'x dyn':>6} {'cache MB':>9} {'x dyn':>6} {'same tok':>8}"
    )
    for r in rows:
        print(
            f"{r['cache']:<18} {r['backend']:<9} {r['context']:>7} {r['tokens_per_s']:>8.1f} {r['speed_vs_dynamic']:>6.2f} "
            f"{r['cache_bytes'] / 1e6:>9.1f} {r['bytes_vs_dynamic']:>6.2f} {r['same_tokens_as_dynamic']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
