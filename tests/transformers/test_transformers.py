"""kvhal inside transformers' own models: KVHalCache + attn_implementation="kvhal" against DynamicCache.

The oracle is transformers itself: the same model (seeded random weights) run with DynamicCache and
SDPA. Models are small configs of transformers' Llama, Mistral (every layer sliding) and Qwen2 (full
and sliding layers mixed), all with grouped KV heads.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvhal  # noqa: E402
from kvhal.integrations.transformers import KVHalCache, kvhal_attention  # noqa: E402

# matrices this small gain nothing from threads, and spinning OpenMP threads on a shared 2-core machine
# made every matmul ~40x slower
torch.set_num_threads(1)

NEW = 64
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=12),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=10, max_window_layers=1),
}


def make_model(name: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


@pytest.fixture(scope="module")
def models():
    return {name: make_model(name) for name in CONFIGS}


def prompts(batch: int):
    """Left-padded prompts of 17, 9 and 4 real tokens (pad id 0, never a prompt token)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, SMALL["vocab_size"], (batch, 17), generator=g)
    mask = torch.ones_like(ids)
    for row, n_pad in enumerate((0, 8, 13)[:batch]):
        mask[row, :n_pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, cache, ids, mask, new=NEW, **kw):
    model.set_attn_implementation("sdpa" if isinstance(cache, transformers.DynamicCache) else "kvhal")
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kw)


def kv_cache(model, backend: str, fmt: str = "f32", capacity: int = 512) -> KVHalCache:
    model.set_attn_implementation("kvhal")
    return KVHalCache.from_model(model, k_format=fmt, v_format=fmt, capacity_tokens=capacity, backend=backend,
                                 block_size=8)


def max_logit_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_cache_under_sdpa_and_eager_equals_dynamic_cache(models, backend_info, name, impl):
    """A user who forgets attn_implementation="kvhal": transformers' attention over K/V dense from load."""
    model, (ids, mask) = models[name], prompts(3)
    model.set_attn_implementation(impl)
    cache = KVHalCache.from_model(model, k_format="f32", v_format="f32", capacity_tokens=512,
                                  backend=backend_info.name, block_size=8)
    runs = []
    for c in (transformers.DynamicCache(config=model.config), cache):
        with torch.inference_mode():
            runs.append(model.generate(ids, attention_mask=mask, cache=c, max_new_tokens=NEW, min_new_tokens=NEW,
                                       do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                                       output_logits=True))
    ref, out = runs
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < 1e-4
    assert cache.kv.seq_len(cache.seqs[0]) == 17 + NEW - 1  # every column stored, padding too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_attention_in_the_models_half_dtype_equals_dynamic_cache(backend_info, dtype):
    """A half-precision model under sdpa: load writes K/V straight into the model's dtype (a lossless round trip
    for a cache of that format), so the logits match DynamicCache's."""
    model = make_model("llama").to(dtype)
    ids, mask = prompts(1)
    fmt = "bf16" if dtype == torch.bfloat16 else "f16"
    model.set_attn_implementation("sdpa")
    cache = KVHalCache.from_model(model, k_format=fmt, v_format=fmt, capacity_tokens=512, backend=backend_info.name,
                                  block_size=8)
    runs = []
    for c in (transformers.DynamicCache(config=model.config), cache):
        with torch.inference_mode():
            runs.append(model.generate(ids, attention_mask=mask, cache=c, max_new_tokens=16, min_new_tokens=16,
                                       do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                                       output_logits=True))
    ref, out = runs
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < 2e-2


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_f32_equals_dynamic_cache(models, backend_info, name, batch):
    model, (ids, mask) = models[name], prompts(batch)
    ref = generate(model, transformers.DynamicCache(config=model.config), ids, mask)
    cache = kv_cache(model, backend_info.name)
    out = generate(model, cache, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < 1e-4
    # every row stored its real tokens only: prompt + generated (the last token is never fed back)
    real = mask.sum(1).tolist()
    assert [cache.kv.seq_len(s) for s in cache.seqs] == [n + NEW - 1 for n in real]
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_prefill_logits_at_every_real_position(models, backend_info, name):
    model, (ids, mask) = models[name], prompts(3)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask, cache=transformers.DynamicCache(config=model.config)).logits
        out = model(ids, attention_mask=mask, cache=kv_cache(model, backend_info.name)).logits
    real = mask.bool()
    assert float((out[real] - ref[real]).abs().max()) < 1e-4


def test_cache_shape_comes_from_the_config(models):
    mistral = kv_cache(models["mistral"], "reference")
    qwen = kv_cache(models["qwen2"], "reference")
    assert (mistral.kv.spec.n_layers, mistral.kv.spec.n_kv_heads, mistral.kv.spec.head_dim) == (2, 2, 32)
    assert mistral.windows == [12, 12] and mistral.is_sliding == [True, True]
    assert qwen.windows == [None, 10] and qwen.is_sliding == [False, True]
    assert kv_cache(models["llama"], "reference").windows == [None, None]


class ForceTokens(transformers.LogitsProcessor):
    """Teacher forcing inside generate: each step emits the reference token whatever the logits say."""

    def __init__(self, tokens):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -torch.inf)
        forced.scatter_(1, self.tokens[:, self.step : self.step + 1], 0.0)
        self.step += 1
        return forced


# floors well under what these models measure (printed by the test); a format that stopped attending
# over the right keys lands near 1/vocab
FLOORS = {"f16": 0.98, "q8_0": 0.85, "q4_0": 0.4}


@pytest.mark.parametrize("fmt", list(FLOORS))
def test_quantized_top1_agreement_with_f32(models, backend_info, fmt, capsys):
    model, (ids, mask) = models["llama"], prompts(3)
    ref = generate(model, kv_cache(model, backend_info.name), ids, mask)
    tokens = ref.sequences[:, ids.shape[1] :]
    out = generate(model, kv_cache(model, backend_info.name, fmt), ids, mask,
                   logits_processor=transformers.LogitsProcessorList([ForceTokens(tokens)]))
    assert torch.equal(out.sequences, ref.sequences)  # forced: every step saw the f32 run's prefix
    top1 = torch.stack([a.argmax(-1) == b.argmax(-1) for a, b in zip(out.logits, ref.logits)])
    agreement = float(top1.float().mean())
    with capsys.disabled():
        print(f"\n  top-1 agreement with the f32 cache, {fmt} K/V, {backend_info.name}: {agreement:.3f} "
              f"({int(top1.sum())}/{top1.numel()} decode positions)")
    assert agreement >= FLOORS[fmt]


def test_beam_search_equals_dynamic_cache(models, backend_info):
    model, (ids, mask) = models["llama"], prompts(3)
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=False)
    ref = generate(model, transformers.DynamicCache(config=model.config), ids, mask, new=16, **kw)
    cache = kv_cache(model, backend_info.name)
    out = generate(model, cache, ids, mask, new=16, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(cache.seqs) == 9 and cache.kv.stats().n_seqs == 9  # reordering freed what it dropped


def test_crop_then_regenerate_equals_uncropped(models, backend_info):
    model, (ids, mask) = models["mistral"], prompts(3)
    cache = kv_cache(model, backend_info.name)
    full = generate(model, cache, ids, mask, new=20)
    before = [cache.kv.seq_len(s) for s in cache.seqs]
    cache.crop(-6)
    assert cache.get_seq_length() == ids.shape[1] + 19 - 6
    assert [cache.kv.seq_len(s) for s in cache.seqs] == [n - 6 for n in before]
    # feed the 6 dropped tokens back: the logits of the first 20 steps' tail must come out again
    seq = full.sequences
    n = ids.shape[1] + 19 - 6
    more_mask = torch.cat([mask, torch.ones(3, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    positions = (more_mask.cumsum(-1) - 1).clamp(min=0)[:, n : n + 6]
    with torch.inference_mode():
        logits = model(seq[:, n : n + 6], attention_mask=more_mask[:, : n + 6], position_ids=positions,
                       cache=cache).logits
    for i in range(6):
        assert float((logits[:, i] - full.logits[14 + i]).abs().max()) < 1e-4


def test_without_padding_mask_equals_dynamic_cache(models, backend_info):
    model = models["qwen2"]
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref_cache = transformers.DynamicCache(config=model.config)
        ref = [model(ids, cache=ref_cache).logits, model(ids[:, :3], cache=ref_cache).logits]
        cache = kv_cache(model, backend_info.name)
        out = [model(ids, cache=cache).logits, model(ids[:, :3], cache=cache).logits]
    assert max(float((a - b).abs().max()) for a, b in zip(out, ref)) < 1e-4


def test_errors_say_what_to_do(models):
    model, (ids, mask) = models["llama"], prompts(3)
    with pytest.raises(kvhal.SpecError, match="PreTrainedModel"):
        KVHalCache.from_model(model.config, capacity_tokens=64, backend="reference")
    cache = kv_cache(model, "reference")
    direct = KVHalCache(cache.kv, [None, None])  # built without the model: it cannot see the attention in use
    model.set_attn_implementation("sdpa")
    with pytest.raises(kvhal.KVHalError, match="did not run through"), torch.inference_mode():
        model(ids, attention_mask=mask, cache=direct)
    model.set_attn_implementation("kvhal")
    with pytest.raises(kvhal.errors.CacheMismatchError, match="needs a KVHalCache.*from_model"), torch.inference_mode():
        model(ids, attention_mask=mask, cache=transformers.DynamicCache(config=model.config))
    with torch.inference_mode():  # padding left out under kvhal attention cannot be handed to sdpa as columns
        model(ids, attention_mask=mask, cache=cache)
        model.set_attn_implementation("sdpa")
        more = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        with pytest.raises(kvhal.UnsupportedError, match="padding left out"):
            model(ids[:, :1], attention_mask=more, cache=cache)
        model.set_attn_implementation("kvhal")
        model(ids[:, :1], attention_mask=more, cache=cache)  # nothing changed: kvhal attention goes on
    cache.reset()
    with pytest.raises(kvhal.UnsupportedError, match="2D padding mask"), torch.inference_mode():
        model(ids, attention_mask=torch.ones(3, 1, 17, 17, dtype=torch.bool), cache=kv_cache(model, "reference"))
    for bad in (True, 3, 2.0, "1"):
        with pytest.raises(kvhal.PositionError, match="negative int"):
            cache.crop(bad)
    with pytest.raises(kvhal.ShapeError, match="1D integer"):
        cache.reorder_cache(torch.tensor([0.0, 1.0]))
    kv = torch.zeros(1, 2, 1, 32)
    with pytest.raises(kvhal.ShapeError, match="2 KV heads of head_dim 32"):
        cache.update(torch.zeros(1, 3, 1, 32), torch.zeros(1, 3, 1, 32), 0)
    for layer in (True, 2, 1.0):
        with pytest.raises(kvhal.PositionError, match="layer_idx"):
            cache.update(kv, kv, layer)
    attn = model.model.layers[0].self_attn
    k, _ = cache.update(kv, kv, 0)
    with pytest.raises(kvhal.UnsupportedError, match="changes K/V after the cache update"):
        kvhal_attention(attn, torch.zeros(1, 4, 1, 32), k.clone(), kv, None)
    with pytest.raises(kvhal.SpecError, match="windows"):
        KVHalCache(cache.kv, [None])
    with pytest.raises(kvhal.SpecError, match="positive int"):
        KVHalCache(cache.kv, [None, True])
    with pytest.raises(kvhal.SpecError, match="kvhal.KVCache"):
        KVHalCache(object(), [None, None])


def test_mask_that_rewrites_the_past_is_refused(models):
    model, (ids, mask) = models["llama"], prompts(3)
    cache = kv_cache(model, "reference")
    with torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache)
        later = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        later[0, 2] = 0  # a cached real token turned into padding
        with pytest.raises(kvhal.PositionError, match="cannot mask"):
            model(ids[:, :1], attention_mask=later, cache=cache)
        # nothing changed: the right mask still works
        later[0, 2] = 1
        model(ids[:, :1], attention_mask=later, cache=cache)
    assert cache.get_seq_length() == 18


def test_failed_forward_leaves_a_cache_that_asks_for_reset(models):
    model, (ids, mask) = models["llama"], prompts(3)
    cache = kv_cache(model, "reference", capacity=32)  # 4 pages of 8: row 0 alone needs 3
    with pytest.raises(kvhal.CapacityError, match="capacity_tokens"), torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache)
    with pytest.raises(kvhal.KVHalError, match="reset\\(\\)"), torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache)
    cache.reset()
    assert cache.kv.stats().blocks_used == 0
    with torch.inference_mode():
        model(ids[1:2], attention_mask=mask[1:2], cache=cache)
    assert [cache.kv.seq_len(s) for s in cache.seqs] == [9]


def test_readme_integration_runs(monkeypatch, capsys):
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"## transformers.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.setenv("KVHAL_BACKEND", "reference")
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"tokens=\d+", out) and "k_format='q8_0'" in out


def test_rows_share_pages_after_beam_reorder(models):
    model, (ids, mask) = models["llama"], prompts(1)
    cache = kv_cache(model, "reference")
    with torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache)
    cache.batch_repeat_interleave(3)
    assert cache.kv.stats().blocks_shared == cache.kv.stats().blocks_used > 0
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert len(cache.seqs) == 3 and cache.kv.stats().n_seqs == 3
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.kv.stats().n_seqs == 1 and cache.kv.stats().blocks_shared == 0
    assert cache.get_seq_length() == 17 and cache.kv.seq_len(cache.seqs[0]) == 17


def test_a_refused_row_copy_leaves_the_rows_as_they_were(models, monkeypatch):
    """seq_cp may refuse a row (one an AdaKV press compacted per head): the copies made before it are freed and
    the rows stay as they were (injected here on the second copy of a reorder)."""
    model, (ids, mask) = models["llama"], prompts(1)
    cache = kv_cache(model, "reference")
    with torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache)
    cache.batch_repeat_interleave(2)
    before, seqs, real_cp = cache.kv.stats(), list(cache.seqs), cache.kv.seq_cp
    calls = []

    def refuse_second(seq, *args):
        calls.append(seq)
        if len(calls) == 2:
            raise kvhal.UnsupportedError("this sequence holds per-head gaps and is not copied")
        return real_cp(seq, *args)

    monkeypatch.setattr(cache.kv, "seq_cp", refuse_second)
    with pytest.raises(kvhal.UnsupportedError, match="per-head"):
        cache.reorder_cache(torch.tensor([0, 0, 1, 1]))
    assert len(calls) == 2 and cache.seqs == seqs and cache.kv.stats() == before


def test_prefix_reuse_across_generate_calls(models, backend_info):
    """A second generate whose prompts extend the first's reuses every cached full block of them (match_prefix),
    computes only the rest, and equals DynamicCache token for token."""
    model = models["llama"]
    g = torch.Generator().manual_seed(7)
    first = torch.randint(1, SMALL["vocab_size"], (2, 30), generator=g)
    cache = kv_cache(model, backend_info.name)
    assert cache.match_prefix(first) == [0, 0]  # an empty cache reuses nothing, but records the ids
    generate(model, cache, first, torch.ones_like(first), new=4)
    cache.reset()  # freed blocks stay matchable
    more = torch.cat([first, torch.randint(1, SMALL["vocab_size"], (2, 9), generator=g)], dim=1)
    more[1, :3] = 0  # row 1 is left-padded by 3: it shares nothing at its (shifted) positions
    mask = torch.ones_like(more)
    mask[1, :3] = 0
    hits_before = cache.kv.stats().prefix_hit_tokens
    reused = cache.match_prefix(more, mask)
    # one column count for the batch (transformers has one cache position): row 1 holds only its 3 padding
    # columns, so row 0 reuses 3 of its 24 cached tokens
    assert reused == [3, 0]
    out = generate(model, cache, more, mask, new=12)
    want = generate(model, transformers.DynamicCache(), more, mask, new=12)
    assert torch.equal(out.sequences, want.sequences)
    assert max_logit_diff(out, want) < 1e-4
    solo = kv_cache(model, backend_info.name)
    solo.match_prefix(first[:1])
    generate(model, solo, first[:1], torch.ones_like(first[:1]), new=4)
    solo.reset()
    assert solo.match_prefix(more[:1]) == [24]  # 30 prompt tokens: 3 full blocks of 8
    assert solo.kv.stats().prefix_hit_tokens == 24
    out1 = generate(model, solo, more[:1], mask[:1], new=12)
    want1 = generate(model, transformers.DynamicCache(), more[:1], mask[:1], new=12)
    assert torch.equal(out1.sequences, want1.sequences)
    assert cache.kv.stats().prefix_hit_tokens >= hits_before
    with pytest.raises(kvhal.KVHalError, match="reset"):
        solo.match_prefix(more[:1])


def test_refused_match_prefix_leaves_no_sequence_behind(models):
    """Row 1's invalid id is refused before row 0 gets a kvhal sequence that no row (nor reset) would free."""
    cache = kv_cache(models["llama"], "reference")
    for bad in (torch.tensor([[1, 2, 3, 4], [1, 2, -1, 4]]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2, dtype=bool)):
        with pytest.raises(kvhal.ShapeError):
            cache.match_prefix(bad)
        assert cache.kv.stats().n_seqs == 0 and cache.seqs == []
    cache.reset()
    assert cache.kv.stats().n_seqs == 0 and cache.kv.stats().blocks_used == 0
    assert cache.match_prefix(torch.tensor([[1, 2, 3, 4]])) == [0]


def test_match_prefix_needs_a_row_and_a_column(models):
    cache = kv_cache(models["llama"], "reference")
    for shape in ((1, 0), (0, 4)):
        with pytest.raises(kvhal.ShapeError, match="at least one row and one column"):
            cache.match_prefix(torch.zeros(shape, dtype=torch.long))
        assert cache.get_seq_length() == 0 and cache.kv.stats().n_seqs == 0


@pytest.mark.parametrize("how", ["reorder_list", "reorder_tensor", "select"])
def test_empty_row_selection_is_refused_while_rows_are_held(models, how):
    model = models["llama"]
    cache = kv_cache(model, "reference")
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]), cache=cache)
    with pytest.raises(kvhal.ShapeError, match="empty.*reset\\(\\)"):
        if how == "reorder_list":
            cache.reorder_cache([])
        elif how == "reorder_tensor":
            cache.reorder_cache(torch.tensor([], dtype=torch.long))
        else:
            cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert len(cache.seqs) == 1 and cache.kv.stats().n_seqs == 1 and cache.get_seq_length() == 4
    with torch.inference_mode():
        model(torch.tensor([[5]]), cache=cache)  # the cache goes on as it was
    assert cache.kv.seq_len(cache.seqs[0]) == 5


@pytest.mark.parametrize("impl", ["kvhal", "sdpa"])
def test_float64_model_is_refused_without_poisoning_the_cache(impl):
    """kvhal stores f32/f16/bf16: a float64 model is refused before anything is stored, so the cache needs no
    reset() and goes on once the model runs in float32."""
    model = make_model("llama").double()
    model.set_attn_implementation(impl)
    cache = KVHalCache.from_model(model, k_format="f32", v_format="f32", capacity_tokens=64, backend="reference",
                                  block_size=8)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(kvhal.DTypeError, match="float32, float16 or bfloat16"), torch.inference_mode():
        model(ids, cache=cache)
    assert cache._failed is None and cache.seqs == [] and cache.get_seq_length() == 0
    model.float()
    with torch.inference_mode():
        model(ids, cache=cache)
    assert cache.get_seq_length() == 3 and cache.kv.seq_len(cache.seqs[0]) == 3


def test_attend_checks_its_arguments_before_changing_state(models):
    cache = kv_cache(models["llama"], "reference")
    q, k = torch.zeros(1, 4, 1, 32), torch.zeros(1, 2, 1, 32)
    bad_calls = [
        (kvhal.PositionError, ("a", q, k, k, None, 0.1)),
        (kvhal.PositionError, (5, q, k, k, None, 0.1)),
        (kvhal.PositionError, (True, q, k, k, None, 0.1)),
        (kvhal.PositionError, (-1, q, k, k, None, 0.1)),
        (kvhal.ShapeError, (0, q[0], k, k, None, 0.1)),
        (kvhal.ShapeError, (0, q, k.numpy(), k.numpy(), None, 0.1)),
        (kvhal.ShapeError, (0, q, k, k, None, "x")),
        (kvhal.ShapeError, (0, q, k, k, None, float("nan"))),
        (kvhal.ShapeError, (0, torch.zeros(1, 3, 1, 32), k, k, None, 0.1)),
        (kvhal.ShapeError, (0, q, torch.zeros(1, 2, 2, 32), torch.zeros(1, 2, 2, 32), None, 0.1)),
        (kvhal.ShapeError, (0, q, torch.zeros(1, 3, 1, 32), torch.zeros(1, 3, 1, 32), None, 0.1)),
        (kvhal.DTypeError, (0, q, k.double(), k.double(), None, 0.1)),
        (kvhal.DTypeError, (0, q.double(), k, k, None, 0.1)),
    ]
    for error, args in bad_calls:
        with pytest.raises(error):
            cache.attend(*args)
        assert cache._failed is None and cache.seqs == [] and cache._real.shape == (0, 0), args[:1]
    out = cache.attend(0, q, k, k, None, np.float32(0.1))  # a good call still runs on the untouched cache
    assert out.shape == (1, 1, 4, 32) and cache.get_seq_length(0) == 1
    with pytest.raises(kvhal.ShapeError, match="holds 1 rows"):
        cache.attend(1, torch.zeros(2, 4, 1, 32), torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 1, 32), None, 0.1)
    assert cache._failed is None
    cache.attend(1, q, k, k, None, 0.1)
    assert cache.get_seq_length(1) == 1


def test_layer_indices_of_the_length_queries_work_as_on_dynamic_cache(models):
    model, ids = models["llama"], torch.tensor([[1, 2, 3, 4]])
    cache, dynamic = kv_cache(model, "reference"), transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache)
        model.set_attn_implementation("sdpa")
        model(ids, cache=dynamic)
    for layer in (0, 1, -1, -2, 2, 5, np.int64(1), np.int32(-1)):
        assert cache.get_seq_length(layer) == dynamic.get_seq_length(layer), layer
        assert cache.get_mask_sizes(3, layer) == dynamic.get_mask_sizes(3, layer), layer
    assert cache.layers[1].get_mask_sizes(2) == (6, 0)
    for layer in ("a", 1.0, True, None, -3):
        with pytest.raises(kvhal.PositionError, match="layer_idx"):
            cache.get_seq_length(layer)
        with pytest.raises(kvhal.PositionError, match="layer_idx"):
            cache.get_mask_sizes(0, layer)
    for length in ("a", -1, 1.0, False):
        with pytest.raises(kvhal.ShapeError, match="query_length"):
            cache.get_mask_sizes(length, 0)


def test_cache_with_more_layers_than_the_model_is_refused(models):
    model = models["llama"]
    model.set_attn_implementation("kvhal")
    spec = kvhal.CacheSpec(n_layers=3, n_kv_heads=2, head_dim=32, k_format="f32", v_format="f32", block_size=8)
    kv = kvhal.KVCache(spec, 64, "reference")
    with pytest.raises(kvhal.SpecError, match="model has 2 attention layers but the cache has 3"):
        KVHalCache(kv, [None] * 3, config=model.config)
    cache = KVHalCache(kv, [None] * 3)  # no config: the model's attention module tells, before anything is stored
    for _ in range(2):  # a second try is refused the same way (it ran a whole forward pass and stored it)
        with pytest.raises(kvhal.SpecError, match="2 attention layers but the cache has 3"), torch.inference_mode():
            model.generate(torch.tensor([[1, 2, 3]]), cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert cache.seqs == [] and kv.stats().n_seqs == 0 and cache._failed is None
    # driven by hand (no module to ask): the next forward pass's first update finds the layer left behind
    cache = KVHalCache(kv, [None] * 3)
    q, k = torch.zeros(1, 4, 1, 32), torch.zeros(1, 2, 1, 32)
    for layer in (0, 1):
        key, value = cache.update(k, k, layer)
        kvhal_attention(torch.nn.Module(), q, key, value, None, scaling=0.1)
    with pytest.raises(kvhal.KVHalError, match="updated 2 of the cache's 3 layers"):
        cache.crop(-1)
    with pytest.raises(kvhal.SpecError, match="updated 2 of the cache's 3 layers.*from_model"):
        cache.update(k, k, 0)
    cache.reset()
    assert kv.stats().n_seqs == 0


def test_cache_of_a_sliding_window_model_is_refused_by_a_full_attention_one(models):
    """A full-attention layer passes no sliding_window to the attention function, so only the model's config tells
    that the cache's window (which kvhal attention applies) is not this model's: Mistral's cache on Llama silently
    attended over 12 tokens."""
    ids = torch.tensor([[1, 2, 3]])
    for src, dst, layer in (("mistral", "llama", 0), ("qwen2", "llama", 1), ("llama", "mistral", 0)):
        cache = kv_cache(models[src], "reference")
        models[dst].set_attn_implementation("kvhal")
        for _ in range(2):  # and again: a refusal does not mark the model as checked
            with pytest.raises(kvhal.SpecError, match=f"layer {layer} of the model"), torch.inference_mode():
                models[dst].generate(ids, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
            assert cache.seqs == [] and cache.kv.stats().n_seqs == 0 and cache._failed is None
    with pytest.raises(kvhal.SpecError, match="layer 1 of the model is full_attention.*built with 10"):
        KVHalCache(kv_cache(models["llama"], "reference").kv, [None, 10], config=models["llama"].config)
