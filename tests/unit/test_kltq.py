"""The kltq transform codec's numpy reference against independent oracles: a per-value transcription of the
byte layout, brute-force nearest levels, float64 attention, and Gaussian rate-distortion theory."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhal.errors import DTypeError, FormatError, NonFiniteError, ShapeError, SpecError
from kvhal.formats import kltq


def data(seed: int, n: int = 200, layers: int = 2, heads: int = 2, d: int = 32, decay: float = 12.0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d)) * np.exp(-np.arange(d) / decay)
    k = [
        (rng.standard_normal((n, heads, d)) @ mix.T + rng.standard_normal(d)).astype(np.float32) for _ in range(layers)
    ]
    q = [rng.standard_normal((n, 3 * heads, d)).astype(np.float32) * np.linspace(0.2, 2, d).astype(np.float32)
         for _ in range(layers)]  # fmt: skip
    return k, q


def test_names_offer_every_budget_and_parse_back():
    assert kltq.names()[0] == "kltq:2" and "kltq:4.5" in kltq.names() and kltq.names()[-1] == "kltq:8"
    for name in kltq.names():
        assert f"kltq:{kltq.parse_name(name):g}" == name
    for bad in ("kltq", "kltq:1", "kltq:9", "kltq:x", "q4_0:4", "kltq:4.3"):
        with pytest.raises(FormatError, match="kltq"):
            kltq.parse_name(bad)
    assert kltq.row_bytes(4.5, 64) == 36
    with pytest.raises(FormatError, match="multiple of 8"):
        kltq.row_bytes(4.5, 12)


def test_gaussian_lloyd_max_matches_the_textbook_values():
    # Max (1960) / Jayant & Noll: MSE of the N(0,1) Lloyd-Max quantizer at 1, 2, 3, 4 bits
    for b, want in ((1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)):
        assert kltq.gaussian_distortion(b) == pytest.approx(want, rel=2e-3)
    assert kltq.gaussian_codebook(1)[1] == pytest.approx(math.sqrt(2 / math.pi), rel=1e-3)


def test_codebooks_reach_outlier_clusters_and_keep_gaussian_distortion():
    """A fitted codebook spans a sink-like cluster at 5.5 sigma however few samples per level there are (the
    Gaussian codebook clips it at 4.6), and on Gaussian samples its distortion is Max's (the oracle)."""
    rng = np.random.default_rng(11)
    z = np.concatenate([rng.standard_normal(1000), 5.5 + 0.05 * rng.standard_normal(8)])
    for book in (kltq.fit_codebook(z, 8), kltq.gaussian_codebook(8)):
        assert np.all(np.diff(book) > 0)
    worst = lambda book: float(np.abs(z[:, None] - book[None]).min(axis=1).max())  # noqa: E731
    assert worst(kltq.gaussian_codebook(8)) > 0.5 and worst(kltq.fit_codebook(z, 8)) < 0.05
    fresh = rng.standard_normal(200_000)
    for b in (2, 3):
        book = kltq.fit_codebook(rng.standard_normal(20_000), b)
        mse = float((np.abs(fresh[:, None] - book[None]).min(axis=1) ** 2).mean())
        assert mse == pytest.approx(kltq.gaussian_distortion(b), rel=0.05)


def test_allocation_is_reverse_water_filling():
    """Greedy allocation against brute force over every allocation of the budget (the oracle)."""
    import itertools

    d = [kltq.gaussian_distortion(b) for b in range(kltq.MAX_BITS + 1)]
    rng = np.random.default_rng(5)
    for total in (3, 7, 12):
        lam = np.sort(rng.exponential(size=4) ** 3)[::-1]
        best = min(
            (b for b in itertools.product(range(kltq.MAX_BITS + 1), repeat=4) if sum(b) == total),
            key=lambda b: sum(x * d[i] for x, i in zip(lam, b)),
        )
        got = kltq.allocate(lam, total)
        assert sum(x * d[i] for x, i in zip(lam, got)) == pytest.approx(sum(x * d[i] for x, i in zip(lam, best)))
    assert kltq.allocate(np.ones(4), 100).sum() == 4 * kltq.MAX_BITS
    assert kltq.allocate(np.array([1.0, 0.0]), 3).tolist() == [3, 0]


def test_records_match_a_per_value_transcription_of_the_layout():
    k, q = data(0)
    side = kltq.calibrate(k, 3.5, q, skip=1)
    x = k[1][:7]
    rec = kltq.quantize(side, 1, x)
    assert rec.shape == (7, 2, 32 * 3.5 / 8) and rec.dtype == np.uint8
    c = kltq.coefficients(side, 1, x)
    for t in range(7):
        for h in range(2):
            bits: list[int] = []
            for i in range(32):
                b = int(side.alloc[1, h, i])
                if not b:
                    continue
                levels = side.codebooks[1, b, : 1 << b].astype(np.float64) * float(side.sigma[1, h, i])
                code = int(np.argmin(np.abs(levels - c[t, h, i])))  # nearest; ties: the lower
                bits += [(code >> j) & 1 for j in range(b)]
            bits += [0] * (len(rec[t, h]) * 8 - len(bits))
            want = [sum(bits[8 * j + m] << m for m in range(8)) for j in range(len(rec[t, h]))]
            assert list(rec[t, h]) == want
    assert np.array_equal(kltq.pack(kltq.unpack(rec, side.alloc[1]), side.alloc[1], side.row_bytes), rec)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([2.0, 3.0, 4.5, 6.0, 8.0]), st.booleans())
def test_property_roundtrip_and_attention_identity(seed, bits, weighted):
    k, q = data(seed % 1000, n=64, layers=1, d=16)
    side = kltq.calibrate(k, bits, q if weighted else None)
    assert (side.alloc[0].sum(axis=1) == min(int(bits * 16), 16 * kltq.MAX_BITS)).all()
    rec = kltq.quantize(side, 0, k[0])
    # decode is deterministic and re-encoding the decoded values gives the same bytes (levels are fixed points)
    xd = kltq.dequantize(side, 0, rec)
    assert np.array_equal(kltq.quantize(side, 0, xd), rec)
    # scores against decoded coefficients after q's transform = scores against (x' - mu), in float64
    c = kltq.decode_coefficients(side, 0, rec).astype(np.float64)
    qc = kltq.query(side, 0, q[0]).astype(np.float64)
    s_codec = np.einsum("nhd,mhd->hnm", qc, np.repeat(c, 3, axis=1))
    s_ref = np.einsum("nhd,mhd->hnm", q[0].astype(np.float64), np.repeat(xd - side.mean[0][None], 3, axis=1))
    assert np.abs(s_codec - s_ref).max() <= 1e-4 * (1 + np.abs(s_ref).max())


def test_more_bits_less_error_and_weighting_lowers_score_error():
    k, q = data(3, n=400, layers=1, d=32)
    err = []
    for bits in (2.0, 3.0, 4.0, 6.0):
        side = kltq.calibrate(k, bits, None)
        err.append(float(((kltq.dequantize(side, 0, kltq.quantize(side, 0, k[0])) - k[0]) ** 2).mean()))
    assert err == sorted(err, reverse=True) and err[-1] < err[0] / 50

    def score_err(weighted: bool) -> float:
        side = kltq.calibrate(k, 3.0, q if weighted else None)
        e = kltq.dequantize(side, 0, kltq.quantize(side, 0, k[0])).astype(np.float64) - k[0]
        return float((np.einsum("nhd,mhd->nhm", q[0][:, ::3].astype(np.float64), e) ** 2).mean())

    assert score_err(True) < score_err(False)


def test_rd_channel_meets_the_gaussian_distortion_rate_function():
    rng = np.random.default_rng(7)
    n, d = 20000, 8
    lam = np.array([8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05])
    k = (rng.standard_normal((n, 1, d)) * np.sqrt(lam)).astype(np.float32)
    q = np.tile(np.eye(d, dtype=np.float32), (n // d, 1))[:, None, :]  # E[qq^T] = I/d: plain MSE
    for bits in (1.0, 2.0, 3.0):
        dist = kltq.water_level(lam, bits * d)
        assert np.maximum(0, np.log2(lam / dist) / 2).sum() == pytest.approx(bits * d, rel=1e-6)
        out = kltq.rd_channel(k, q, bits)
        assert ((out - k) ** 2).sum(axis=2).mean() == pytest.approx(dist.sum(), rel=0.05)


def test_side_data_saves_loads_and_names_itself(tmp_path):
    k, q = data(1)
    side = kltq.calibrate(k, 4.5, q, skip=1)
    path = tmp_path / "s.npz"
    side.save(path)
    again = kltq.Side.load(path)
    assert again.digest() == side.digest() and again.shape == side.shape
    other = kltq.calibrate(k, 4.5, None, skip=1)
    assert other.digest() != side.digest()
    with pytest.raises(SpecError, match="--calibrate"):
        kltq.Side.load(tmp_path / "missing.npz")


def test_side_data_files_that_are_not_whole_are_a_spec_error(tmp_path, capfd):
    """A truncated, bit-flipped (the .npz's CRCs) or compressed-and-damaged calibration file, a lone .npy and a
    non-path are SpecErrors, never zipfile's/zlib's raw errors; save refuses a non-path (``open(True)`` wrote the
    file to stdout) and a path it cannot write."""
    k, _ = data(4, layers=1)
    side = kltq.calibrate(k, 4.5)
    path = tmp_path / "s.npz"
    side.save(path)
    raw = path.read_bytes()
    np.savez_compressed(tmp_path / "c.npz", **side.arrays())
    packed = bytearray((tmp_path / "c.npz").read_bytes())
    packed[len(packed) // 2] ^= 0xFF
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0x10
    for i, blob in enumerate((raw[: len(raw) // 2], b"", bytes(flipped), bytes(packed))):
        (tmp_path / f"{i}.npz").write_bytes(blob)
        with pytest.raises(SpecError, match="cannot be read"):
            kltq.Side.load(tmp_path / f"{i}.npz")
    np.save(tmp_path / "a.npy", side.mean)
    for bad in (tmp_path / "a.npy", 3, None):
        with pytest.raises(SpecError):
            kltq.Side.load(bad)
    for bad in (True, None, tmp_path):
        with pytest.raises(SpecError):
            side.save(bad)
    assert capfd.readouterr().out == ""


def test_malformed_side_data_is_refused_typed(tmp_path):
    """Side data whose arrays could not be the codec's (not a budget, fractional or wrapping bits, NaN/inf,
    levels out of order: the spec's and the kernels' nearest-level searches disagree there, wrong shapes or
    dtypes) is a typed error when built, and a SpecError naming the file when loaded: never a raw numpy error,
    never accepted (a u8 cast wrapped alloc's 256 to 0)."""
    k, _ = data(3, layers=1)
    side = kltq.calibrate(k, 4.5)
    good = side.arrays()
    nan_mean = side.mean.copy()
    nan_mean[0, 0, 0] = np.nan
    bad = {
        "bits": np.array(100.0),
        "weighted": np.array("False"),
        "mean": nan_mean,
        "analysis": np.full(side.analysis.shape, 1e300),  # inf in f32
        "sigma": -side.sigma,
        "alloc": side.alloc.astype(np.int64) + 256,
        "codebooks": side.codebooks[:, :, ::-1].copy(),
    }
    for name, value in [*bad.items(), ("mean", side.mean[0]), ("mean", np.full(side.mean.shape, "a")),
                        ("bits", np.zeros(0)), ("alloc", side.alloc + 0.5)]:  # fmt: skip
        path = tmp_path / f"{name}.npz"
        np.savez(path, **{**good, name: value})
        with pytest.raises(SpecError, match=f"{path.name}.*malformed"):
            kltq.Side.load(path)
    fields = dict(side.__dict__)
    for name, value in (("bits", "4.5"), ("bits", True), ("bits", 4.25 + 1e-9), ("bits", 10**400), ("weighted", "x"),
                        ("mean", [1.0]), ("alloc", bad["alloc"]), ("mean", nan_mean),
                        ("codebooks", bad["codebooks"])):  # fmt: skip
        with pytest.raises((SpecError, FormatError, ShapeError, NonFiniteError)):
            kltq.Side(**{**fields, name: value})


def test_calibrate_refuses_what_is_not_keys_and_queries():
    """NaN keys made NaN side data, a negative skip calibrated on the last tokens, queries of another head_dim,
    head count or token count were reshaped silently (or raised raw), a numpy int budget was refused: each is
    now checked before anything is computed."""
    k, q = data(5)
    bad_k = [k[0], k[1].copy()]
    bad_k[1][3, 0, 0] = np.nan
    assert kltq.calibrate(k, np.int64(4)).bits == 4.0
    for args, kw, error in (
        ((bad_k, 4.5), {}, NonFiniteError),
        ((k, 10**400), {}, FormatError),  # an int past float's range: no raw OverflowError
        ((k, 4.5), {"skip": -1}, SpecError),
        ((k, 4.5), {"skip": 1.0}, SpecError),
        ((k, 4.5, [x[:, :, :16] for x in q]), {}, ShapeError),  # another head_dim
        ((k, 4.5, [x[:, :3] for x in q]), {}, ShapeError),  # 3 query heads over 2 KV heads
        ((k, 4.5, [x[:5] for x in q]), {}, ShapeError),
        ((k, 4.5, q[:1]), {}, ShapeError),
        ((k[0], 4.5), {}, ShapeError),
        (([np.full((5, 2, 32), "a")], 4.5), {}, DTypeError),
        (([k[0][:, :0]], 4.5), {}, ShapeError),
    ):
        with pytest.raises(error):
            kltq.calibrate(*args, **kw)


def test_arguments_are_checked():
    k, q = data(2, layers=1)
    side = kltq.calibrate(k, 4.0, q)
    with pytest.raises(ShapeError):
        kltq.quantize(side, 0, k[0][:, :1])
    with pytest.raises(ShapeError):
        kltq.quantize(side, 3, k[0])
    bad = k[0].copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(NonFiniteError):
        kltq.quantize(side, 0, bad)
    with pytest.raises(FormatError):
        kltq.calibrate(k, 9.0)
    with pytest.raises(SpecError):
        kltq.calibrate(k, True)  # type: ignore[arg-type]
    with pytest.raises(ShapeError):
        kltq.decode_coefficients(side, 0, np.zeros((2, 2, 3), np.uint8))


def test_record_functions_check_their_layer_and_rows():
    """A negative layer read the last layer's side data silently, a bool or float layer and rows of another
    shape or dtype raised raw numpy errors (records of another dtype were cast: -1 wrapped to 255), queries with
    fewer heads than KV heads came back empty: each is now a typed error; numpy ints are layers."""
    k, q = data(2)
    side = kltq.calibrate(k, 4.0, q)
    rows = kltq.quantize(side, np.int64(1), k[1][:4])
    coeffs = kltq.decode_coefficients(side, 0, rows)
    calls = (
        (kltq.quantize, k[0][:4]),
        (kltq.decode_coefficients, rows),
        (kltq.dequantize, rows),
        (kltq.synthesize, coeffs),
        (kltq.coefficients, k[0][:4]),
        (kltq.query, q[0][:4]),
    )
    for f, x in calls:
        for layer in (-1, 2, True, 1.0, "0", None):
            with pytest.raises(ShapeError, match="layer"):
                f(side, layer, x)
        with pytest.raises(SpecError):
            f(None, 0, x)
    for layer in (-1, 2, True):
        with pytest.raises(ShapeError, match="layer"):
            kltq.layer_side(side, layer)
    for f, x, error in (
        (kltq.quantize, "abc", DTypeError),
        (kltq.decode_coefficients, rows.astype(np.int64) - 1, DTypeError),
        (kltq.decode_coefficients, rows.tobytes(), DTypeError),
        (kltq.query, q[0][:4, :1], ShapeError),  # 1 query head over 2 KV heads
        (kltq.query, q[0][:4, :3], ShapeError),
        (kltq.query, q[0][:4, :, :16], ShapeError),
        (kltq.synthesize, coeffs[:, :1], ShapeError),
        (kltq.coefficients, k[0][:4, :, :8], ShapeError),
    ):
        with pytest.raises(error):
            f(side, 0, x)
    other = kltq.calibrate([x[:, :, :16] for x in k], 4.0)
    for layers in ([kltq.layer_side(side, 0), kltq.layer_side(other, 0)], [None], side):
        with pytest.raises(ShapeError):
            kltq.join_layers(layers)  # type: ignore[arg-type]
    for name in (4.5, None):
        with pytest.raises(FormatError):
            kltq.parse_name(name)  # type: ignore[arg-type]


def test_record_functions_take_torch_rows():
    """Rows as torch tensors are rows, as everywhere in kvhal: one that requires grad raised torch's raw
    RuntimeError, a bfloat16 one numpy's raw TypeError (then a DTypeError of 'object')."""
    torch = pytest.importorskip("torch")
    k, q = data(2)
    side = kltq.calibrate(k, 4.0, q)
    x = torch.from_numpy(k[0][:4].copy()).bfloat16()
    for t in (x, x.float().requires_grad_()):
        np.testing.assert_array_equal(kltq.quantize(side, 0, t), kltq.quantize(side, 0, x.float().numpy()))
    np.testing.assert_array_equal(
        kltq.query(side, 0, torch.from_numpy(q[0][:4]).requires_grad_()), kltq.query(side, 0, q[0][:4])
    )
    for bits, dim in (("4", 32), (8.0, True), (8.0, 1.0)):
        with pytest.raises(FormatError):
            kltq.row_bytes(bits, dim)  # type: ignore[arg-type]
