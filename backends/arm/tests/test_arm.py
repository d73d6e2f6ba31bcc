"""arm backend: bit-exact quantization graphs, the KleidiAI toggle, providers, session caching.

Every numeric check compares against kvhal's numpy reference (the format spec) or the float64 oracle.
Run from the repository root (the contract suite and ``tests.oracle`` live there).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import kvhal
from kvhal import formats
from tests.oracle import attention_f64

pytest.importorskip("onnxruntime")
import kvhal_arm  # noqa: E402
from kvhal_arm import ArmBackend, graphs  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
OUTER_KLEIDIAI = os.environ.get("KVHAL_KLEIDIAI", "").strip()  # read before the fixture below clears it
FORMATS = sorted(ArmBackend.formats)
TOGGLE = [pytest.param(True, id="kleidiai-on"), pytest.param(False, id="kleidiai-off")]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests pick their settings explicitly; the outer run's KVHAL_KLEIDIAI must not leak into them
    monkeypatch.delenv("KVHAL_KLEIDIAI", raising=False)
    monkeypatch.delenv("KVHAL_ORT_PROVIDERS", raising=False)
    monkeypatch.delenv("KVHAL_ORT_THREADS", raising=False)


def cache(
    fmt: str,
    kleidiai: bool | None = None,
    *,
    heads: int = 2,
    dim: int = 64,
    cap: int = 256,
    bs: int = 16,
    backend: str = "arm",
    v_fmt: str | None = None,
) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(
        n_layers=1, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=v_fmt or fmt, block_size=bs
    )
    if backend != "arm":
        return kvhal.KVCache(spec, cap, backend=backend)
    # a fresh instance: it reads the environment the test set (the registry's shared one read it once)
    return kvhal.KVCache(spec, cap, backend=ArmBackend(**({} if kleidiai is None else {"kleidiai": kleidiai})))


def adversarial(fmt: str, rng: np.random.Generator, n: int = 24, heads: int = 2, dim: int = 64) -> np.ndarray:
    """Blocks that separate correct rounding from near misses: ties, halves, zeros, subnormals, extremes."""
    x = rng.standard_normal((n, heads, dim), dtype=np.float32)
    x[0] = 0
    x[1, 0, :32] = np.float32(1e-40)  # subnormal block: its scale underflows
    x[2, 0, :32] = np.arange(-16, 16) + np.float32(0.5)  # q8_0: amax 15.5, many exact halves after scaling
    x[2, 1, :32] = 0
    x[2, 1, 0], x[2, 1, 1] = 127, -63.5  # q8_0 d = 1: -63.5 must round away from zero to -64
    x[3, 0, :32] = np.linspace(-1, 1, 32)
    x[3, 0, 4], x[3, 0, 9] = 1.0, -1.0  # signed-absmax ties: the first occurrence (-1 at 0) wins
    x[3, 1, :32] = 3.0  # constant block: d = 0 for the min/max formats
    x[4] *= np.float32(1e-6)
    x[5] *= np.float32(6e3)
    x[6] = rng.integers(-8, 9, (heads, dim)).astype(np.float32)  # q4/q5 values landing on .5 after +8.5
    x[7, 0, :32] = -8.0
    x[7, 0, 31] = 8.0  # ±max tie, last occurrence positive
    x[8] = -0.0  # all -0: ggml's absmax stays +0, its min/max are the first -0
    x[9, :, :32] = 0.0
    x[9, 0, 31] = x[9, 1, 0] = -0.0  # zero min/max of both signs: the first occurrence decides d and m
    lim = formats.get(fmt).max_abs
    return np.clip(x, -lim, lim)


def pool_bytes(c: kvhal.KVCache) -> tuple[np.ndarray, np.ndarray]:
    p = c.pools
    return (np.asarray(c.backend.to_numpy(p.k[0])).view(np.uint8), np.asarray(c.backend.to_numpy(p.v[0])).view(np.uint8))


@pytest.mark.parametrize("kleidiai", TOGGLE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_bit_exact_and_load_exact(fmt: str, kleidiai: bool) -> None:
    rng = np.random.default_rng(7)
    got, want = cache(fmt, kleidiai), cache(fmt, backend="reference")
    for seed_round in range(3):
        k, v = adversarial(fmt, rng), adversarial(fmt, rng)[::-1].copy()
        for c in (got, want):
            s = c.new_seq() if seed_round == 0 else 0
            c.store(s, 0, k[:1], v[:1])
            c.store(s, 0, k[1:], v[1:])
    for a, b in zip(pool_bytes(got), pool_bytes(want), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got.load(0, 0, 3, 60), want.load(0, 0, 3, 60), strict=True):
        # the dequantize graph does the reference's float ops in its order: equal to the bit
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    x=arrays(np.float32, (3, 2, 64), elements=st.floats(-3e4, 3e4, width=32, allow_subnormal=True)),
)
def test_quantize_graph_matches_spec_property(fmt: str, x: np.ndarray) -> None:
    f = formats.get(fmt)
    sess = ArmBackend()._session("store", fmt, fmt, 2, 64)
    rows, _ = sess.run(None, {"k": x, "v": x})
    np.testing.assert_array_equal(np.ascontiguousarray(rows).view(np.uint8).reshape(3, 2, -1), f.quantize(x))


CASES = {
    "decode-batch": (8, 2, [3, 40, 70], [1, 1, 1], True, None),
    "chunked-prefill": (4, 4, [50, 9], [12, 9], True, None),
    "window": (4, 1, [60], [5], True, 9),
    "non-causal": (4, 2, [25, 7], [4, 2], False, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0", "f16"])
def test_attention_under_both_toggles(fmt: str, case: str) -> None:
    n_heads, n_kv, lens, q_lens, causal, window = CASES[case]
    f = formats.get(fmt)
    rng = np.random.default_rng(11)
    data = [
        (rng.standard_normal((n, n_kv, 64), dtype=np.float32), rng.standard_normal((n, n_kv, 64), dtype=np.float32))
        for n in lens
    ]
    q = rng.standard_normal((sum(q_lens), n_heads, 64), dtype=np.float32)
    want = attention_f64(
        q,
        [f.dequantize(f.quantize(k)) for k, _ in data],
        [f.dequantize(f.quantize(v)) for _, v in data],
        q_lens,
        causal=causal,
        window=window,
    )
    outs = []
    for kleidiai in (True, False):
        c = cache(fmt, kleidiai, heads=n_kv, cap=sum(lens) + 64)
        seqs = []
        for k, v in data:
            seqs.append(c.new_seq())
            c.store(seqs[-1], 0, k, v)
        outs.append(kvhal.to_numpy(c.attention(0, q, seqs, q_lens, causal=causal, window=window)))
        assert np.abs(outs[-1] - want).max() <= ArmBackend.attention_tolerance
    # off x86 the toggle is inert, so both runs are the same computation; on arm64 both meet the oracle
    if not kvhal_arm.kleidiai_can_apply():
        np.testing.assert_array_equal(outs[0], outs[1])


def test_split_runs_match_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny run budget forces per-sequence runs and query chunks; the answer must not change."""
    rng = np.random.default_rng(3)
    c = cache("q8_0", heads=2, cap=512)
    lens, q_lens = [70, 5, 33], [20, 1, 33]
    seqs = []
    for n in lens:
        seqs.append(c.new_seq())
        c.store(
            seqs[-1],
            0,
            rng.standard_normal((n, 2, 64), dtype=np.float32),
            rng.standard_normal((n, 2, 64), dtype=np.float32),
        )
    q = rng.standard_normal((sum(q_lens), 4, 64), dtype=np.float32)
    whole = kvhal.to_numpy(c.attention(0, q, seqs, q_lens, window=17))
    backend = c.backend
    assert isinstance(backend, ArmBackend)
    monkeypatch.setattr(ArmBackend, "run_budget", 20_000)
    runs = backend._plan(c.spec, np.array(lens), np.array(q_lens), np.array([0, 20, 21]), 4)
    assert len(runs) > len(lens)  # some sequence's queries were split across runs
    split = kvhal.to_numpy(c.attention(0, q, seqs, q_lens, window=17))
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("option", "env", "expect"),
    [
        (None, None, "0"),
        (True, None, "0"),
        (False, None, "1"),
        (None, "0", "1"),
        (None, "1", "0"),
        (True, "0", "0"),
    ],
)
def test_sessions_receive_the_kleidiai_entry(
    monkeypatch: pytest.MonkeyPatch, option: bool | None, env: str | None, expect: str
) -> None:
    if env is not None:
        monkeypatch.setenv("KVHAL_KLEIDIAI", env)
    c = cache("q4_0", option)
    s = c.new_seq()
    rng = np.random.default_rng(0)
    c.store(s, 0, rng.standard_normal((5, 2, 64), dtype=np.float32), rng.standard_normal((5, 2, 64), dtype=np.float32))
    c.load(s, 0)
    c.attention(0, rng.standard_normal((1, 2, 64), dtype=np.float32), [s])
    backend = c.backend
    assert isinstance(backend, ArmBackend)
    assert {k[0] for k in backend.sessions} == {"store", "load", "attention"}
    for sess in backend.sessions.values():  # the options each live session was really built with
        assert sess.get_session_options().get_session_config_entry("mlas.disable_kleidiai") == expect
    assert f"mlas.disable_kleidiai={expect}" in backend.describe()


def test_threads_reach_the_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ArmBackend(threads=1).session_options(exact=True).intra_op_num_threads == 1
    monkeypatch.setenv("KVHAL_ORT_THREADS", "2")
    b = ArmBackend()
    assert b._session("store", "q8_0", "q8_0", 2, 64).get_session_options().intra_op_num_threads == 2
    assert "2 intra-op threads" in b.describe()
    assert ArmBackend(threads=0).settings.threads == 0  # the option beats the environment


def test_no_session_per_decode_step() -> None:
    rng = np.random.default_rng(5)
    c = cache("q5_1", cap=1024)
    s = c.new_seq()
    c.store(
        s, 0, rng.standard_normal((40, 2, 64), dtype=np.float32), rng.standard_normal((40, 2, 64), dtype=np.float32)
    )
    c.attention(0, rng.standard_normal((40, 4, 64), dtype=np.float32), [s])
    built = len(kvhal_arm._SESSIONS)
    for _ in range(30):  # decode: one token stored, one query, the context grows across pages
        c.store(
            s, 0, rng.standard_normal((1, 2, 64), dtype=np.float32), rng.standard_normal((1, 2, 64), dtype=np.float32)
        )
        c.attention(0, rng.standard_normal((1, 4, 64), dtype=np.float32), [s])
    assert len(kvhal_arm._SESSIONS) == built
    other = cache("q5_1", cap=64)  # a second cache of the same shape class reuses the sessions
    other.store(other.new_seq(), 0, *(rng.standard_normal((3, 2, 64), dtype=np.float32) for _ in range(2)))
    assert len(kvhal_arm._SESSIONS) == built


@pytest.mark.parametrize("fmt", FORMATS)
def test_graphs_read_the_stored_integers(fmt: str) -> None:
    """The load/attention graphs take the pools as integer tensors: dequantization happens in the graph."""
    b = ArmBackend()
    dt = graphs.view_dtype(fmt)
    assert np.issubdtype(dt, np.integer)
    want = f"tensor({dt.name})"
    for op, key in (("load", (fmt, fmt, 2, 16, 64)), ("attention", (fmt, fmt, 4, 2, 16, 64))):
        inputs = {i.name: i.type for i in b._session(op, *key).get_inputs()}
        assert inputs["k_pool"] == inputs["v_pool"] == want


def test_providers_option_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    assert ArmBackend().settings.providers == ("CPUExecutionProvider",)
    assert ArmBackend(providers="CPUExecutionProvider").settings.providers_source == "providers option"
    with pytest.raises(kvhal.BackendUnavailableError) as e:
        ArmBackend(providers=["NoSuchExecutionProvider", "CPUExecutionProvider"])
    assert "NoSuchExecutionProvider" in str(e.value)
    for p in onnxruntime.get_available_providers():
        assert p in str(e.value)
    monkeypatch.setenv("KVHAL_ORT_PROVIDERS", "NoSuchExecutionProvider")
    with pytest.raises(kvhal.BackendUnavailableError, match="KVHAL_ORT_PROVIDERS"):
        cache("f16")
    monkeypatch.setenv("KVHAL_ORT_PROVIDERS", " CPUExecutionProvider ,")
    assert cache("f16").backend.settings.providers == ("CPUExecutionProvider",)  # type: ignore[attr-defined]


def test_bad_settings_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(kvhal.SpecError, match="no option"):
        ArmBackend(thread_count=4)
    for bad in (-1, "two", True, 1.5, "2"):  # no silent truncation or bool-as-int
        with pytest.raises(kvhal.SpecError, match="option threads"):
            ArmBackend(threads=bad)
    for bad in ("maybe", 2, 0.0, "1"):
        with pytest.raises(kvhal.SpecError, match="option kleidiai"):
            ArmBackend(kleidiai=bad)
    for bad in ([], ",", ["CPUExecutionProvider", 1], 3):
        with pytest.raises(kvhal.SpecError, match="option providers"):
            ArmBackend(providers=bad)
    for env, value in (("KVHAL_KLEIDIAI", "yes"), ("KVHAL_ORT_THREADS", "-1"), ("KVHAL_ORT_THREADS", "1.5")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            probe = ArmBackend.probe()
            assert probe.score is None and env in probe.reason and value in probe.reason
            with pytest.raises(kvhal.SpecError, match=env):
                ArmBackend()
            with pytest.raises(kvhal.BackendUnavailableError, match=env):
                kvhal.KVCache(kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32), 16, backend="arm")
    monkeypatch.setenv("KVHAL_KLEIDIAI", "yes")
    assert ArmBackend(kleidiai=False).settings.kleidiai is False  # the option still beats a bad env value
    assert ArmBackend(kleidiai=0).settings.kleidiai is False


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "arm64"])
def test_probe_reports_kleidiai(monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv("KVHAL_KLEIDIAI", "0")
    p = ArmBackend.probe()
    assert p.available
    assert "KleidiAI off (KVHAL_KLEIDIAI=0; mlas.disable_kleidiai=1)" in p.reason
    if machine == "x86_64":
        assert "cannot apply on this x86_64 machine (arm64 only)" in p.reason and p.score == 5
    else:
        assert f"applies on this {machine} machine" in p.reason and p.score == 30
    assert "KleidiAI off" in ArmBackend().describe()


def test_probe_reason_when_onnxruntime_missing_or_old(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kvhal_arm.importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(kvhal_arm.importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else real(name))
        assert ArmBackend.probe() == kvhal.Probe(
            None, "onnxruntime is not installed (pip install kvhal-arm, or pip install onnxruntime onnx)"
        )
        with pytest.raises(kvhal.BackendUnavailableError, match="onnxruntime is not installed"):
            ArmBackend()
    real_version = kvhal_arm.importlib.metadata.version
    monkeypatch.setattr(
        kvhal_arm.importlib.metadata, "version", lambda d: "1.24.4" if d == "onnxruntime" else real_version(d)
    )
    probe = ArmBackend.probe()
    assert probe.score is None and "onnxruntime 1.24.4 is too old" in probe.reason and ">= 1.25" in probe.reason
    with pytest.raises(kvhal.BackendUnavailableError, match="too old"):
        ArmBackend()


def test_import_kvhal_imports_no_onnxruntime() -> None:
    code = (
        "import sys, kvhal; infos = {i.name: i for i in kvhal.backends()}; assert infos['arm'].available; "
        "bad = [m for m in ('onnxruntime', 'onnx') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_contract_suite_with_the_other_kleidiai_setting() -> None:
    """The outer run covers the KleidiAI setting in force; this reruns tests/contract with the other one."""
    if not (ROOT / "tests" / "contract").is_dir():
        pytest.skip("tests/contract not found next to this backend (run from the kvhal repository)")
    other = "1" if OUTER_KLEIDIAI == "0" else "0"  # unset means on
    env = {**os.environ, "KVHAL_TEST_BACKENDS": "arm", "KVHAL_STRICT": "1", "KVHAL_KLEIDIAI": other}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/contract", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    tail = "\n".join(r.stdout.strip().splitlines()[-5:])
    # the only skips: specs arm's supports() refuses (the contract suite skips with that reason); nothing else
    other_skips = [x for x in r.stdout.splitlines() if x.startswith("SKIPPED") and ": arm refuses " not in x]
    assert r.returncode == 0 and "passed" in tail and not other_skips, f"KVHAL_KLEIDIAI={other}:\n{tail}\n{other_skips}"
