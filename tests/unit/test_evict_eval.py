"""``kvhal eval --evict --kvpress PYTHON``: the argument checks and the side-by-side table.

The real comparison (the model, kvpress in its own environment) runs in the nox session ``eval-kvpress``; here the
interpreter is a fake shell script, and the table is fed rows written out by hand: a test of formatting only.
"""

from __future__ import annotations

import stat

import pytest

from kvhal.errors import SpecError
from kvhal.tools import evict_eval, kvpress_side
from kvhal.tools.cli import main


def fake_python(tmp_path, body: str, executable: bool = True):
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_every_policy_pairs_with_a_press_the_side_script_builds():
    labels = ["none", *evict_eval.policies(1628, 0.5)]
    pairs = {label: evict_eval.kvpress_pair(label) for label in labels}
    assert set(pairs.values()) <= set(kvpress_side.PRESSES)
    # the longest matching prefix wins: AdaKV over SnapKV is not plain SnapKV
    assert pairs["AdaKV(SnapKV(64, 5))"] == "AdaKVPress(SnapKVPress)"
    assert pairs["SnapKV(window=64, kernel=5)"] == "SnapKVPress"
    assert pairs["AdaKV(ExpectedAttention)"] == "AdaKVPress(ExpectedAttentionPress)"
    assert pairs["AdaKV(ExpectedAttn, 1, 1)"] == "ExpectedAttentionPress"
    assert pairs["H2O(407, 407)"] == "ObservedAttentionPress"
    assert evict_eval.kvpress_pair("Something") is None


def test_check_kvpress_says_how_to_make_the_environment(tmp_path):
    with pytest.raises(SpecError, match="is not a file") as e:
        evict_eval.check_kvpress(str(tmp_path / "missing"))
    assert evict_eval.KVPRESS_PIP in str(e.value)
    with pytest.raises(SpecError, match="does not run"):
        evict_eval.check_kvpress(fake_python(tmp_path, "echo 0.5.5", executable=False))
    broken = fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'kvpress'\" >&2; exit 1")
    with pytest.raises(SpecError, match="No module named 'kvpress'") as e:
        evict_eval.check_kvpress(broken)
    assert evict_eval.KVPRESS_PIP in str(e.value)
    assert evict_eval.check_kvpress(fake_python(tmp_path, "echo 0.5.5")) == "0.5.5"


def test_cli_refuses_a_bad_kvpress_before_loading_the_model(tmp_path, capsys):
    assert main(["eval", "--evict", "--kvpress", str(tmp_path / "missing")]) == 2
    assert evict_eval.KVPRESS_PIP in capsys.readouterr().err
    assert main(["eval", "--kvpress", str(tmp_path / "missing")]) == 2
    assert "add --evict" in capsys.readouterr().err


def test_table_puts_each_press_beside_its_policy():
    """Formatting only: rows written out by hand."""

    def row(policy, kl, same=True):
        return {"policy": policy, "kl": kl, "top1_same": same, "kept_tokens": 814, "blocks_before": 102,
                "blocks_after": 51, "pages_freed": 0.5, "bytes_held": 0, "prefill_s": 1.0, "prefill_ratio": 1.0}  # fmt: skip

    res = {
        "model": "m.gguf", "backend": "cpu", "format": "f16/f16", "context_tokens": 1628, "question_tokens": 26,
        "keep": 0.5, "plain_prefill_s": [1.0],
        "rows": [row("none", 1e-6), row("SnapKV(window=64, kernel=5)", 0.0119), row("Other", 0.5, False)],
        "kvpress": {"versions": {"kvpress": "0.5.5", "transformers": "5.2.0", "torch": "2.13.0"},
                    "rows": [{"press": "none", "kl": 2e-12, "top1_same": True},
                             {"press": "SnapKVPress", "kl": 0.0163, "top1_same": False}]},
        "pairs": {"none": "none", "SnapKV(window=64, kernel=5)": "SnapKVPress", "Other": None},
    }  # fmt: skip
    lines = evict_eval.table(res).splitlines()
    assert "kvpress 0.5.5 (transformers 5.2.0, torch 2.13.0)" in lines[1]
    body = {line.split()[0]: line for line in lines[4:]}
    ours, theirs = body["SnapKV(window=64,"].split("|")
    assert "1.190e-02" in ours and theirs.split() == ["SnapKVPress", "1.630e-02", "diff"]
    assert body["none"].split("|")[1].split() == ["none", "2.000e-12", "same"]
    assert body["Other"].split("|")[1].split() == ["-"]
    del res["kvpress"], res["pairs"]
    assert "|" not in evict_eval.table(res)  # without --kvpress: kvhal's columns only
