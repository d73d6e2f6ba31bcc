"""kvhal plan against independent oracles: gguf's block sizes, a page-by-page simulation of a growing
sequence, kvhal's own KVCache (bytes it allocates, sequences it holds), and transformers' layer rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import kvhal
from kvhal import formats
from kvhal.tools import plan
from kvhal.tools.cli import main
from kvhal.tools.plan import ModelShape, estimate

GIB = 2**30

# Meta-Llama-3-8B's config.json (no head_dim: hidden_size / num_attention_heads)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
# Mistral-7B-v0.1: every layer slides over 4096 tokens
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
# Qwen2-7B-Instruct: the window is configured but off (use_sliding_window false)
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


def write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def gguf_row_bytes(fmt: str, n: int) -> int:
    block_len, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]]
    assert n % block_len == 0
    return n // block_len * type_size


def transformers_windows(cfg: dict) -> list[int | None]:
    """transformers' rules, transcribed: Qwen2Config.__post_init__, Gemma2/Gemma3/GptOss configs, Mistral."""
    n, w = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if "layer_types" in cfg:
        return [w if t == "sliding_attention" else None for t in cfg["layer_types"]]
    if "max_window_layers" in cfg:
        w = w if cfg.get("use_sliding_window", False) else None
        return [w if w is not None and i >= cfg["max_window_layers"] else None for i in range(n)]
    if cfg["model_type"] in ("gemma2", "gemma3_text"):
        pattern = cfg.get("sliding_window_pattern", 2 if cfg["model_type"] == "gemma2" else 6)
        return [w if (i + 1) % pattern else None for i in range(n)]
    return [w] * n


def simulate(windows, block_size, page_bytes, horizon):
    """Bytes one sequence holds after each token, growing it one token at a time: every layer takes the
    page of the new position and drops pages whose positions have all left its window."""
    held = {w: [0, 0] for w in set(windows)}  # window -> [first held page, pages taken]
    out = [0]
    for n in range(1, horizon + 1):
        for w, state in held.items():
            if (n - 1) % block_size == 0:
                state[1] += 1
            if w is not None:  # positions n - w .. n - 1 are in the window
                while (state[0] + 1) * block_size - 1 < n - w:
                    state[0] += 1
        out.append(sum((held[w][1] - held[w][0]) for w in windows) * page_bytes)
    return out


def brute_max_context(held: list[int], budget: int) -> int | None:
    """The longest context a growing sequence reaches without ever passing the budget (None: the whole horizon)."""
    for n in range(1, len(held)):
        if held[n] > budget:
            return n - 1
    return None


@pytest.mark.parametrize("k", [f for f in formats.names() if formats.get(f).ggml_type])
@pytest.mark.parametrize("v", ["f16", "q8_0", "q4_0"])
def test_bytes_per_token_equal_ggml_block_sizes(k, v):
    p = estimate(ModelShape.uniform(32, 8, 128), [f"{k}/{v}"])
    (row,) = p.rows
    assert (row.k_format, row.v_format) == (k, v)
    assert row.bytes_per_token == 32 * 8 * (gguf_row_bytes(k, 128) + gguf_row_bytes(v, 128))
    assert row.page_bytes == 16 * 8 * (gguf_row_bytes(k, 128) + gguf_row_bytes(v, 128))


@pytest.mark.parametrize("k", ["fp8_e4m3", "kivi4", "kivi2"])
def test_bytes_per_token_of_formats_without_ggml_type(k):
    p = estimate(ModelShape.uniform(32, 8, 128), [f"{k}/q8_0"])
    (row,) = p.rows
    code_bits = {"fp8_e4m3": 8, "kivi4": 4, "kivi2": 2}[k]
    k_row = 128 * code_bits // 8 + (4 * 128 // 16 if formats.get(k).k_page else 0)  # + page scales per row
    assert row.bytes_per_token == 32 * 8 * (k_row + gguf_row_bytes("q8_0", 128))


def test_llama3_8b_config_on_24_gib(tmp_path):
    shape = ModelShape.from_config(write(tmp_path, LLAMA3_8B))
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.windows == (None,) * 32
    p = estimate(shape, ["q8_0", "q4_0", "f16"], budget="24GiB", devices=["h100"])
    for row in p.rows:
        per_token = 32 * 8 * 2 * gguf_row_bytes(row.k_format, 128)
        pages = 24 * GIB // (16 * per_token)  # whole pages of 16 tokens, every layer
        assert row.max_context == pages * 16
        assert row.seq_bytes == pages * 16 * per_token <= 24 * GIB
        assert row.read_bytes == row.max_context * per_token
        assert row.decode[0].ms_per_token == pytest.approx(row.max_context * per_token / 3.35e12 * 1e3)
    assert [r.max_context for r in p.rows] == [370080, 699040, 196608]


@pytest.mark.parametrize("kv", ["q8_0/q4_0", "f16", "q5_1/q4_0"])
@pytest.mark.parametrize("budget", [40_000, 65_536, 1_000_000])
def test_max_context_and_sequences_match_kvcache(kv, budget):
    """kvhal's own cache: the pools it allocates for the planned context fit, a page more does not; and
    exactly the planned number of sequences store `context` tokens in every layer, one more is refused."""
    shape = ModelShape.uniform(3, 2, 64)
    k, _, v = kv.partition("/")
    spec = kvhal.CacheSpec(3, 2, 64, k, v or k, block_size=8)
    n = estimate(shape, [kv], budget=budget, block_size=8).rows[0].max_context
    assert n % 8 == 0 and n > 0
    fits = kvhal.KVCache(spec, n, backend="reference").stats()
    assert fits.capacity_tokens == n and fits.bytes_allocated <= budget
    assert kvhal.KVCache(spec, n + 1, backend="reference").stats().bytes_allocated > budget

    context = 21  # three pages, the last one part-filled
    seqs = estimate(shape, [kv], budget=budget, context=context, block_size=8).rows[0].max_seqs
    cache = kvhal.KVCache(spec, n, backend="reference", on_full="raise")
    rows = np.random.default_rng(0).standard_normal((context, 2, 64)).astype(np.float32)
    for _ in range(seqs):
        s = cache.new_seq()
        for layer in range(3):
            cache.store(s, layer, rows, rows)
    s = cache.new_seq()
    with pytest.raises(kvhal.CapacityError):
        cache.store(s, 0, rows, rows)


@pytest.mark.parametrize(
    "windows",
    [
        (None, None, 5, 5),
        (16, 16, None),
        (17, 3, None, 40),
        (1, None),
        (9, 24),  # every layer slides
        (8, 8, 8),
    ],
)
@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("budget", [3_000, 20_000, 90_000])
def test_sliding_windows_match_a_page_by_page_simulation(windows, block_size, budget):
    shape = ModelShape(len(windows), 1, 32, tuple(windows))
    page = block_size * (gguf_row_bytes("q8_0", 32) + gguf_row_bytes("q4_0", 32))
    held = simulate(windows, block_size, page, horizon=3000)
    row = estimate(shape, ["q8_0/q4_0"], budget=budget, block_size=block_size).rows[0]
    brute = brute_max_context(held, budget)
    assert row.page_bytes == page
    assert row.max_context == brute and row.unbounded == (brute is None)
    if row.unbounded:  # the figures are at the plateau: the most any context holds
        assert row.seq_bytes == max(held)
    for context in (1, 2, 7, 8, 9, 23, 40, 41, 100, 257):
        at = estimate(shape, ["q8_0/q4_0"], budget=budget, context=context, block_size=block_size).rows[0]
        assert at.seq_bytes == max(held[1 : context + 1])  # the most it holds on its way to `context`
        assert at.max_seqs == budget // at.seq_bytes
        assert at.read_bytes == sum(context if w is None else min(w, context) for w in windows) * page // block_size


def test_mistral_config_slides_every_layer(tmp_path):
    shape = ModelShape.from_config(write(tmp_path, MISTRAL_7B))
    assert shape.windows == tuple(transformers_windows(MISTRAL_7B)) == (4096,) * 32
    per_layer_token = 8 * 2 * gguf_row_bytes("f16", 128)
    held = simulate((4096,), 16, 16 * per_layer_token, horizon=9000)  # one layer; all 32 alike
    big = estimate(shape, ["f16"], budget="24GiB", context=8192, devices=["h100"]).rows[0]
    assert big.seq_bytes == 32 * max(held[1:8193])  # capped at the window, page-rounded
    assert big.read_bytes == 32 * 4096 * per_layer_token  # decode reads the window only
    assert big.decode[0].tokens_per_s == pytest.approx(3.35e12 / big.read_bytes)
    steady = estimate(shape, ["f16"], budget="24GiB").rows[0]
    assert steady.unbounded and steady.seq_bytes == 32 * max(held)
    small = estimate(shape, ["f16"], budget="256MiB").rows[0]
    assert small.max_context == brute_max_context([32 * h for h in held], 256 * 2**20) == 2048
    full = estimate(shape.full_attention(), ["f16"], budget="24GiB").rows[0]
    assert full.max_context == 196608  # what kvhal's KVCache holds: every layer at full length


@pytest.mark.parametrize("use", [False, True, None])
@pytest.mark.parametrize("first", [0, 21, 28])
def test_qwen2_config_max_window_layers(tmp_path, use, first):
    cfg = dict(QWEN2_7B, max_window_layers=first, sliding_window=4096)
    if use is None:
        del cfg["use_sliding_window"]  # Qwen2Config's default: false
    else:
        cfg["use_sliding_window"] = use
    shape = ModelShape.from_config(write(tmp_path, cfg))
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim) == (28, 4, 128)
    assert shape.windows == tuple(transformers_windows(cfg))
    assert shape.windows.count(4096) == (28 - first if use else 0)


def test_qwen2_7b_as_published_is_full_attention(tmp_path):
    shape = ModelShape.from_config(write(tmp_path, QWEN2_7B))
    assert shape.windows == (None,) * 28


def test_layer_types_and_implicit_patterns(tmp_path):
    gpt_oss = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2880,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    }
    gemma2 = {
        "model_type": "gemma2",
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_size": 3584,
        "sliding_window": 4096,
    }
    gemma3 = {  # multimodal: the language model's config is nested
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
        },
    }
    for cfg, inner in ((gpt_oss, gpt_oss), (gemma2, gemma2), (gemma3, gemma3["text_config"])):
        shape = ModelShape.from_config(write(tmp_path, cfg))
        assert shape.windows == tuple(transformers_windows(inner)), cfg["model_type"]
        assert shape.n_kv_heads == inner["num_key_value_heads"] and shape.head_dim == inner["head_dim"]
    assert ModelShape.from_config(write(tmp_path, gemma3)).windows.count(None) == 5  # layers 5, 11, ..., 29


def test_shape_flags_and_layer_types_on_the_command_line(capsys):
    args = ["plan", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--format", "q8_0", "--json"]
    assert main([*args, "--sliding-window", "32", "--sliding-layers", "3"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*args, "--sliding-window", "32", "--layer-types", "full,sliding,sliding,sliding"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert sorted(a["shape"]["windows"], key=str) == sorted(b["shape"]["windows"], key=str) == [32, 32, 32, None]
    assert a["rows"] == b["rows"]


def test_json_output_is_the_plan(tmp_path, capsys):
    path = write(tmp_path, LLAMA3_8B)
    argv = ["plan", "--config", str(path), "--format", "q8_0", "--format", "q8_0/q4_0", "--budget", "24GiB"]
    assert main([*argv, "--context", "32768", "--device", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = estimate(
        ModelShape.from_config(path), ["q8_0", "q8_0/q4_0"], budget="24GiB", context=32768, devices=["h200"]
    )
    assert out == json.loads(json.dumps(want.as_dict()))
    assert out["budget"] == 24 * GIB and out["devices"][0]["read_bytes_per_s"] == 4.8e12
    row = out["rows"][1]
    assert (row["k_format"], row["v_format"]) == ("q8_0", "q4_0")
    assert row["max_seqs"] == 24 * GIB // (32768 // 16 * 32 * 16 * 8 * (136 + 72))
    assert main(argv) == 0
    txt = capsys.readouterr().out
    assert "370,080" in txt and "q8_0/q4_0" in txt and "max context" in txt


def test_this_machine_is_measured(monkeypatch):
    monkeypatch.setattr(plan, "THIS_PROBE_BYTES", 1 << 24)
    p = estimate(ModelShape.uniform(2, 2, 32), ["f16"], context=1000, devices=["this", "m3max"])
    this, m3 = p.devices
    assert this.name == "this" and this.read_bytes_per_s > 0 and "measured" in this.source
    assert m3.read_bytes_per_s == 400e9
    for dev, figure in zip(p.devices, p.rows[0].decode):
        assert figure.ms_per_token == pytest.approx(1000 * 2 * 2 * 2 * 64 / dev.read_bytes_per_s * 1e3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * GIB), ("24 GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5TiB", 3 * 2**39), ("4096", 4096)],
)
def test_budget_units(text, expected):
    assert plan.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24XB", "-1GiB", "0", "0.1", "GiB", "", "1e9", True, 24.0, 0, None])
def test_bad_budgets(bad):
    with pytest.raises(kvhal.PlanError):
        estimate(ModelShape.uniform(2, 2, 32), ["f16"], budget=bad) if bad is not None else plan.parse_bytes(bad)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["q9_9"]), kvhal.FormatError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16/q7"]), kvhal.FormatError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), "f16"), kvhal.PlanError),  # a str is not a list
        (lambda: estimate(ModelShape.uniform(2, 2, 32), [8]), kvhal.PlanError),
        (lambda: estimate(ModelShape.uniform(2, 2, 48), ["q8_0"]), kvhal.SpecError),  # 48 is not 32-aligned
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16"], context=1.5), kvhal.PlanError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16"], context=True), kvhal.PlanError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16"], block_size=True), kvhal.PlanError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16"], devices="h100"), kvhal.PlanError),
        (lambda: estimate(ModelShape.uniform(2, 2, 32), ["f16"], devices=["a100"]), kvhal.PlanError),
        (lambda: estimate((2, 2, 32), ["f16"]), kvhal.PlanError),
        (lambda: ModelShape.uniform(True, 2, 32), kvhal.PlanError),
        (lambda: ModelShape.uniform(2, 2.0, 32), kvhal.PlanError),
        (lambda: ModelShape.uniform(2, 2, 32, sliding_layers=1), kvhal.PlanError),
        (lambda: ModelShape.uniform(2, 2, 32, sliding_window=8, sliding_layers=3), kvhal.PlanError),
        (lambda: ModelShape.uniform(2, 2, 32, sliding_window=8, sliding_layers=True), kvhal.PlanError),
        (lambda: ModelShape.from_layer_types(2, 32, ["sliding", "global"], 8), kvhal.PlanError),
        (lambda: ModelShape.from_layer_types(2, 32, "sliding", 8), kvhal.PlanError),
        (lambda: ModelShape(2, 2, 32, (None,)), kvhal.PlanError),
    ],
)
def test_typed_errors(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": 32.0}, "num_hidden_layers"),
        ({"num_hidden_layers": None}, "num_hidden_layers is missing"),
        ({"num_key_value_heads": "8"}, "num_key_value_heads"),
        ({"hidden_size": 4097}, "multiple"),
        ({"use_sliding_window": "false", "sliding_window": 4096}, "use_sliding_window"),
        ({"sliding_window": False}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 31}, "one type per layer"),
        ({"layer_types": ["linear_attention"] * 32}, "linear_attention"),
        ({"layer_types": ["sliding_attention"] * 32}, "window"),  # sliding layers without a sliding_window
    ],
)
def test_bad_configs(tmp_path, change, match):
    cfg = {k: v for k, v in {**LLAMA3_8B, **change}.items() if v is not None}
    with pytest.raises(kvhal.PlanError, match=match):
        ModelShape.from_config(write(tmp_path, cfg))


def test_unreadable_configs(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for path, match in ((tmp_path / "missing.json", "cannot read"), (tmp_path / "bad.json", "not JSON")):
        with pytest.raises(kvhal.PlanError, match=match):
            ModelShape.from_config(path)
    with pytest.raises(kvhal.PlanError, match="list"):
        ModelShape.from_config(tmp_path / "list.json")
    with pytest.raises(kvhal.PlanError):
        ModelShape.from_config(7)


@pytest.mark.parametrize(
    "extra",
    [
        ["--budget", "24 parsecs"],
        ["--format", "q9_9"],
        ["--device", "tpu"],
        ["--config", "x.json"],  # not both
        ["--sliding-layers", "2"],  # without a window
        ["--context", "0"],
    ],
)
def test_cli_errors_are_one_line_and_exit_2(capsys, extra):
    assert main(["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvhal: error: ") and err.count("\n") == 1


def test_cli_needs_a_model(capsys):
    assert main(["plan", "--layers", "2", "--budget", "1GiB"]) == 2
    assert "--config" in capsys.readouterr().err


def test_budget_below_one_page_fits_nothing():
    row = estimate(ModelShape.uniform(2, 2, 32), ["f16"], budget=100, context=4).rows[0]
    assert row.max_context == 0 and row.max_seqs == 0
    assert row.seq_bytes == 2 * 16 * 2 * 2 * 64  # one page per layer, K and V f16


def test_docs_runs_reproduce(tmp_path, monkeypatch, capsys):
    """docs/plan.md shows real output: every run there that does not measure this machine reproduces exactly."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    (tmp_path / "config.json").write_text(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    monkeypatch.chdir(tmp_path)
    runs = re.findall(r"```\n\$ kvhal (plan .*?)\n(.*?)```", doc, re.S)
    checked = 0
    for command, output in runs:
        if "--device this" in command:
            continue
        assert main(command.split()) == 0
        assert capsys.readouterr().out == output, command
        checked += 1
    assert checked >= 3
