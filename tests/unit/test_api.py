"""The public API: validation, typed errors, interop, registry selection, stats, import weight."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import numpy as np
import pytest

import kvhal
from kvhal import formats
from kvhal.reference import ReferenceBackend
from tests.oracle import attention_f64


def cache(cap: int = 64, **kw) -> kvhal.KVCache:
    spec = kvhal.CacheSpec(
        **(
            {"n_layers": 2, "n_kv_heads": 2, "head_dim": 32, "k_format": "q8_0", "v_format": "q4_0", "block_size": 8}
            | kw
        )
    )
    return kvhal.KVCache(spec, cap, backend="reference")


def rows(n: int, heads: int = 2, dim: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, heads, dim), dtype=np.float32)


def test_import_is_light():
    """``import kvhal`` loads numpy and the standard library, nothing else: no vendor SDK, torch, transformers, redis
    or backend package until the part that needs it is used (checked by what it loads, not by a clock)."""
    code = (
        "import sys; before = set(sys.modules); import kvhal; "
        "tops = {m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names); "
        "print(' '.join(sorted(t for t in tops if not t.startswith('__editable__'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) == {"kvhal", "numpy"}, f"import kvhal imported {sorted(set(out) - {'kvhal', 'numpy'})}"


def test_import_loads_no_tool():
    """The library never imports kvhal.tools (the command, benchmarks, plan, eval): not on ``import kvhal``, nor
    from any other library module."""
    code = (
        "import importlib, pathlib, sys, kvhal; at_import = sorted(m for m in sys.modules if m.startswith('kvhal.tools')); "
        "root = pathlib.Path(kvhal.__file__).parent; "
        "names = ['.'.join(('kvhal', *f.relative_to(root).with_suffix('').parts)).removesuffix('.__init__') "
        "for f in sorted(root.rglob('*.py'))]; "
        "names = [n for n in names if not n.startswith(('kvhal.tools', 'kvhal.__main__', 'kvhal.integrations.'))]; "
        "[importlib.import_module(n) for n in names]; "
        "print(at_import, sorted(m for m in sys.modules if m.startswith('kvhal.tools')), len(names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["[]", "[]"], f"a tool module was imported: {out}"
    assert int(out[2]) > 20  # the walk saw the library


def test_block_ids_are_the_pages_in_order():
    c = cache(cap=64)
    s = c.new_seq()
    c.store(s, 0, rows(20), rows(20))
    ids = c.block_ids(s)
    assert len(ids) == 3 and len(set(ids)) == 3  # 20 tokens in pages of 8
    t = c.seq_cp(s, 0, 16)  # whole pages: shared
    assert c.block_ids(t) == ids[:2]
    ids.append(-1)  # a copy: the cache's own list is untouched
    assert len(c.block_ids(s)) == 3
    with pytest.raises(kvhal.SequenceError):
        c.block_ids(99)


def test_spec_validation():
    with pytest.raises(kvhal.SpecError, match="head_dim"):
        kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=0)
    with pytest.raises(kvhal.SpecError, match="multiple"):
        kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=48, k_format="q8_0")
    with pytest.raises(kvhal.FormatError, match="known formats"):
        kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, k_format="q9")
    for bad in (["q8_0"], {}):  # not a name: typed, not "unhashable"
        with pytest.raises(kvhal.FormatError, match="name such as"):
            kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_format=bad)
    # a registered Format is kept by its name (one spec, one hash, one fingerprint); another Format is refused
    spec = kvhal.CacheSpec(2, 2, 64, k_format=formats.get("q8_0"), v_format=formats.get("q4_0"))
    assert spec == kvhal.CacheSpec(2, 2, 64, "q8_0", "q4_0") and (spec.k_format, spec.v_format) == ("q8_0", "q4_0")
    fp = kvhal.Fingerprint("m")
    assert fp.digest(spec) == fp.digest(kvhal.CacheSpec(2, 2, 64, "q8_0", "q4_0"))
    with pytest.raises(kvhal.SpecError, match="not a registered format"):
        kvhal.CacheSpec(2, 2, 64, k_format=dataclasses.replace(formats.get("q8_0"), block_len=16))
    # page and pool sizes of K or V only, for a block count
    assert spec.pool_shape(np.int64(3), "k") == (3, 2, 16, 68) and spec.page_nbytes("v") == 2 * 16 * 36
    for which in ("x", None, "K"):
        with pytest.raises(kvhal.SpecError, match="which"):
            spec.page_nbytes(which)  # type: ignore[arg-type]
    for n_blocks in (-1, 2.0, "3", True):
        with pytest.raises(kvhal.SpecError, match="n_blocks"):
            spec.pool_shape(n_blocks, "k")  # type: ignore[arg-type]
    # numpy ints are ints, stored as plain ints (one spec, one hash); a bool is not
    spec = kvhal.CacheSpec(np.int64(2), np.int32(2), np.int64(64), block_size=np.int64(16), tail=np.int64(0))
    assert spec == kvhal.CacheSpec(2, 2, 64) and hash(spec) == hash(kvhal.CacheSpec(2, 2, 64))
    assert all(type(getattr(spec, f)) is int for f in ("n_layers", "n_kv_heads", "head_dim", "block_size", "tail"))
    with pytest.raises(kvhal.SpecError, match="n_layers"):
        kvhal.CacheSpec(n_layers=True, n_kv_heads=1, head_dim=32)
    with pytest.raises(kvhal.SpecError, match="k_scale"):
        kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, k_scale=2**1100)  # beyond float: not OverflowError
    with pytest.raises(kvhal.SpecError, match="tail"):
        kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, tail=-4)
    with pytest.raises(kvhal.SpecError, match="capacity_tokens"):
        kvhal.KVCache(kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32), 0, backend="reference")


def test_capacity_is_exact_and_reported():
    c = cache(cap=60)  # 60 tokens -> 8 blocks of 8 = 64 token slots, really allocated
    st = c.stats()
    assert (st.n_blocks, st.capacity_tokens) == (8, 64)
    per_token = 2 * 2 * (34 + 18)  # layers * heads * (q8_0 row + q4_0 row) for head_dim 32
    assert st.bytes_per_token == per_token
    assert st.k_bytes + st.v_bytes == st.bytes_allocated == 64 * per_token
    s = c.new_seq()
    c.store(s, 0, rows(64), rows(64))
    with pytest.raises(kvhal.CapacityError, match="free blocks"):
        c.store(s, 0, rows(1), rows(1))
    assert c.stats().blocks_free == 0 and c.seq_len(s, 0) == 64
    c.free_seq(s)
    assert c.stats().blocks_free == 8


def test_validation_errors_change_nothing():
    c = cache()
    s = c.new_seq()
    c.store(s, 0, rows(5), rows(5))
    snapshot = c.stats(), [k.copy() for k in c.pools.k]
    bad = [
        (kvhal.ShapeError, lambda: c.store(s, 0, rows(3, heads=1), rows(3, heads=1))),
        (kvhal.ShapeError, lambda: c.store(s, 0, rows(3), rows(2))),
        (kvhal.ShapeError, lambda: c.store(s, 0, rows(3)[0], rows(3)[0])),
        (kvhal.DTypeError, lambda: c.store(s, 0, rows(3).astype(np.float64), rows(3))),
        (kvhal.DTypeError, lambda: c.store(s, 0, rows(3).astype(np.int32), rows(3))),
        (kvhal.NonFiniteError, lambda: c.store(s, 0, rows(3), rows(3) * np.float32(np.inf))),
        (kvhal.NonFiniteError, lambda: c.store(s, 0, rows(3) * np.float32(1e5), rows(3))),
        (kvhal.SequenceError, lambda: c.store(99, 0, rows(3), rows(3))),
        (kvhal.PositionError, lambda: c.store(s, 2, rows(3), rows(3))),
        (kvhal.PositionError, lambda: c.load(s, 0, 2, 9)),
        (kvhal.PositionError, lambda: c.seq_rm(s, 4, 2)),
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=3), [s])),
        (kvhal.ShapeError, lambda: c.attention(0, rows(2, heads=4), [s], [1])),
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [])),
        (kvhal.ShapeError, lambda: c.attention(0, rows(0, heads=4), [s])),  # as q_lens=[0] is
        (kvhal.ShapeError, lambda: c.attention(0, rows(0, heads=4), [s], [0])),
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [s], window=0)),
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [s], window=2**63)),  # not OverflowError
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [s], window=2**62 + 1)),
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [s], scale=10**400)),  # beyond float
        (kvhal.ShapeError, lambda: c.attention(0, rows(1, heads=4), [s], scale=-1e39)),  # beyond float32: inf there
        (kvhal.PositionError, lambda: c.attention(1, rows(1, heads=4), [s])),  # layer 1 holds nothing yet
    ]
    for err, call in bad:
        with pytest.raises(err) as info:
            call()
        assert isinstance(info.value, kvhal.KVHalError) and len(str(info.value)) > 20
    assert c.stats() == snapshot[0]
    for p, k in zip(c.pools.k, snapshot[1]):
        np.testing.assert_array_equal(p, k)
    # the largest window (2**62) covers the whole sequence on every backend: no window at all
    for b in (b.name for b in kvhal.backends() if b.name in ("reference", "cpu") and b.available):
        d = kvhal.KVCache(c.spec, 64, backend=b)
        t = d.new_seq()
        d.store(t, 0, rows(5), rows(5))
        q = rows(1, heads=4, seed=3)
        np.testing.assert_array_equal(d.attention(0, q, [t], window=2**62), d.attention(0, q, [t]))


def test_ml_dtypes_bfloat16_arrays_are_stored_as_their_float32_values():
    """What load(dtype="bfloat16") returns, store takes: widened exactly, as a torch bf16 tensor is."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    c = cache(k_format="f16", v_format="q8_0")
    s, t = c.new_seq(), c.new_seq()
    k, v = rows(9).astype(ml_dtypes.bfloat16), rows(9, seed=1).astype(ml_dtypes.bfloat16)
    c.store(s, 0, k, v)
    c.store(t, 0, k.astype(np.float32), v.astype(np.float32))
    for a, b in zip(c.load_rows(s, 0), c.load_rows(t, 0)):
        np.testing.assert_array_equal(a, b)


def test_float16_and_torch_inputs_through_dlpack():
    torch = pytest.importorskip("torch")
    c = cache(k_format="f16", v_format="q8_0")
    s = c.new_seq()
    k, v = rows(9), rows(9, seed=1)
    c.store(s, 0, torch.from_numpy(k), torch.from_numpy(v).half())
    got_k, got_v = (kvhal.to_numpy(x) for x in c.load(s, 0))
    np.testing.assert_array_equal(got_k, k.astype(np.float16).astype(np.float32))
    f = formats.get("q8_0")
    np.testing.assert_array_equal(got_v, f.dequantize(f.quantize(v.astype(np.float16).astype(np.float32))))
    q = torch.from_numpy(rows(1, heads=4, seed=2))
    out = kvhal.to_numpy(c.attention(0, q, [s]))
    want = attention_f64(q.numpy(), [got_k], [got_v], [1])
    np.testing.assert_allclose(out, want, atol=1e-6)
    kb = torch.from_numpy(k).bfloat16()  # widened exactly: the stored bytes are those of kb.float()
    c.store(s, 0, kb, torch.from_numpy(v))
    np.testing.assert_array_equal(
        kvhal.to_numpy(c.load(s, 0, 9)[0]), kb.float().numpy().astype(np.float16).astype(np.float32)
    )
    with pytest.raises(kvhal.DTypeError, match="float32"):
        c.store(s, 0, torch.from_numpy(k).double(), torch.from_numpy(v))
    assert isinstance(kvhal.to_numpy(torch.ones(2)), np.ndarray)


def test_outputs_come_back_in_the_callers_array_library():
    torch = pytest.importorskip("torch")
    c = cache()
    s = c.new_seq()
    k = torch.from_numpy(rows(3))
    c.store(s, 0, k, k)
    q = torch.from_numpy(rows(3, heads=4, seed=1))
    out = c.attention(0, q, seqs=[s])
    t = kvhal.to_like(out, q)
    assert isinstance(t, torch.Tensor) and t.device == q.device and t.dtype == torch.float32
    assert np.shares_memory(t.numpy(), out)  # zero-copy on a host backend
    np.testing.assert_array_equal(t.numpy(), kvhal.to_numpy(out))
    assert kvhal.to_like(out, q.numpy()) is out  # numpy in, numpy out
    assert kvhal.to_like(t, q) is t


def test_seq_ops_semantics():
    c = cache(cap=128)
    s = c.new_seq()
    for layer in (0, 1):
        c.store(s, layer, rows(20), rows(20))
    k_all = kvhal.to_numpy(c.load(s, 0)[0])
    t = c.seq_cp(s, 0, 12)  # shares pages 0 and 1 (page 1 partly)
    assert c.stats().blocks_shared == 2 and c.seq_len(t) == 12
    c.store(t, 0, rows(3, seed=5), rows(3, seed=5))  # copy-on-write of page 1
    assert c.stats().blocks_shared == 1
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(s, 0)[0]), k_all)  # s untouched
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(t, 0, 0, 12)[0]), k_all[:12])
    c.seq_rm(s, 5, 9)  # middle: later tokens shift down
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(s, 0)[0]), np.concatenate([k_all[:5], k_all[9:]]))
    c.seq_rm(s, 10, -1)  # truncate
    assert c.seq_len(s) == 10
    c.seq_rm(s, -1, -1)  # everything
    assert c.seq_len(s) == 0
    u = c.seq_cp(t, 3, -1)  # unaligned: copied rows
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(u, 1)[0]), kvhal.to_numpy(c.load(t, 1)[0])[3:])
    c.seq_keep(u)
    assert c.seqs == [u] and c.stats().n_seqs == 1
    with pytest.raises(kvhal.SequenceError):
        c.seq_len(t)


def test_backend_selection(monkeypatch):
    assert isinstance(cache().backend, ReferenceBackend)
    names = [b.name for b in kvhal.backends()]
    assert "reference" in names
    monkeypatch.setenv("KVHAL_BACKEND", "no-such-backend")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32)
    with pytest.raises(kvhal.BackendUnavailableError, match="no backend named.*from KVHAL_BACKEND"):
        kvhal.KVCache(spec, 16)
    monkeypatch.setenv("KVHAL_BACKEND", "reference")
    assert kvhal.KVCache(spec, 16).backend.name == "reference"
    monkeypatch.setenv("KVHAL_BACKEND", " reference\n")  # stripped, as backend options' variables are
    assert kvhal.KVCache(spec, 16).backend.name == "reference"


def test_unsupported_format_is_an_error_unless_fallback_allowed(monkeypatch):
    class F16Only(ReferenceBackend):
        name = "f16only"
        formats = frozenset({"f16"})

        @classmethod
        def probe(cls) -> kvhal.Probe:
            return kvhal.Probe(10, "test backend")

    from kvhal import registry

    monkeypatch.setattr(registry, "_classes", lambda: {"reference": ReferenceBackend, "f16only": F16Only})
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, k_format="q4_0", v_format="f16")
    with pytest.raises(kvhal.UnsupportedError, match="backends that take it: reference"):
        kvhal.KVCache(spec, 16, backend="f16only")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c = kvhal.KVCache(spec, 16, backend="f16only", allow_fallback=True)
    assert c.backend.name == "reference" and "falling back" in str(w[0].message)
    assert kvhal.KVCache(kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32), 16).backend.name == "f16only"
    assert kvhal.KVCache(spec, 16).backend.name == "reference"  # auto picks the best that can


def test_auto_checks_the_backend_its_options_build(monkeypatch):
    """backend="auto" with backend_options: the instance built with them is asked supports(), and options the picked
    backend does not take say that auto picked it."""
    from kvhal import registry
    from kvhal.backend_util import Option, parse_options

    class Limited(ReferenceBackend):
        name = "limited"

        def __init__(self, **options):
            self.limit = parse_options(self.name, options, (Option("limit", int, 128),))["limit"]

        @classmethod
        def probe(cls) -> kvhal.Probe:
            return kvhal.Probe(10, "test backend whose head_dim limit is an option")

        def supports(self, spec, op, shape=None):
            return super().supports(spec, op, shape) or (
                f"head_dim {spec.head_dim} > {self.limit}" if spec.head_dim > self.limit else None
            )

    monkeypatch.setattr(registry, "_classes", lambda: {"reference": ReferenceBackend, "limited": Limited})
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=64)
    assert kvhal.KVCache(spec, 16, backend_options={"limit": 64}).backend.name == "limited"
    with pytest.raises(kvhal.UnsupportedError, match="head_dim 64 > 32"):  # not a cache on a backend that refuses
        kvhal.KVCache(spec, 16, backend_options={"limit": 32})
    big = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=256)
    with pytest.raises(kvhal.SpecError, match="no option limit.*auto' picked 'reference'"):
        kvhal.KVCache(big, 16, backend_options={"limit": 512})


def test_broken_plugin_is_reported_not_raised(monkeypatch):
    from kvhal import registry

    monkeypatch.setattr(registry, "_classes", lambda: {"reference": ReferenceBackend, "bad": "its module failed"})
    info = {b.name: b for b in kvhal.backends()}
    assert not info["bad"].available and "failed" in info["bad"].reason


def test_attention_default_scale_gqa_and_q_lens_defaults():
    c = cache(cap=64, k_format="f32", v_format="f32")
    a, b = c.new_seq(), c.new_seq()
    ka, kb = rows(7), rows(11, seed=3)
    c.store(a, 0, ka, ka)
    c.store(b, 0, kb, kb)
    q = rows(2, heads=8, seed=4)  # GQA 8 query heads over 2 KV heads, one decode token per sequence
    out = kvhal.to_numpy(c.attention(0, q, [a, b]))
    np.testing.assert_allclose(out, attention_f64(q, [ka, kb], [ka, kb], [1, 1]), atol=1e-6)
    with pytest.raises(kvhal.ShapeError, match="q_lens"):
        c.attention(0, rows(3, heads=8), [a, b])


def test_supports_sees_the_spec_and_auto_moves_on(monkeypatch):
    """A device limit is refused by supports() before anything is allocated; auto takes the next backend."""
    allocated = []

    class SmallHeads(ReferenceBackend):
        name = "smallheads"

        @classmethod
        def probe(cls) -> kvhal.Probe:
            return kvhal.Probe(10, "test backend with a head_dim limit")

        def supports(self, spec, op):
            return super().supports(spec, op) or (f"head_dim {spec.head_dim} > 64" if spec.head_dim > 64 else None)

        def allocate(self, spec, n_blocks):
            allocated.append(spec)
            return super().allocate(spec, n_blocks)

    class Absent(ReferenceBackend):
        name = "absent"

        @classmethod
        def probe(cls) -> kvhal.Probe:
            return kvhal.Probe(None, "no such device here")

    from kvhal import registry

    monkeypatch.setattr(
        registry, "_classes", lambda: {"reference": ReferenceBackend, "smallheads": SmallHeads, "absent": Absent}
    )
    big = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=128)
    small = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=64)
    assert kvhal.KVCache(small, 16).backend.name == "smallheads"
    assert kvhal.KVCache(big, 16).backend.name == "reference"
    with pytest.raises(kvhal.UnsupportedError, match="head_dim 128 > 64"):
        kvhal.KVCache(big, 16, backend="smallheads")
    assert allocated == [small]  # the refusal came before allocation
    with pytest.raises(kvhal.BackendUnavailableError, match="no such device here"):
        kvhal.KVCache(small, 16, backend="absent")
    info = {b.name: b for b in kvhal.backends()}
    assert info["smallheads"].refusal(big) == "head_dim 128 > 64" and info["smallheads"].refusal(small) is None
    assert "no such device here" in info["absent"].refusal(small)
    with pytest.raises(kvhal.SpecError, match="CacheSpec"):
        info["reference"].refusal(None)  # type: ignore[arg-type]
    with pytest.raises(kvhal.SpecError, match="CacheSpec"):  # not a raw AttributeError
        ReferenceBackend().supports({"head_dim": 64}, "store")  # type: ignore[arg-type]
    from kvhal.tools.cli import info_data

    rows = {r["name"]: r for r in info_data(big)["backends"]}
    assert rows["smallheads"]["spec_refused"] == "head_dim 128 > 64" and rows["reference"]["spec_refused"] is None


def test_supports_sees_the_attention_shape():
    """A backend with per-call limits (shape_limits) refuses a call's static shape with its reason, before
    the call runs; a backend without them is never asked, and the 2-argument supports() keeps working."""
    asked = []

    class DecodeNoWindow(ReferenceBackend):
        name = "decode-no-window"
        shape_limits = True

        def supports(self, spec, op, shape=None):
            asked.append(shape)
            why = super().supports(spec, op, shape)
            if why is None and shape is not None and shape.window is not None:
                why = "no sliding window"
            if why is None and shape is not None and shape.max_q_len > 4:
                why = f"decode only, {shape.max_q_len} queries"
            return why

    class TwoArgs(ReferenceBackend):
        name = "two-args"

        def supports(self, spec, op):
            return super().supports(spec, op)

    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=32, block_size=8)
    c, plain = kvhal.KVCache(spec, 64, backend=DecodeNoWindow()), kvhal.KVCache(spec, 64, backend=TwoArgs())
    k = rows(9)
    for x in (c, plain):
        x.store(x.new_seq(), 0, k, k)
    q = rows(2, heads=4, seed=2)
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(0, q, [0])), kvhal.to_numpy(plain.attention(0, q, [0])))
    assert asked[-1] == kvhal.AttentionShape(n_heads=4, causal=True, window=None, max_q_len=2)
    with pytest.raises(kvhal.UnsupportedError, match="no sliding window"):
        c.attention(0, q, [0], window=3)
    with pytest.raises(kvhal.UnsupportedError, match="decode only, 9 queries"):
        c.attention(0, rows(9, heads=4), [0])
    plain.attention(0, q, [0], window=3)
    assert c.backend.supports(spec, "attention") is None and plain.backend.supports(spec, "attention") is None
    with pytest.raises(kvhal.SpecError, match="AttentionShape"):
        c.backend.supports(spec, "attention", (4, True, None, 1))
    for bad in (
        {"n_heads": True},
        {"n_heads": 0},
        {"n_heads": 4, "window": 0},
        {"n_heads": 4, "window": 2**62 + 1},
        {"n_heads": 4, "causal": 1},
    ):
        with pytest.raises(kvhal.ShapeError):
            kvhal.AttentionShape(**bad)


def test_fused_ops_are_declared_and_shown(capsys):
    """``kvhal info`` shows each backend's native fused ops and where the float64 host path runs instead."""
    from kvhal.tools.cli import info_data, info_text, main

    rows_ = {r["name"]: r for r in info_data()["backends"]}
    assert rows_["reference"]["fused"] == [] and rows_["reference"]["host_fallback"] == list(kvhal.backend.FUSED)
    for r in rows_.values():
        assert sorted(r["fused"] + r["host_fallback"]) == sorted(kvhal.backend.FUSED)
    assert "native" in info_text(info_data())
    assert main(["info", "--json"]) == 0
    import json

    assert "host_fallback" in json.loads(capsys.readouterr().out)["backends"][0]


def test_info_spec_cli(capsys):
    from kvhal.tools.cli import main

    assert main(["info", "--spec", "head_dim=512,k_format=q8_0", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["spec"]["head_dim"] == 512
    assert {r["name"]: r["spec_refused"] for r in data["backends"]}["reference"] is None
    assert main(["info", "--spec", "head_dim=x"]) == 2
    assert "takes an integer" in capsys.readouterr().err
    assert main(["info", "--spec", "nope=1"]) == 2
    capsys.readouterr()
    # every CacheSpec field as it is written: rotations and formats by name, scales as numbers or "calibrate"
    for text, field, want in (("k_format=q4_0,k_rotation=hadamard", "k_rotation", "hadamard"),
                              ("k_format=fp8_e4m3,k_scale=0.5", "k_scale", 0.5),
                              ("k_format=fp8_e4m3,k_scale=calibrate", "k_scale", "calibrate")):  # fmt: skip
        assert main(["info", "--spec", text, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["spec"][field] == want
    assert main(["info", "--spec", "k_scale=big"]) == 2
    assert 'takes a number or "calibrate"' in capsys.readouterr().err


def test_info_spec_with_kltq_side_data_is_json(tmp_path, capsys):
    """A --spec naming a kltq side file: the side data by its digest (not its arrays, which JSON cannot hold)."""
    import json

    from kvhal.formats import kltq
    from kvhal.tools.cli import main

    side = kltq.calibrate([rows(64, heads=1, dim=32)], 4)
    side.save(tmp_path / "side.kvs")
    spec = f"n_layers=1,n_kv_heads=1,head_dim=32,k_format=kltq:4,k_side={tmp_path / 'side.kvs'}"
    assert main(["info", "--spec", spec, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["k_side"] == side.digest()


def test_info_marks_formats_a_backend_runs_as_v_only():
    # the oracle: whether a cache with that format as K (and as V beside f16 K) can be made at all
    from kvhal.tools.cli import info_data, info_text

    data = info_data()
    for row in data["backends"]:
        if not row["available"]:
            continue
        expected = set()
        for f in kvhal.formats.plain_names():  # kltq is a K format only (its own tests)
            if f not in [n for n, ops in row["formats"].items() if ops]:
                continue
            made = []
            for k, v in ((f, f), ("f16", f)):
                spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, k_format=k, v_format=v)
                try:
                    kvhal.KVCache(spec, 64, backend=row["name"])
                    made.append(True)
                except kvhal.UnsupportedError:
                    made.append(False)
            if made == [False, True]:
                expected.add(f)
        assert set(row["v_only"]) == expected, row["name"]
        assert all(isinstance(why, str) and why for why in row["v_only"].values())
    assert data["backends"][[r["name"] for r in data["backends"]].index("reference")]["v_only"] == {}
    text = info_text(data)
    assert "* as V only" in text
    assert ("*" in text.split("support")[1].split("formats:")[0].replace("* as V only", "")) == any(
        r["v_only"] for r in data["backends"] if r["available"]
    )


def test_backend_options_are_parsed_once_with_typed_errors(monkeypatch):
    from kvhal.backend_util import Option, parse_options, positive

    opts = (Option("threads", int, 4, env="KVHAL_TEST_THREADS", check=positive), Option("device", str, "x"))
    assert parse_options("t", {}, opts) == {"threads": 4, "device": "x"}
    assert parse_options("t", {"threads": np.int64(2)}, opts)["threads"] == 2
    monkeypatch.setenv("KVHAL_TEST_THREADS", "3")
    assert parse_options("t", {}, opts)["threads"] == 3
    assert parse_options("t", {"threads": 5}, opts)["threads"] == 5  # the argument wins over the variable
    for bad, match in (
        ({"thread": 1}, "no option thread; the options it takes: device, threads"),
        ({"threads": True}, "must be int, got bool"),
        ({"threads": "2"}, "must be int, got str"),
        ({"threads": 0}, "must be > 0"),
        ({"device": 3}, "must be str"),
    ):
        with pytest.raises(kvhal.SpecError, match=match):
            parse_options("t", bad, opts)
    monkeypatch.setenv("KVHAL_TEST_THREADS", "many")
    with pytest.raises(kvhal.SpecError, match="KVHAL_TEST_THREADS"):
        parse_options("t", {}, opts)
    with pytest.raises(kvhal.SpecError, match="no option threads"):
        kvhal.KVCache(
            kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32),
            16,
            backend="reference",
            backend_options={"threads": 2},
        )
    with pytest.raises(kvhal.SpecError, match="option names"):  # not a raw TypeError from **options
        kvhal.KVCache(kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32), 16, backend_options={1: 2, "x": 3})


def test_visible_range_matches_the_rule():
    from kvhal.attention import visible_range

    seq_lens, q_lens = np.array([5, 9, 3]), np.array([2, 3, 1])
    for causal, window in ((True, None), (False, None), (True, 2), (False, 4)):
        seq, pos, lo, hi = visible_range(seq_lens, q_lens, causal, window)
        want = []
        for s, (n, nq) in enumerate(zip(seq_lens, q_lens)):
            for i in range(nq):
                p = n - nq + i
                vis = [j for j in range(n) if (not causal or j <= p) and (window is None or j > p - window)]
                want.append((s, p, min(vis), max(vis) + 1))
        assert list(zip(seq.tolist(), pos.tolist(), lo.tolist(), hi.tolist())) == want


def test_to_numpy_and_to_like_refuse_what_is_not_an_array():
    for bad, match in (
        (None, "None, not an array"),
        ("abc", "str, not an array"),
        ([[1.0], [1.0, 2.0]], "rectangular"),
        (object(), "not numbers"),
    ):
        with pytest.raises(kvhal.DTypeError, match=match):
            kvhal.to_numpy(bad)
    np.testing.assert_array_equal(kvhal.to_numpy([[1.0, 2.0]]), [[1.0, 2.0]])  # a list of numbers is still taken
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.5, -2.0, 3.25])
    got = kvhal.to_numpy(x.bfloat16())  # widened exactly, as stores take bf16
    assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0, 3.25]
    np.testing.assert_array_equal(kvhal.to_numpy(torch._neg_view(x)), -x.numpy())  # lazy view resolved
    with pytest.raises(kvhal.DTypeError, match="meta tensor"):
        kvhal.to_numpy(torch.zeros(2, device="meta"))
    with pytest.raises(kvhal.DTypeError, match="to_dense"):
        kvhal.to_numpy(torch.zeros(2).to_sparse())
    for bad, match in (("abc", "str, not an array"), (None, "None, not an array"), (np.array([None]), "object")):
        with pytest.raises(kvhal.DTypeError, match=match):
            kvhal.to_like(bad, x)
    with pytest.raises(kvhal.DTypeError, match="not a tensor"):
        kvhal.to_like(np.ones(2, np.float32), torch.float32)
    swapped = kvhal.to_like(np.array([1.5, -2.0], ">f4"), x)  # torch cannot share it: copied, same values
    assert swapped.dtype == torch.float32 and swapped.tolist() == [1.5, -2.0]
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = kvhal.to_like(np.array([1.5, -2.0], ml_dtypes.bfloat16), x)
    assert bf.dtype == torch.bfloat16 and bf.tolist() == [1.5, -2.0]


def test_format_table_comes_from_the_registry():
    from kvhal.backend_util import format_id, format_table

    table = format_table()
    assert [row[0] for row in table] == formats.plain_names()
    for name, fid, block_len, block_bytes in table:
        f = formats.get(name)
        assert format_id(name) == fid and (f.block_len, f.block_bytes) == (block_len, block_bytes)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_load_out_is_validated_and_a_refused_call_writes_nothing(backend):
    if backend not in {i.name for i in kvhal.backends() if i.available}:
        pytest.skip(f"backend {backend} is not available here")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=32, k_format="q8_0", v_format="q4_0", block_size=8)
    c = kvhal.KVCache(spec, 64, backend=backend)
    s = c.new_seq()
    c.store(s, 0, rows(20), rows(20, seed=1))
    f32 = np.float32

    def buf(n=10, dtype=f32):
        return np.full((n, 2, 32), 7, dtype)

    k_out, v_out = buf(), buf()
    big = np.full((2, 10, 2, 32), 7, f32)
    ro = buf()
    ro.flags.writeable = False
    cases = [
        (kvhal.ShapeError, "pair", k_out),  # not a pair
        (kvhal.ShapeError, "pair", (k_out, v_out, v_out)),
        (kvhal.DTypeError, "numpy arrays or CPU torch", (k_out, [[0.0]])),
        (kvhal.DTypeError, "float64", (k_out, buf(dtype=np.float64))),
        (kvhal.DTypeError, "must match", (k_out, buf(dtype=np.float16))),  # k and v differ
        (kvhal.ShapeError, r"\(10, 2, 32\)", (k_out, buf(11))),
        (kvhal.ShapeError, "contiguous", (k_out, np.full((10, 2, 64), 7, f32)[:, :, ::2])),
        (kvhal.SpecError, "read-only", (k_out, ro)),
        (kvhal.SpecError, "overlap", (k_out, k_out)),
    ]
    for err, match, out in cases:
        with pytest.raises(err, match=match):
            c.load(s, 0, 3, 13, out=out)
        assert (k_out == 7).all() and (v_out == 7).all(), f"a refused load wrote into out ({match})"
    with pytest.raises(kvhal.DTypeError, match="must match"):
        c.load(s, 0, 3, 13, out=(k_out, v_out), dtype="float16")  # out's dtype is not the dtype asked for
    for bad in ("bf16", np.float16, 3):
        with pytest.raises(kvhal.DTypeError, match="dtype must be"):
            c.load(s, 0, dtype=bad)
    with pytest.raises(kvhal.PositionError):
        c.load(s, 0, 3, 40, out=(k_out, v_out))
    assert (k_out == 7).all() and (v_out == 7).all()
    c.load(s, 0, 3, 13, out=(big[0], big[1]))  # two halves of one buffer are two buffers
    want = c.load(s, 0, 3, 13)
    np.testing.assert_array_equal(big[0], want[0])
    np.testing.assert_array_equal(big[1], want[1])
    torch = pytest.importorskip("torch")
    on_meta = (torch.empty((10, 2, 32), device="meta"), torch.empty((10, 2, 32), device="meta"))
    with pytest.raises(kvhal.UnsupportedError, match="CPU tensor"):
        c.load(s, 0, 3, 13, out=on_meta)
    with pytest.raises(kvhal.DTypeError, match="int32"):
        c.load(s, 0, 3, 13, out=(torch.zeros((10, 2, 32), dtype=torch.int32),) * 2)


def test_load_out_refuses_swapped_sparse_and_lazy_view_buffers():
    """A buffer load would fill with wrong values (byte-swapped, a sparse tensor, a lazily negated view) is a typed
    error that says what to pass, and nothing is written."""
    c = cache()
    s = c.new_seq()
    c.store(s, 0, rows(10), rows(10, seed=1))
    k_out = np.full((10, 2, 32), 7, np.float32)
    for dt in (">f4", ">f2"):  # named float32/float16 like the native ones
        swapped = np.full((10, 2, 32), 7, dt)
        with pytest.raises(kvhal.DTypeError, match="native-byte-order"):
            c.load(s, 0, out=(k_out, swapped))
        assert (k_out == 7).all() and (swapped == 7).all()
    torch = pytest.importorskip("torch")
    with pytest.raises(kvhal.DTypeError, match="dense"):
        c.load(s, 0, out=(k_out, torch.zeros((10, 2, 32)).to_sparse()))
    with pytest.raises(kvhal.DTypeError, match="plain tensor"):
        c.load(s, 0, out=(k_out, torch._neg_view(torch.zeros((10, 2, 32)))))
    assert (k_out == 7).all()


def test_load_bfloat16_without_ml_dtypes_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now raises ImportError
    c = cache()
    s = c.new_seq()
    c.store(s, 0, rows(4), rows(4))
    with pytest.raises(kvhal.UnsupportedError, match="pip install ml_dtypes"):
        c.load(s, 0, dtype="bfloat16")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("extra", [{"tail": 8}, {"sinks": 4, "tail": 8}, {"k_rotation": "hadamard", "v_scale": 0.5}])
def test_load_out_of_tail_sink_and_transformed_caches_is_the_f32_load_cast(backend, extra):
    """Pages into out through the backend, the f16 sink and tail rows over and after them, transformed K/V through
    the codec first: the same bits as the f32 load cast by numpy / ml_dtypes, for ranges across each piece."""
    if backend not in {i.name for i in kvhal.backends() if i.available}:
        pytest.skip(f"backend {backend} is not available here")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=32, k_format="q4_1", v_format="q8_0", block_size=8,
                           **extra)  # fmt: skip
    c = kvhal.KVCache(spec, 128, backend=backend)
    s = c.new_seq()
    c.store(s, 0, rows(45), rows(45, seed=1))
    for p0, p1 in ((0, None), (3, 30), (41, 45), (2, 6)):
        want = [np.asarray(kvhal.to_numpy(x)) for x in c.load(s, 0, p0, p1)]
        for dtype, np_dtype in (("float32", np.float32), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
            out = (np.full(want[0].shape, 3, np_dtype), np.full(want[0].shape, 3, np_dtype))
            c.load(s, 0, p0, p1, out=out, dtype=dtype)
            for o, w in zip(out, want):
                np.testing.assert_array_equal(o.view(np.uint8), w.astype(np_dtype).view(np.uint8))


ALLOC_LIMITED = """
import resource, sys
import kvhal
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # 3 GiB of address space for this process
spec = kvhal.CacheSpec(4, 8, 128, "f16", "f16")  # 16 KiB per token
try:
    kvhal.KVCache(spec, 1 << 20, backend=sys.argv[1])  # 16 GiB of pools
except kvhal.CapacityError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_pools_the_machine_cannot_allocate_are_a_capacity_error(backend):
    """Past what the process may map, the cache refuses with a CapacityError that names the bytes, not numpy's
    MemoryError or mmap's OSError (a real allocation under a real address-space limit)."""
    if backend not in [b.name for b in kvhal.backends() if b.available]:
        pytest.skip(f"{backend} is not installed here")
    out = subprocess.run([sys.executable, "-c", ALLOC_LIMITED, backend], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("refused: capacity_tokens=1048576 needs 17179869184 bytes"), out.stdout


def test_cast_into_refuses_an_out_it_cannot_write():
    from kvhal.interop import cast_into

    src = np.ones((3, 2), np.float32)
    ro = np.zeros((3, 2), np.float32)
    ro.flags.writeable = False
    cases = [
        (kvhal.ShapeError, "shape", np.zeros((4, 2), np.float32), "float32"),
        (kvhal.SpecError, "read-only", ro, "float32"),
        (kvhal.DTypeError, "float99", np.zeros((3, 2), np.float32), "float99"),  # not a plain copy
        (kvhal.DTypeError, "told float16", np.zeros((3, 2), np.float32), "float16"),
        (kvhal.DTypeError, "uint16", np.zeros((3, 2), np.float32), "bfloat16"),
        (kvhal.DTypeError, "list", [[0.0, 0.0]] * 3, "float32"),
    ]
    for err, match, dst, dtype in cases:
        with pytest.raises(err, match=match):
            cast_into(dst, dtype, src)
    dst = np.zeros((3, 2), np.float16)
    cast_into(dst, "float16", src)
    assert (dst == 1).all()
