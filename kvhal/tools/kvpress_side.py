"""kvpress's side of ``kvhal eval --evict --kvpress PYTHON``: a standalone script run by PYTHON, the interpreter of
an environment where kvpress is installed (kvpress pins transformers < 5.3, kvhal's integration needs a newer one,
so the two never share an environment). It imports torch, transformers, kvpress and numpy, never kvhal.

Reads one JSON object on stdin: ``model_dir`` (the model saved by kvhal's side with ``save_pretrained``: the same
float32 weights), ``context_ids`` and ``question_ids`` (token ids), ``keep`` (the fraction kept),
``presses`` (names from ``PRESSES``, ``"none"`` for no press) and ``reference`` (a .npy file: the log-probabilities
of the first answer token from kvhal's uncompressed float32 ``DynamicCache``). Each press runs as kvpress's
pipeline runs it (``KVPressTextGenerationPipeline._forward``): ``with press(model): model.model(context)`` into a
``DynamicCache``, then the question at the context's original positions. Prints one JSON line:
``{"versions": {...}, "rows": [{"press", "kl", "top1_same"}, ...]}``, KL(reference || press) in nats.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

# a name -> (press class, constructor arguments besides compression_ratio); AdaKVPress wraps the named press
PRESSES = {
    "none": None,
    "StreamingLLMPress": ("StreamingLLMPress", {"n_sink": 4}),
    "SnapKVPress": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "AdaKVPress(SnapKVPress)": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "ExpectedAttentionPress": ("ExpectedAttentionPress", {}),
    "AdaKVPress(ExpectedAttentionPress)": ("ExpectedAttentionPress", {}),
    "KnormPress": ("KnormPress", {}),
    "ObservedAttentionPress": ("ObservedAttentionPress", {}),  # needs eager attention (the attention weights)
}


def make_press(kvpress: Any, name: str, keep: float) -> Any:
    entry = PRESSES[name]
    if entry is None:
        return None
    cls, kwargs = entry
    press = getattr(kvpress, cls)(compression_ratio=1.0 - keep, **kwargs)
    return kvpress.AdaKVPress(press) if name.startswith("AdaKVPress(") else press


def main() -> None:
    import importlib.metadata

    import kvpress
    import numpy as np
    import torch
    import transformers

    req = json.loads(sys.stdin.read())
    unknown = [p for p in req["presses"] if p not in PRESSES]
    if unknown:
        raise SystemExit(f"kvpress_side: unknown presses {unknown}; known: {list(PRESSES)}")
    ref = np.load(req["reference"])
    context = torch.tensor([req["context_ids"]], dtype=torch.long)
    question = torch.tensor([req["question_ids"]], dtype=torch.long)
    n = context.shape[1]
    positions = torch.arange(n, n + question.shape[1]).unsqueeze(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        req["model_dir"], dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()
    rows = []
    for name in req["presses"]:
        press = make_press(kvpress, name, float(req["keep"]))
        model.set_attn_implementation("eager" if name == "ObservedAttentionPress" else "sdpa")
        cache = transformers.DynamicCache()
        with torch.inference_mode():
            with press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=context, past_key_values=cache)
            out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        got = torch.log_softmax(out.logits[0, -1].double(), -1).numpy()
        kl = float(np.sum(np.exp(ref) * (ref - got)))
        rows.append({"press": name, "kl": kl, "top1_same": bool(ref.argmax() == got.argmax())})
    versions = {p: importlib.metadata.version(p) for p in ("kvpress", "transformers", "torch")}
    print(json.dumps({"versions": versions, "rows": rows}))


if __name__ == "__main__":
    main()
