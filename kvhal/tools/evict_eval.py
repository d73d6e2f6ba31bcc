"""``kvhal eval --evict``: eviction policies on a real model, kvpress's protocol.

The packaged SmolLM2-135M-Instruct (``fidelity_model``) reads the first ``--tokens`` tokens of kvhal's passage
(the context), which a ``KVHalCache`` with ``press=policy, keep=--keep`` compresses after its prefill; then it
reads a question about the passage. The figure is the KL divergence of the first answer token's distribution
from the one an uncompressed float32 ``DynamicCache`` gives (transformers' SDPA), as kvpress's evaluation
measures it; beside it, the pages the compression freed and the prefill's time against the same prefill
without eviction (scoring included: ``observe=True`` on every layer), measured side by side in this run.

``--kvpress PYTHON`` runs kvpress's presses on the same protocol beside them: PYTHON is the interpreter of an
environment where kvpress is installed (it pins transformers < 5.3, so it has its own); it runs
``kvpress_side.py`` (which imports no kvhal) on the model this side saved with ``save_pretrained`` (the same float32
weights), the same token ids, and this side's reference distribution, so both columns' KL share one reference.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KVHalError, SpecError
from ..eviction import H2O, AdaKV, ExpectedAttention, Knorm, Policy, SinkWindow, SnapKV

QUESTION = "\n\nQuestion: Who was the first keeper of the lighthouse at Carrow Point, and when did he arrive?\nAnswer:"
DEFAULT_TOKENS = 1628
# the environment --kvpress PYTHON needs (torch==2.13.0: the CPU build where pip finds it locally)
KVPRESS_PIP = "pip install kvpress==0.5.5 'transformers<5.3' torch==2.13.0 numpy"
KVPRESS_VENV = f"python -m venv kvpress-venv && kvpress-venv/bin/{KVPRESS_PIP}"
SIDE = Path(__file__).with_name("kvpress_side.py")
# a kvhal policy's label (its longest matching prefix) -> the kvpress press with the same rule (kvpress_side.PRESSES)
KVPRESS_PAIRS = {
    "SinkWindow": "StreamingLLMPress",
    "SnapKV": "SnapKVPress",
    "H2O": "ObservedAttentionPress",
    "Knorm": "KnormPress",
    "AdaKV(SnapKV": "AdaKVPress(SnapKVPress)",
    "ExpectedAttention": "ExpectedAttentionPress",
    "AdaKV(ExpectedAttention)": "AdaKVPress(ExpectedAttentionPress)",
    "AdaKV(ExpectedAttn, 1, 1)": "ExpectedAttentionPress",  # per layer and head, kvpress's own choice
}


@dataclass(frozen=True)
class EvictRow:
    policy: str
    kl: float  # KL(uncompressed || compressed) of the first answer token, nats
    top1_same: bool  # the same most likely first answer token as the uncompressed cache
    kept_tokens: int
    blocks_before: int
    blocks_after: int
    pages_freed: float  # fraction of the context's pages returned to the free list
    bytes_held: int
    prefill_s: float
    prefill_ratio: (
        float  # this prefill (scoring + eviction) over the mean of the plain prefills run just before and after
    )


def policies(n: int, keep: float) -> dict[str, Policy]:
    k = int(n * keep)
    return {
        "SinkWindow(sinks=4)": SinkWindow(sinks=4),
        "SnapKV(window=64, kernel=5)": SnapKV(window=64, kernel=5),
        f"H2O({k // 2}, {k - k // 2})": H2O(heavy=k // 2, recent=k - k // 2),
        "Knorm": Knorm(),
        "AdaKV(SnapKV(64, 5))": AdaKV(SnapKV(window=64, kernel=5)),
        "ExpectedAttention": ExpectedAttention(),
        "AdaKV(ExpectedAttention)": AdaKV(ExpectedAttention()),
        # every head its own best `keep`: kvpress's ExpectedAttentionPress choice (per layer and head), pages freed
        "AdaKV(ExpectedAttn, 1, 1)": AdaKV(ExpectedAttention(), ceiling=1.0, safeguard=1.0),
    }


def chosen(n: int, keep: float, names: str | None) -> dict[str, Policy]:
    """``policies`` whose labels start with one of the comma-separated ``names`` (all when None)."""
    every = policies(n, keep)
    if names is None:
        return every
    wanted = [x.strip() for x in names.split(",") if x.strip()]
    out = {label: p for label, p in every.items() if any(label.startswith(w) for w in wanted)}
    missing = [w for w in wanted if not any(label.startswith(w) for label in every)]
    if missing or not out:
        raise SpecError(f"--policies {names!r}: {missing or wanted} name none of {list(every)}")
    return out


def kvpress_pair(label: str) -> str | None:
    """The kvpress press paired with kvhal's policy ``label`` (``"none"`` with ``"none"``), or None."""
    if label == "none":
        return "none"
    keys = [k for k in KVPRESS_PAIRS if label.startswith(k)]
    return KVPRESS_PAIRS[max(keys, key=len)] if keys else None


def check_kvpress(python: str) -> str:
    """``python`` as an interpreter that imports kvpress, transformers, torch and numpy: its kvpress version."""
    how = f"make one with: {KVPRESS_VENV}, then pass --kvpress kvpress-venv/bin/python"
    if not isinstance(python, str) or not python:
        raise SpecError(f"--kvpress takes the path of a Python interpreter, got {python!r}; {how}")
    path = Path(python)
    if not path.is_file():
        raise SpecError(f"--kvpress {python!r} is not a file; {how}")
    probe = "import kvpress, numpy, torch, transformers, importlib.metadata as m; print(m.version('kvpress'))"
    try:
        p = subprocess.run([str(path), "-I", "-c", probe], capture_output=True, text=True, timeout=600)
    except OSError as e:
        raise SpecError(f"--kvpress {python!r} does not run ({e}); {how}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SpecError(f"--kvpress {python!r} cannot import kvpress, numpy, torch and transformers ({last}); {how}")
    return p.stdout.strip().splitlines()[-1]


def run_kvpress(
    python: str, lm: Any, context_ids: list[int], question_ids: list[int], keep: float, presses: list[str],
    ref: np.ndarray,
) -> dict[str, Any]:  # fmt: skip
    """kvpress's rows: ``kvpress_side.py`` under ``python`` on ``lm``'s weights, saved to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="kvhal-kvpress-") as tmp:
        # a GGUF-loaded model refuses save_pretrained (its config names the GGUF quantization), though its weights
        # are dense float32 here: copy them into a model of the same config without it
        config = copy.deepcopy(lm.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        dense = type(lm)(config)
        dense.load_state_dict(lm.state_dict())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            dense.save_pretrained(f"{tmp}/model")
        del dense
        np.save(f"{tmp}/reference.npy", ref)
        req = {"model_dir": f"{tmp}/model", "context_ids": context_ids, "question_ids": question_ids,
               "keep": keep, "presses": presses, "reference": f"{tmp}/reference.npy"}  # fmt: skip
        p = subprocess.run([python, "-I", str(SIDE)], input=json.dumps(req), capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = "\n".join(p.stderr.strip().splitlines()[-15:])
        raise KVHalError(f"kvpress's side ({python} {SIDE.name}) failed with exit status {p.returncode}:\n{tail}\n"
                         f"its environment needs: {KVPRESS_PIP}")  # fmt: skip
    out: dict[str, Any] = json.loads(lines[-1])
    out["python"] = python
    return out


def _load(model: str | None) -> tuple[Any, Any, str]:
    from . import fidelity_model

    tok, lm, path = fidelity_model.load(model, command="kvhal eval --evict")
    return tok, lm.eval(), path.name


def run(
    model: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    keep: float = 0.5,
    k_format: str = "f16",
    v_format: str = "f16",
    backend: str = "auto",
    block_size: int = 16,
    names: str | None = None,
    kvpress: str | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``options``: more ``CacheSpec`` keywords (``tail``, ``sinks``: a descriptor's modifiers)."""
    import torch
    import transformers

    from ..integrations.transformers import KVHalCache

    tok, lm, name = _load(model)
    from . import fidelity_model

    ctx = tok(fidelity_model.passage(), return_tensors="pt").input_ids
    if ctx.shape[1] < tokens:
        raise SpecError(f"--tokens {tokens}: the passage is {ctx.shape[1]} tokens of this model's tokenizer")
    ctx = ctx[:, :tokens]
    question = tok(QUESTION, return_tensors="pt", add_special_tokens=False).input_ids
    n_q = question.shape[1]
    mask = torch.ones(1, tokens + n_q, dtype=torch.long)

    def answer_logp(cache: Any) -> np.ndarray:
        with torch.inference_mode():
            out = lm(question, attention_mask=mask, cache=cache)
        return torch.log_softmax(out.logits[0, -1].double(), -1).numpy()

    lm.set_attn_implementation("sdpa")
    ref_cache = transformers.DynamicCache(config=lm.config)
    with torch.inference_mode():
        lm(ctx, cache=ref_cache)
    ref = answer_logp(ref_cache)
    labels = ["none", *chosen(tokens, keep, names)]
    side = None
    if kvpress is not None:
        presses = list(dict.fromkeys(p for p in map(kvpress_pair, labels) if p is not None))
        side = run_kvpress(kvpress, lm, ctx[0].tolist(), question[0].tolist(), keep, presses, ref)
    lm.set_attn_implementation("kvhal")

    def prefill(press: Policy | None) -> tuple[Any, float]:
        cache = KVHalCache.from_model(
            lm,
            capacity_tokens=tokens + n_q + block_size,
            k_format=k_format,
            v_format=v_format,
            backend=backend,
            block_size=block_size,
            press=press,
            keep=None if press is None else keep,
            **(options or {}),
        )
        t0 = time.perf_counter()
        with torch.inference_mode():
            lm(ctx, cache=cache)
        return cache, time.perf_counter() - t0

    plain, t_plain = prefill(None)
    before = plain.kv.stats().blocks_used
    rows = [_row("none", plain, ref, answer_logp(plain), tokens, before, t_plain, t_plain)]
    times = [t_plain]
    for label, press in chosen(tokens, keep, names).items():
        cache, t = prefill(press)
        _, t_again = prefill(None)  # the plain prefill again, right after: the load drifts on a shared machine
        times.append(t_again)
        rows.append(_row(label, cache, ref, answer_logp(cache), tokens, before, t, (times[-2] + t_again) / 2))
    return {
        "model": name,
        "backend": plain.kv.backend.name,
        "format": f"{k_format}/{v_format}" + "".join(f":{k}={v}" for k, v in (options or {}).items()),
        "context_tokens": tokens,
        "question_tokens": n_q,
        "keep": keep,
        "plain_prefill_s": times,
        "rows": [asdict(r) for r in rows],
        # kvpress's rows and the kvhal policy each pairs with
        **({} if side is None else {"kvpress": side, "pairs": {label: kvpress_pair(label) for label in labels}}),
    }


def _row(
    label: str, cache: Any, ref: np.ndarray, got: np.ndarray, n: int, before: int, t: float, t0: float
) -> EvictRow:
    st = cache.kv.stats()
    p = np.exp(ref)
    kl = float(np.sum(p * (ref - got)))
    kept = cache.evictions[0].length if cache.evictions else n  # per-head (AdaKV): the longest head's
    # the question's tokens were stored after the press: count the context's pages only (an f16 tail's rows apart)
    spec = cache.kv.spec
    after = max(0, kept - spec.tail) // spec.block_size if spec.uses_tail else math.ceil(kept / spec.block_size)
    return EvictRow(label, kl, bool(ref.argmax() == got.argmax()), int(kept), before, after, 1 - after / before,
                    int(st.bytes_held), t, t / t0)  # fmt: skip


def table(res: dict[str, Any]) -> str:
    side = res.get("kvpress")
    head = f"  {'policy':<28} {'KL first token':>14} {'top-1':>6} {'kept':>5} {'pages freed':>12} {'prefill':>8} " \
        f"{'vs plain':>8}"  # fmt: skip
    lines = [
        f"kvhal eval --evict: {res['model']}, {res['backend']} {res['format']}, {res['context_tokens']}-token "
        f"context kept at {res['keep']}, {res['question_tokens']}-token question",
        f"  plain prefill (no eviction) {', '.join(f'{t:.1f}' for t in res['plain_prefill_s'])} s",
    ]
    if side is not None:
        v = side["versions"]
        lines.insert(1, f"  beside kvpress {v['kvpress']} (transformers {v['transformers']}, torch {v['torch']}), "
                        f"compression_ratio={1 - res['keep']:g}, the same reference")  # fmt: skip
        head += f"  | {'kvpress':<34} {'KL first token':>14} {'top-1':>6}"
        theirs = {r["press"]: r for r in side["rows"]}
    lines.append(head)
    for r in res["rows"]:
        line = (
            f"  {r['policy']:<28} {r['kl']:>14.3e} {'same' if r['top1_same'] else 'diff':>6} {r['kept_tokens']:>5} "
            f"{r['pages_freed']:>11.1%} {r['prefill_s']:>7.1f}s {r['prefill_ratio']:>7.2f}x"
        )
        if side is not None:
            t = theirs.get(res["pairs"].get(r["policy"]) or "")
            line += "  | " + (
                f"{t['press']:<34} {t['kl']:>14.3e} {'same' if t['top1_same'] else 'diff':>6}" if t else f"{'-':<34}"
            )
        lines.append(line.rstrip())
    return "\n".join(lines)


def cli(args: Any) -> int:
    from .fidelity import NOT_WITH_EVICT, check_backend, given, parse_descriptor

    ignored = given(args, NOT_WITH_EVICT)
    if ignored:
        raise SpecError(
            f"--evict runs its own model and passage and does not read {', '.join(ignored)}: drop them, or drop --evict"
        )
    try:
        tokens = DEFAULT_TOKENS if args.tokens is None else int(args.tokens)
        keep = 0.5 if args.keep is None else float(args.keep)
        block_size = int(args.block_size)
    except ValueError as e:
        raise SpecError(f"--tokens, --keep and --block-size take numbers: {e}") from None
    if not 0 < keep <= 1:
        raise SpecError(f"--keep takes a fraction in (0, 1], got {args.keep!r}")
    if tokens < 1 or block_size < 1:
        raise SpecError(f"--tokens and --block-size take positive integers, got {args.tokens!r}, {args.block_size!r}")
    check_backend(args.backend)  # before the model's run, as eval without --evict checks it
    choice = parse_descriptor("f16" if args.evict_format is None else args.evict_format)
    names = getattr(args, "policies", None)
    chosen(tokens, keep, names)  # a bad --policies fails before the model loads
    kvpress = getattr(args, "kvpress", None)
    if kvpress is not None:
        check_kvpress(kvpress)  # and a bad --kvpress too
    res = run(args.model, tokens, keep, choice.k_format, choice.v_format, args.backend, block_size, names, kvpress,
              choice.kwargs)  # fmt: skip
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0
