"""The real llama.cpp (llama-cpp-python's low-level API), run in its own process by the tests.

    python engine.py save    MODEL DIR --type-k q8_0 --type-v q8_0 --flash-attn on --tokens 240
    python engine.py restore MODEL DIR --type-k q8_0 --type-v q8_0 --flash-attn on STATE [STATE ...]

``save`` tokenizes kvhal's eval passage, keeps the first ``--tokens`` ids, decodes all but the last and writes
``DIR/prompt.json`` (the ids), ``DIR/state.bin`` (``llama_state_seq_get_data`` of sequence 0) and
``DIR/state.ggsq`` (``llama_state_seq_save_file``). ``restore`` starts a fresh context per STATE (a ``.bin`` goes
through ``llama_state_seq_set_data``, a ``.ggsq`` through ``llama_state_seq_load_file``), decodes the prompt's
last token and generates 32 greedy tokens; it prints one JSON line: per state the tokens, or the refusal.
The environment passes LLAMA_ATTN_ROT_DISABLE through. ``use_extra_bufts=False``: on AMX CPUs llama.cpp's
AMX buffer type dies with SIGILL on this model.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import llama_cpp as L
import numpy as np

TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
N_GEN = 32


def _log(level: int, text: bytes, user: object) -> None:  # llama.cpp's log off: the JSON line is the output
    pass


_LOG = L.llama_log_callback(_log)


class Engine:
    def __init__(self, model: str, type_k: str, type_v: str, flash_attn: bool, n_ctx: int = 512) -> None:
        L.llama_log_set(_LOG, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = False
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            raise SystemExit(f"cannot load {model}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_ctx, n_ctx, 1
        cp.n_threads = cp.n_threads_batch = 2
        cp.type_k, cp.type_v = TYPES[type_k], TYPES[type_v]
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.cp = cp
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("cannot create a context")

    def fresh(self) -> None:
        L.llama_free(self.ctx)
        self.ctx = L.llama_init_from_model(self.model, self.cp)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 16))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), True, False)
        if n < 0:
            raise SystemExit("tokenize failed")
        return list(buf[:n])

    def decode(self, tokens: list[int]) -> None:
        arr = (L.llama_token * len(tokens))(*tokens)
        rc = L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")

    def greedy(self, last: int) -> list[int]:
        out, tok = [], last
        for _ in range(N_GEN):
            self.decode([tok])
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            tok = int(np.argmax(logits))
            out.append(tok)
        return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("save", "restore"))
    p.add_argument("model")
    p.add_argument("dir")
    p.add_argument("states", nargs="*")
    p.add_argument("--type-k", default="f16")
    p.add_argument("--type-v", default="f16")
    p.add_argument("--flash-attn", choices=("on", "off"), default="on")
    p.add_argument("--tokens", type=int, default=240)
    a = p.parse_args()
    e = Engine(a.model, a.type_k, a.type_v, a.flash_attn == "on")
    d = Path(a.dir)
    if a.cmd == "save":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from kvhal.tools.fidelity_model import passage

        ids = e.tokenize(passage())[: a.tokens]
        e.decode(ids[:-1])
        n = L.llama_state_seq_get_size(e.ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        got = L.llama_state_seq_get_data(e.ctx, buf, n, 0)
        (d / "state.bin").write_bytes(bytes(buf[:got]))
        toks = (L.llama_token * (len(ids) - 1))(*ids[:-1])
        if not L.llama_state_seq_save_file(e.ctx, str(d / "state.ggsq").encode(), 0, toks, len(ids) - 1):
            raise SystemExit("llama_state_seq_save_file failed")
        (d / "prompt.json").write_text(json.dumps(ids))
        print(json.dumps({"bytes": got, "tokens": len(ids)}))
        return 0
    ids = json.loads((d / "prompt.json").read_text())
    results = []
    for path in a.states:
        e.fresh()
        if path.endswith(".ggsq"):
            cap = len(ids) + 8
            out = (L.llama_token * cap)()
            count = ctypes.c_size_t(0)
            ok = L.llama_state_seq_load_file(e.ctx, path.encode(), 0, out, cap, ctypes.byref(count))
            if ok and list(out[: count.value]) != ids[:-1]:
                results.append({"state": path, "error": "token ids differ"})
                continue
        else:
            data = Path(path).read_bytes()
            src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            ok = L.llama_state_seq_set_data(e.ctx, src, len(data), 0)
        if not ok:
            results.append({"state": path, "error": "refused"})
            continue
        results.append({"state": path, "tokens": e.greedy(ids[-1])})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
