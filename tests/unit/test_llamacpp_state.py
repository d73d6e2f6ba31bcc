"""kvhal.interop.llamacpp on states written here by hand, after llama.cpp's state_write (llama-kv-cache.cpp):
the bytes come from gguf.quants (an independent quantizer), the layout from this file's own writer, so the
parser is checked against a second reading of the format. The real engine: tests/llamacpp."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")

import kvhal  # noqa: E402
from kvhal import transforms  # noqa: E402
from kvhal.interop import llamacpp  # noqa: E402
from kvhal.tools.cli import main  # noqa: E402

T = gguf.GGMLQuantizationType
IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
H, D, LAYERS = 2, 64, 3


def quant(x: np.ndarray, fmt: str) -> np.ndarray:
    """Token rows ``x [n, H*D]`` as ggml bytes ``[n, row_bytes]`` (gguf's numpy quantizer)."""
    if fmt == "f32":
        return x.astype("<f4").view(np.uint8).reshape(len(x), -1)
    if fmt == "f16":
        return x.astype("<f2").view(np.uint8).reshape(len(x), -1)
    return np.asarray(gguf.quants.quantize(x.astype(np.float32), T[fmt.upper()]), np.uint8)


def section(
    rows: list[tuple[np.ndarray, np.ndarray]],
    kf: str,
    vf: str,
    v_trans: bool = False,
    pos: list[int] | None = None,
    n_stream: int = 1,
    seq: int = 0,
) -> bytes:
    """llama_kv_cache::state_write of one sequence, by hand."""
    n = len(rows[0][0])
    pos = list(range(n)) if pos is None else pos
    out = struct.pack("<I", n_stream)
    for s in range(n_stream):
        if s:
            out += struct.pack("<I", 0)
            continue
        out += struct.pack("<I", n)
        for p in pos:
            out += struct.pack("<iIi", p, 1, seq)
        out += struct.pack("<II", int(v_trans), len(rows))
        for k, _ in rows:
            out += struct.pack("<iQ", IDS[kf], k.shape[1]) + k.tobytes()
        for _, v in rows:
            if not v_trans:
                out += struct.pack("<iQ", IDS[vf], v.shape[1]) + v.tobytes()
            else:
                el = 2 if vf == "f16" else 4
                n_embd = v.shape[1] // el
                out += struct.pack("<iII", IDS[vf], el, n_embd)
                out += v.reshape(n, n_embd, el).transpose(1, 0, 2).tobytes()
    return out


def make(n: int, kf: str, vf: str, seed: int = 0, layers: int = LAYERS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            quant(rng.standard_normal((n, H * D)).astype(np.float32), kf),
            quant(rng.standard_normal((n, H * D)).astype(np.float32), vf),
        )
        for _ in range(layers)
    ]


def as_bytes(sec: bytes, seq: int = 0) -> bytes:
    return struct.pack("<Ii", 0xAF143CD8, seq) + sec


def as_file(sec: bytes, tokens: list[int], version: int = 3) -> bytes:
    return struct.pack("<III", 0x67677371, version, len(tokens)) + np.asarray(tokens, "<i4").tobytes() + sec


def hadamard(n: int) -> np.ndarray:
    m = np.ones((1, 1))
    while len(m) < n:
        m = np.block([[m, m], [m, -m]])
    return m / np.sqrt(n)


@pytest.mark.parametrize(
    "kf,vf", [("q8_0", "q8_0"), ("q4_0", "q4_1"), ("q5_0", "q5_1"), ("f16", "f16"), ("f32", "f32")]
)
def test_bytes_move_unchanged_and_round_trip(kf: str, vf: str) -> None:
    rows = make(40, kf, vf)
    data = as_bytes(section(rows, kf, vf, seq=3), seq=3)
    state = llamacpp.read_bytes(data)
    assert state.n_tokens == 40 and state.n_layers == LAYERS and state.seq_id == 3
    cache, seq = llamacpp.import_state(data, kv_heads=H, llama_rotation=True, backend="reference")
    quantized = kf not in ("f16", "f32")
    assert cache.spec.k_rotation == ("hadamard-llama" if quantized else None)
    for layer, (k, v) in enumerate(rows):
        kr, vr = cache.load_rows(seq, layer)
        assert np.array_equal(kr.reshape(40, -1), k) and np.array_equal(vr.reshape(40, -1), v)
        # load() is the unrotated value: llama.cpp's rotation is W (symmetric), per head, block 64 here
        want = gguf.quants.dequantize(k, T[kf.upper()]).reshape(40, H, D).astype(np.float64)
        if quantized:
            want = want @ hadamard(D)
        np.testing.assert_allclose(np.asarray(cache.load(seq, layer)[0]), want, rtol=1e-5, atol=1e-5)
    assert llamacpp.export_state(cache, seq, seq_id=3).to_bytes() == data


def test_transposed_v_reads_as_rows_and_writes_back() -> None:
    rows = make(21, "f16", "f16", seed=1)
    data = as_bytes(section(rows, "f16", "f16", v_trans=True))
    cache, seq = llamacpp.import_state(data, kv_heads=H, llama_rotation=None, backend="reference")
    for layer, (_, v) in enumerate(rows):
        assert np.array_equal(cache.load_rows(seq, layer)[1].reshape(21, -1), v)
    assert llamacpp.export_state(cache, seq, v_trans=True).to_bytes() == data
    assert llamacpp.export_state(cache, seq).to_bytes() == as_bytes(section(rows, "f16", "f16"))


def test_empty_sequence_exports_llama_cpps_zero_cell_state() -> None:
    # what llama_state_seq_get_data / _save_file give for a sequence with no cells (llama-cpp-python 0.3.36)
    cache, _ = llamacpp.import_state(
        as_bytes(section(make(3, "q8_0", "q8_0"), "q8_0", "q8_0")), kv_heads=H, llama_rotation=True, backend="reference"
    )
    empty = llamacpp.export_state(cache, cache.new_seq(), seq_id=2, n_stream=2)
    assert empty.n_tokens == 0
    assert empty.to_bytes() == struct.pack("<IiIII", 0xAF143CD8, 2, 2, 0, 0)
    assert empty.to_file_bytes() == struct.pack("<IIIIII", 0x67677371, 3, 0, 2, 0, 0)
    assert llamacpp.read_bytes(empty.to_bytes()).n_tokens == 0


def test_cells_out_of_order_are_sorted_by_position_and_gaps_refused() -> None:
    rows = make(8, "q8_0", "q8_0")
    perm = np.random.default_rng(0).permutation(8)
    shuffled = [(k[perm], v[perm]) for k, v in rows]
    state = llamacpp.read_bytes(as_bytes(section(shuffled, "q8_0", "q8_0", pos=perm.tolist())))
    assert all(np.array_equal(x.k, k) for x, (k, _) in zip(state.sections[0].layers, rows))
    with pytest.raises(llamacpp.LlamaStateUnsupportedError, match="positions 1..8"):
        llamacpp.read_bytes(as_bytes(section(rows, "q8_0", "q8_0", pos=list(range(1, 9)))))


def test_quantized_state_needs_the_rotation_said() -> None:
    data = as_bytes(section(make(4, "q8_0", "q8_0"), "q8_0", "q8_0"))
    with pytest.raises(kvhal.SpecError, match="llama_rotation"):
        llamacpp.import_state(data, kv_heads=H, llama_rotation=None, backend="reference")
    with pytest.raises(kvhal.SpecError):
        llamacpp.import_state(data, kv_heads=H, llama_rotation=1, backend="reference")  # type: ignore[arg-type]
    cache, _ = llamacpp.import_state(data, kv_heads=H, llama_rotation=False, backend="reference")
    assert cache.spec.k_rotation is None and cache.spec.v_rotation is None
    # numpy's bools are bools (as everywhere in kvhal)
    state = llamacpp.read_bytes(data)
    assert llamacpp.spec_for(state, kv_heads=H, llama_rotation=np.bool_(True)).k_rotation == "hadamard-llama"
    assert llamacpp.export_state(cache, 0, v_trans=np.bool_(False)).to_bytes() == data
    with pytest.raises(kvhal.SpecError, match="v_trans"):
        llamacpp.export_state(cache, 0, v_trans=0)  # type: ignore[arg-type]


def test_attention_over_a_rotated_import_is_right() -> None:
    rng = np.random.default_rng(5)
    n = 33
    k, v = rng.standard_normal((n, H * D)), rng.standard_normal((n, H * D))
    # what llama.cpp stores: W x per head, quantized
    kq = quant((k.reshape(n, H, D) @ hadamard(D)).reshape(n, -1).astype(np.float32), "q8_0")
    vq = quant((v.reshape(n, H, D) @ hadamard(D)).reshape(n, -1).astype(np.float32), "q8_0")
    cache, seq = llamacpp.import_state(
        as_bytes(section([(kq, vq)], "q8_0", "q8_0")), kv_heads=H, llama_rotation=True, backend="reference"
    )
    kd = gguf.quants.dequantize(kq, T.Q8_0).reshape(n, H, D) @ hadamard(D)
    vd = gguf.quants.dequantize(vq, T.Q8_0).reshape(n, H, D) @ hadamard(D)
    q = rng.standard_normal((1, 4, D)).astype(np.float32)
    out = np.asarray(cache.attention(0, q, [seq]))
    for h in range(4):
        s = kd[:, h // 2] @ q[0, h] / np.sqrt(D)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, h], (p / p.sum()) @ vd[:, h // 2], rtol=2e-4, atol=2e-4)


def test_llama_block_sizes() -> None:
    assert [transforms.llama_block(n, "k") for n in (64, 128, 192, 256)] == [64, 128, 64, 256]
    assert transforms.llama_block(256, "v") == 64
    x = np.random.default_rng(0).standard_normal((2, 192))
    np.testing.assert_allclose(
        transforms.rotate(x, "hadamard-llama", "k"), (x.reshape(2, 3, 64) @ hadamard(64)).reshape(2, 192)
    )
    with pytest.raises(kvhal.SpecError, match="multiple of 64"):
        kvhal.CacheSpec(1, 1, 32, k_rotation="hadamard-llama")


def test_bad_input_is_typed_and_nothing_half_imported() -> None:
    rows = make(20, "q4_0", "q4_0")
    sec = section(rows, "q4_0", "q4_0")
    data, file = as_bytes(sec), as_file(sec, list(range(20)))
    for cut in (0, 3, 8, 20, 100, len(data) // 2, len(data) - 1):
        with pytest.raises(llamacpp.LlamaStateCorruptError):
            llamacpp.read_bytes(data[:cut])
    with pytest.raises(llamacpp.LlamaStateCorruptError):
        llamacpp.read_bytes(data + b"\0" * 7)
    with pytest.raises(llamacpp.LlamaStateCorruptError, match="not a llama.cpp sequence state"):
        llamacpp.read_bytes(file)
    with pytest.raises(llamacpp.LlamaStateVersionError, match="version 2"):
        llamacpp.read_file(as_file(sec, list(range(20)), version=2))
    with pytest.raises(kvhal.SpecError):
        llamacpp.read_bytes("not bytes")  # type: ignore[arg-type]
    # a strided memoryview is bytes too (memoryview.cast refuses it): read as its bytes
    strided = memoryview(np.repeat(np.frombuffer(data, np.uint8), 2)[::2])
    assert llamacpp.read_bytes(strided).to_bytes() == data
    assert llamacpp.read_file(memoryview(np.repeat(np.frombuffer(file, np.uint8), 2)[::2])).tokens == tuple(range(20))
    # a flipped bit in every header field is caught (the rows themselves carry no checksum in llama.cpp)
    header_fields = [8, 12, 16 + 20 * 12, 20 + 20 * 12, 24 + 20 * 12, 28 + 20 * 12]
    for at in header_fields:
        for bit in (0, 5):
            bad = bytearray(data)
            bad[at] ^= 1 << bit
            with pytest.raises(kvhal.KVHalError):
                llamacpp.read_bytes(bytes(bad))
    # into a live cache: a state of other heads or rotation is refused and the cache is unchanged
    cache, seq = llamacpp.import_state(data, kv_heads=H, llama_rotation=True, backend="reference")
    before = (cache.seqs, cache.stats().blocks_used)
    with pytest.raises(llamacpp.LlamaStateMismatchError, match="spec"):
        llamacpp.import_into(cache, llamacpp.read_bytes(data), llama_rotation=False)
    with pytest.raises(llamacpp.LlamaStateMismatchError):
        llamacpp.import_into(cache, llamacpp.read_file(file), llama_rotation=True, tokens=[1, 2])
    with pytest.raises(kvhal.ShapeError, match="token_ids"):
        llamacpp.import_into(cache, llamacpp.read_bytes(data), llama_rotation=True, tokens=5)
    with pytest.raises(kvhal.ShapeError, match="token_ids"):
        llamacpp.import_state(data, kv_heads=H, llama_rotation=True, backend="reference", tokens=5)
    assert (cache.seqs, cache.stats().blocks_used) == before
    # token ids as an integer array are taken
    c2, s2 = llamacpp.import_state(data, kv_heads=H, llama_rotation=True, backend="reference", tokens=np.arange(20))
    assert c2.tokens(s2) == list(range(20))
    # fields beyond the state's i32/u32 are refused at export, not by struct.pack at to_bytes()
    for kw in ({"seq_id": 2**31}, {"n_stream": 2**32}, {"n_stream": 2**70}, {"seq_id": -1}):
        with pytest.raises(kvhal.SpecError, match="must be in"):
            llamacpp.export_state(c2, s2, **kw)
    with pytest.raises(kvhal.SpecError, match="must be in"):
        llamacpp.export_state(c2, s2).to_bytes(2**31)
    # a state built by hand: its fields and rows are checked before anything is written
    good = llamacpp.export_state(c2, s2)
    sec, rows0 = good.sections[0], good.sections[0].layers[0]

    def with_section(**kw: object) -> llamacpp.LlamaSeqState:
        return dataclasses.replace(good, sections=(dataclasses.replace(sec, **kw),))

    hand = [
        (kvhal.SpecError, "to_bytes", dataclasses.replace(good, seq_id=2**40)),
        (kvhal.ShapeError, "to_file_bytes", dataclasses.replace(good, tokens=(2**40,) * 20)),
        (kvhal.SpecError, "to_bytes", with_section(n_stream=2**33)),
        (kvhal.SpecError, "to_bytes", with_section(stream=1)),
        (kvhal.SpecError, "to_bytes", with_section(seq_id=-1)),
        (kvhal.SpecError, "to_bytes", dataclasses.replace(good, sections=("section",))),
        (llamacpp.LlamaStateUnsupportedError, "to_bytes", with_section(v_trans=True)),
        (
            llamacpp.LlamaStateUnsupportedError,
            "to_bytes",
            with_section(layers=(dataclasses.replace(rows0, k_format="q3_k"),)),
        ),
    ]
    # (a u32 of 0/1 in the state; no tuple of layers; no rows at all in the first layer; an unhashable format)
    hand += [(kvhal.SpecError, "to_bytes", with_section(v_trans=v)) for v in (2, "yes")]
    hand.append((kvhal.SpecError, "to_bytes", with_section(layers=None)))
    hand.append((kvhal.SpecError, "to_bytes", with_section(layers=(dataclasses.replace(rows0, k=5),))))
    bad_name = (dataclasses.replace(rows0, v_format=["f16"]),)
    hand.append((llamacpp.LlamaStateUnsupportedError, "to_bytes", with_section(layers=bad_name)))
    for bad_rows in ({"k": rows0.k.tolist()}, {"v": rows0.v[:5]}, {"k": rows0.k[:, :7]}):
        hand.append((kvhal.SpecError, "to_file_bytes", with_section(layers=(dataclasses.replace(rows0, **bad_rows),))))
    for error, method, state in hand:
        with pytest.raises(error):
            getattr(state, method)()
    assert llamacpp.read_bytes(good.to_bytes()).to_bytes() == good.to_bytes()
    with pytest.raises(kvhal.SpecError, match="LlamaSeqState"):
        llamacpp.spec_for(None, kv_heads=2, llama_rotation=None)  # type: ignore[arg-type]
    spec = llamacpp.spec_for(llamacpp.read_bytes(data), kv_heads=H, llama_rotation=True, block_size=np.int64(16))
    assert spec.block_size == 16 and type(spec.block_size) is int


def test_foreign_model_is_refused() -> None:
    state = llamacpp.read_bytes(as_bytes(section(make(4, "f16", "f16"), "f16", "f16")))
    model = {"name": "other", "n_layers": LAYERS + 1, "n_kv_heads": H, "head_dim_k": D, "head_dim_v": D}
    with pytest.raises(llamacpp.LlamaStateMismatchError, match="another model"):
        llamacpp.check_model(state, model)
    with pytest.raises(llamacpp.LlamaStateMismatchError, match="another model"):
        llamacpp.check_model(state, {**model, "n_layers": LAYERS, "n_kv_heads": 4})
    llamacpp.check_model(state, {**model, "n_layers": LAYERS})
    for bad in (None, "m", 1):
        with pytest.raises(kvhal.SpecError, match="model must be the dict"):
            llamacpp.check_model(state, bad)  # type: ignore[arg-type]
    with pytest.raises(kvhal.SpecError, match="must be an int"):
        llamacpp.check_model(state, {**model, "n_kv_heads": "2"})


def test_sliding_window_sections() -> None:
    base, swa = make(10, "q8_0", "q8_0", 1, layers=2), make(10, "q8_0", "q8_0", 2, layers=1)
    data = as_bytes(section(base, "q8_0", "q8_0") + section(swa, "q8_0", "q8_0"))
    cache, seq = llamacpp.import_state(data, kv_heads=H, llama_rotation=True, backend="reference")
    assert cache.spec.n_layers == 3 and cache.fingerprint.extra == {"llama.cpp sections": [2, 1]}
    assert np.array_equal(cache.load_rows(seq, 2)[0].reshape(10, -1), swa[0][0])
    assert llamacpp.export_state(cache, seq).to_bytes() == data
    # a window section keeps only the window's cells: not a dense sequence
    part = [(k[4:], v[4:]) for k, v in swa]
    with pytest.raises(llamacpp.LlamaStateUnsupportedError, match="sliding-window"):
        llamacpp.read_bytes(
            as_bytes(section(base, "q8_0", "q8_0") + section(part, "q8_0", "q8_0", pos=list(range(4, 10))))
        )


def test_store_rows_and_load_rows_validate_and_are_atomic() -> None:
    spec = kvhal.CacheSpec(2, H, D, "q8_0", "f16")
    cache = kvhal.KVCache(spec, 64, "reference")
    s = cache.new_seq()
    k = quant(np.ones((3, H * D), np.float32), "q8_0")
    v = quant(np.ones((3, H * D), np.float32), "f16")
    with pytest.raises(kvhal.DTypeError):
        cache.store_rows(s, 0, "abc", v)
    with pytest.raises(kvhal.DTypeError):
        cache.store_rows(s, 0, k.astype(np.float32), v)
    with pytest.raises(kvhal.ShapeError):
        cache.store_rows(s, 0, k[:, :-1], v)
    with pytest.raises(kvhal.ShapeError):
        cache.store_rows(s, 0, k, v[:2])
    with pytest.raises(kvhal.KVHalError):
        cache.store_rows(s, True, k, v)
    nan = v.copy()
    nan[1, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    with pytest.raises(kvhal.NonFiniteError):
        cache.store_rows(s, 0, k, nan)
    assert cache.seq_len(s) == 0 and cache.stats().blocks_used == 0
    cache.store_rows(s, 0, k.tobytes(), v)  # bytes of whole tokens are rows too
    kr, vr = cache.load_rows(s, 0)
    assert np.array_equal(kr.reshape(3, -1), k) and np.array_equal(vr.reshape(3, -1), v)
    with pytest.raises(kvhal.PositionError):
        cache.load_rows(s, 0, 2, 5)
    tail = kvhal.KVCache(kvhal.CacheSpec(1, H, D, tail=4), 64, "reference")
    with pytest.raises(kvhal.UnsupportedError, match="tail"):
        tail.store_rows(tail.new_seq(), 0, v, v)


def test_convert_cli_both_ways_with_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = make(37, "q8_0", "q8_0", layers=3)
    tokens = list(range(100, 137))
    ggsq = tmp_path / "a.ggsq"
    ggsq.write_bytes(as_file(section(rows, "q8_0", "q8_0"), tokens))
    kvs, back = tmp_path / "a.kvs", tmp_path / "b.ggsq"
    assert main(["convert", str(ggsq), str(kvs), "--kv-heads", "2"]) == 2
    assert "--llama-rotation" in capsys.readouterr().err
    assert main(["convert", str(ggsq), str(kvs), "--kv-heads", "2", "--llama-rotation", "on", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["tokens"], r["hashed_blocks"], r["k_rotation"]) == (37, 2, "hadamard-llama")
    assert main(["convert", str(kvs), str(back)]) == 0
    assert back.read_bytes() == ggsq.read_bytes()
    assert main(["convert", str(kvs), str(back), "--llama-rotation", "off"]) == 2
    # the snapshot carries the token ids: match_prefix after restore hits every full block
    cache, seqs = kvhal.KVCache.from_snapshot(kvs, backend="reference", capacity_tokens=256)
    hit, n = cache.match_prefix(tokens + [1])
    assert n == 32 and cache.block_ids(hit) == cache.block_ids(seqs[0])[:2]
    # a cache of the other rotation refuses the snapshot
    other = kvhal.KVCache(kvhal.CacheSpec(3, H, D, "q8_0", "q8_0"), 256, "reference", fingerprint=cache.fingerprint)
    with pytest.raises(kvhal.FingerprintMismatchError):
        other.restore(kvs)


def test_convert_cli_refuses_bad_outputs_and_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = make(20, "f16", "f16", layers=2)
    ggsq, kvs = tmp_path / "a.ggsq", tmp_path / "a.kvs"
    ggsq.write_bytes(as_file(section(rows, "f16", "f16"), list(range(20))))
    assert main(["convert", str(ggsq), str(kvs), "--kv-heads", "2"]) == 0
    capsys.readouterr()
    (tmp_path / "d.ggsq").mkdir()
    (tmp_path / "d.kvs").mkdir()
    missing = str(tmp_path / "no" / "x")
    bad = {
        (str(kvs), missing + ".ggsq"): "does not exist (or is not writable); create it first",
        (str(kvs), str(tmp_path / "d.ggsq")): "is a directory",
        (str(ggsq), missing + ".kvs", "--kv-heads", "2"): "does not exist (or is not writable); create it first",
        (str(ggsq), str(tmp_path / "d.kvs"), "--kv-heads", "2"): "is a directory",
        (str(kvs), str(tmp_path / "o.ggsq"), "--kv-heads", "4"): "holds 2 KV heads",
        (str(kvs), str(tmp_path / "o.ggsq"), "--kv-heads", "0"): "--kv-heads must be a positive",
        (str(ggsq), str(tmp_path / "o.kvs"), "--kv-heads", "0"): "--kv-heads must be a positive",
        (str(ggsq), str(tmp_path / "o.kvs"), "--kv-heads", "2", "--v-layout", "transposed"): "--v-layout applies to",
        (str(kvs), str(tmp_path / "o.ggsq"), "--block-size", "8"): "--block-size applies to",
        (str(ggsq), str(tmp_path / "o.kvs"), "--kv-heads", "2", "--block-size", "0"): "--block-size must be",
    }
    for argv, why in bad.items():
        assert main(["convert", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not (tmp_path / "o.ggsq").exists() and not (tmp_path / "o.kvs").exists()
    # the options of each direction still work: the heads it holds, V transposed, another block size
    out = tmp_path / "o.ggsq"
    assert main(["convert", str(kvs), str(out), "--kv-heads", "2", "--v-layout", "transposed"]) == 0
    assert llamacpp.read_file(out).sections[0].v_trans
    assert main(["convert", str(ggsq), str(tmp_path / "o.kvs"), "--kv-heads", "2", "--block-size", "8"]) == 0
    # the API: an unwritable path is a typed error, not an OSError
    state = llamacpp.read_file(ggsq)
    with pytest.raises(llamacpp.LlamaStateError, match="cannot write"):
        state.save(tmp_path / "d.ggsq")
    with pytest.raises(llamacpp.LlamaStateError, match="cannot write"):
        state.save(missing + ".ggsq")
