"""OpenCL-specific tests: kernel bytes on adversarial data, shapes the contract suite does not reach,
device selection and the unavailable reasons. The oracles are kvhal's numpy reference and float64.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from kvhal_opencl import ENV_DEVICE, OpenCLBackend, device

import kvhal
from kvhal import formats
from kvhal.formats.ggml import _inverse
from kvhal.reference import ReferenceBackend
from tests.oracle import attention_f64

if not OpenCLBackend.probe().available:
    pytest.skip(f"opencl unavailable: {OpenCLBackend.probe().reason}", allow_module_level=True)

F32 = np.float32
ALL = sorted(OpenCLBackend.formats, key=formats.names().index)  # what its kernels implement


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, F32).view(np.uint32)


def adversarial_blocks(rng: np.random.Generator, fmt: str) -> np.ndarray:
    """[n, 32] float32 blocks aimed at each quantizer's rounding, scale and sign corner cases."""
    b: list[np.ndarray] = []
    ar = np.arange(32, dtype=F32)
    b += [rng.standard_normal(32, dtype=F32) for _ in range(4)]
    for outlier in (300.0, -65504.0, 65504.0):
        x = rng.standard_normal(32, dtype=F32)
        x[rng.integers(32)] = outlier
        b.append(x)
    b += [np.zeros(32, F32), np.full(32, -0.0, F32), np.full(32, 1.5, F32), np.full(32, -2.25, F32)]
    for first in (0.0, -0.0):  # signed zeros: ggml's loops take the first occurrence, absmax starts at +0.0
        x = np.zeros(32, F32)
        x[::3] = -0.0
        x[0] = first
        b += [x, np.concatenate([x[:16], rng.uniform(0.1, 1, 16)]), np.concatenate([x[:16], -rng.uniform(0.1, 1, 16)])]
    # q8_0 with d = 1: exact .5 ties (away from zero) and 0.5 - 2^-25, where the reference's
    # floor(|x| + 0.5) and C roundf part ways
    x = ar - 15.5
    x[0], x[1], x[2], x[3] = 127, 0.49999997, -0.49999997, -127
    b.append(x)
    # q4_0 / q5_0 with d = 1 (max = -8 / -16): x*id + 8.5 (+16.5) lands on integers
    b += [
        np.concatenate([[-8.0], ar[:31] / 2 - 7.5]).astype(F32),
        np.concatenate([[-16.0], ar[:31] - 15.5]).astype(F32),
    ]
    # q4_1 / q5_1 with d = 1 (min 0, max 15 / 31): (x - min)*id + 0.5 lands on integers
    b += [
        np.concatenate([[0.0, 15.0], ar[:30] / 2]).astype(F32),
        np.concatenate([[0.0, 31.0], ar[:30] + 0.5]).astype(F32),
    ]
    # equal magnitudes of both signs: the first one sets q4_0/q5_0's sign
    b += [np.resize(np.array([3, -3], F32), 32), np.resize(np.array([-3, 3], F32), 32)]
    # scales near the bottom of float32: subnormal d with finite and with overflowing inverse, subnormal inputs
    for amax in (1e-36, 3e-38, 1e-38, 1e-40):
        b.append((rng.uniform(-1, 1, 32) * amax).astype(F32))
    # f16 corner cases: subnormal halves, exact ties between halves, the largest half
    b.append(np.resize(np.array([1e-6, 3e-5, -6e-8, 1 + 2**-11, 1 + 3 * 2**-11, 65504, -65504, 2049], F32), 32))
    # bf16 ties: low 16 bits exactly 0x8000 with even and odd kept bits
    b.append(np.resize(np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x40490FDB], np.uint32).view(F32), 32))
    # random blocks at scales from 1e-30 to 1e4
    scales = (10.0 ** rng.uniform(-30, 4, 40)).astype(F32)
    b += list(rng.standard_normal((40, 32), dtype=F32) * scales[:, None])
    if formats.get(fmt).block_len > 1:
        b += list(division_sensitive_blocks(rng, fmt))
    return np.stack(b).astype(F32)


def _quant_index(fmt: str, x: np.ndarray, inv: np.float32, lo: np.float32) -> np.ndarray:
    """The reference's quant index of ``x`` for a given inverse scale (kvhal/formats/ggml.py, float32)."""
    if fmt == "q8_0":
        y = x * inv
        return np.copysign(np.floor(np.abs(y) + F32(0.5)), y)
    if fmt in ("q4_0", "q5_0"):
        return np.trunc(x * inv + F32(8.5 if fmt == "q4_0" else 16.5))
    return np.trunc((x - lo) * inv + F32(0.5))


def division_sensitive_blocks(rng: np.random.Generator, fmt: str, n_blocks: int = 6) -> np.ndarray:
    """Blocks whose quants change if the inverse scale is off by one ulp: they catch a device whose
    float32 division is not correctly rounded (random data almost never lands that close to a boundary)."""
    levels = {"q8_0": 127, "q4_0": 8, "q5_0": 16, "q4_1": 15, "q5_1": 31}[fmt]
    out = []
    while len(out) < n_blocks:
        a = F32(rng.uniform(0.5, 100))
        if fmt == "q8_0":
            anchors, lo, hi, d = [a], -a, a, a / F32(127)
            targets = np.arange(-126, 127) + 0.5
        elif fmt in ("q4_0", "q5_0"):
            anchors, lo, hi, d = [-a], -a, a, -a / F32(-levels)  # the negative max makes d positive
            targets = np.arange(1, 2 * levels) - levels - 0.5
        else:
            lo, hi = F32(-a * rng.uniform(0, 1)), a
            anchors, d = [lo, hi], (hi - lo) / F32(levels)
            targets = np.arange(1, levels + 1) - 0.5
        inv = _inverse(np.array([d], F32))[0]
        base = (targets / np.float64(inv)).astype(F32) + (lo if len(anchors) == 2 else F32(0))
        cand = (base.view(np.int32)[:, None] + np.arange(-4, 5, dtype=np.int32)).view(F32).ravel()
        cand = cand[(cand > lo) & (cand < hi)]
        q = _quant_index(fmt, cand, inv, lo)
        flips = np.zeros(cand.shape, bool)
        for other in (np.nextafter(inv, F32(np.inf)), np.nextafter(inv, F32(0))):
            flips |= _quant_index(fmt, cand, other, lo) != q
        free = 32 - len(anchors)
        pick = rng.permutation(cand[flips])[:free]
        if len(pick) >= free // 2:
            out.append(np.concatenate([anchors, pick, np.full(free - len(pick), (lo + hi) / 2)]).astype(F32))
    return np.stack(out)


def pools_of(backend: kvhal.Backend, spec: kvhal.CacheSpec, k: np.ndarray, v: np.ndarray, slots: np.ndarray, nb: int):
    pools = backend.allocate(spec, nb)
    backend.store(pools, 0, k, v, slots)
    return pools, [np.asarray(backend.to_numpy(p)).view(np.uint8) for p in (pools.k[0], pools.v[0])]


def fp64_division_device(backend: OpenCLBackend) -> device.Device:
    """A private device state whose programs divide through cl_khr_fp64 (the path for devices without
    correctly rounded float32 division), so that path is checked wherever the device has fp64."""
    d = backend.dev
    if "cl_khr_fp64" not in d.device.extensions:
        pytest.skip(f"{d.device.name} has no cl_khr_fp64")
    fresh = device.Device(d.cl, d.device, d.index)
    fresh.div_options = ["-DKVHAL_DIV_FP64"]
    return fresh


@pytest.mark.parametrize(
    ("fmt", "division"), [(f, "fp32") for f in ALL] + [(f, "fp64") for f in ALL if formats.get(f).block_len > 1]
)
def test_kernel_bytes_on_adversarial_data(fmt: str, division: str) -> None:
    rng = np.random.default_rng(7)
    blocks = adversarial_blocks(rng, fmt)
    heads, dim, bs = 2, 64, 8
    per_token = heads * dim // 32
    n = -(-len(blocks) // per_token)
    filler = rng.standard_normal((n * per_token - len(blocks), 32), dtype=F32)
    k = np.concatenate([blocks, filler]).reshape(n, heads, dim)
    v = k[rng.permutation(n)][:, ::-1].copy()
    spec = kvhal.CacheSpec(1, heads, dim, fmt, fmt, bs)
    nb = -(-n // bs) + 2
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)  # scattered over pages and offsets
    ocl = OpenCLBackend()
    if division == "fp64":
        ocl.dev = fp64_division_device(ocl)
    cl_pools, got = pools_of(ocl, spec, k, v, slots, nb)
    ref = ReferenceBackend()
    ref_pools, want = pools_of(ref, spec, k, v, slots, nb)
    for g, w, which in zip(got, want, "KV", strict=True):
        bad = np.flatnonzero((g != w).reshape(-1, g.shape[-1]).any(axis=1))
        assert bad.size == 0, f"{fmt} {which}: {bad.size} rows differ from the reference, first row {bad[:1]}"
    # load: every page, bit for bit equal to the reference's dequantization
    ids = np.arange(nb)
    for x, y in zip(ocl.load(cl_pools, 0, ids, nb * bs), ref.load(ref_pools, 0, ids, nb * bs), strict=True):
        np.testing.assert_array_equal(bits(kvhal.to_numpy(x)), bits(y))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("dim", [8, 40])
def test_float_formats_on_head_dims_off_32(fmt: str, dim: int) -> None:
    """Rows that are not whole 32-value chunks take the kernels' scalar paths."""
    rng = np.random.default_rng(dim)
    spec = kvhal.CacheSpec(1, 2, dim, fmt, fmt, 4)
    c, r = kvhal.KVCache(spec, 64, backend="opencl"), kvhal.KVCache(spec, 64, backend="reference")
    k, v = rng.standard_normal((2, 23, 2, dim), dtype=F32)
    for cache in (c, r):
        cache.store(cache.new_seq(), 0, k, v)
    for x, y in ((c.pools.k[0].get(), r.pools.k[0]), (c.pools.v[0].get(), r.pools.v[0])):
        np.testing.assert_array_equal(x, y)
    q = rng.standard_normal((5, 6, dim), dtype=F32)
    f = formats.get(fmt)
    out = kvhal.to_numpy(c.attention(0, q, [0], [5], window=9))
    want = attention_f64(q, [f.dequantize(f.quantize(k))], [f.dequantize(f.quantize(v))], [5], window=9)
    assert np.abs(out - want).max() <= OpenCLBackend.attention_tolerance


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "dim", "lens", "q_lens"),
    [
        (16, 2, 64, [300, 3], [1, 1]),  # GQA group 8, split-K with an empty split for the short row
        (12, 2, 256, [90], [7]),  # group 6 in tiles of 3 heads (QT < group)
        (4, 4, 32, [1000], [2]),  # many splits
    ],
)
def test_attention_tilings_and_splits(n_heads: int, n_kv: int, dim: int, lens: list[int], q_lens: list[int]) -> None:
    rng = np.random.default_rng(sum(lens))
    fmt = "q4_1"
    spec = kvhal.CacheSpec(1, n_kv, dim, fmt, "q8_0", 16)
    cache = kvhal.KVCache(spec, sum(lens) + 64, backend="opencl")
    ks, vs, seqs = [], [], []
    for n in lens:
        k, v = rng.standard_normal((2, n, n_kv, dim), dtype=F32)
        seqs.append(cache.new_seq())
        cache.store(seqs[-1], 0, k, v)
        ks.append(spec.k_fmt.dequantize(spec.k_fmt.quantize(k)))
        vs.append(spec.v_fmt.dequantize(spec.v_fmt.quantize(v)))
    q = rng.standard_normal((sum(q_lens), n_heads, dim), dtype=F32)
    out = kvhal.to_numpy(cache.attention(0, q, seqs, q_lens))
    assert np.abs(out - attention_f64(q, ks, vs, q_lens)).max() <= OpenCLBackend.attention_tolerance


def test_copy_slots_overlapping_ranges() -> None:
    rng = np.random.default_rng(3)
    spec = kvhal.CacheSpec(1, 2, 32, "q5_0", "bf16", 4)
    k, v = rng.standard_normal((2, 24, 2, 32), dtype=F32)
    slots = np.arange(24)
    src, dst = np.arange(3, 20), np.arange(0, 17)  # shift down by 3: every row is read and overwritten
    results = []
    for b in (OpenCLBackend(), ReferenceBackend()):
        pools, _ = pools_of(b, spec, k, v, slots, 6)
        b.copy_slots(pools, 0, src, dst)
        b.copy_slots(pools, 0, dst[::-1], src[::-1] + 4)
        results.append([np.asarray(b.to_numpy(p)) for p in (pools.k[0], pools.v[0])])
    for x, y in zip(*results, strict=True):
        np.testing.assert_array_equal(x, y)


def test_device_arrays_and_f16_inputs() -> None:
    """Device arrays (including the offset views load returns) and f16 host arrays store the same bytes."""
    import pyopencl.array as cl_array

    rng = np.random.default_rng(11)
    spec = kvhal.CacheSpec(1, 2, 64, "q4_0", "f16", 16)
    k, v = rng.standard_normal((2, 20, 2, 64), dtype=F32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    a, r = kvhal.KVCache(spec, 128, backend="opencl"), kvhal.KVCache(spec, 128, backend="reference")
    a.store(a.new_seq(), 0, k16, v16)
    r.store(r.new_seq(), 0, k16.astype(F32), v16.astype(F32))
    for c in (a, r):
        c.store(c.new_seq(), 0, *c.load(0, 0, 3, 17))  # on opencl: offset views of device arrays
    np.testing.assert_array_equal(a.pools.k[0].get(), r.pools.k[0])
    np.testing.assert_array_equal(a.pools.v[0].get(), r.pools.v[0])
    q = rng.standard_normal((2, 4, 64), dtype=F32)
    q_dev = cl_array.to_device(a.backend.dev.queue, q)
    out = a.attention(0, q_dev, [1], [2])
    assert isinstance(out, cl_array.Array)
    np.testing.assert_allclose(out.get(), r.attention(0, q, [1], [2]), rtol=0, atol=OpenCLBackend.attention_tolerance)
    with pytest.raises(kvhal.DTypeError):
        ints = cl_array.to_device(a.backend.dev.queue, np.zeros((1, 2, 64), np.int32))
        a.store(0, 0, ints, ints)
    for p0, p1 in ((5, 5), (0, 0), (16, 16)):
        assert kvhal.to_numpy(a.load(0, 0, p0, p1)[0]).shape == (0, 2, 64)


def test_programs_built_once_per_device_and_shape() -> None:
    spec = kvhal.CacheSpec(1, 2, 64, "q5_1", "q5_1", 16)
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 40, 2, 64), dtype=F32)
    q = rng.standard_normal((1, 4, 64), dtype=F32)
    counts = []
    for _ in range(2):
        cache = kvhal.KVCache(spec, 128, backend="opencl")
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        cache.load(s, 0)
        cache.attention(0, q, [s], [1])
        cache.seq_cp(s, 3, 20)
        counts.append(len(cache.backend.dev.programs))
    assert counts[0] == counts[1]


def test_pool_larger_than_the_device_allows() -> None:
    b = OpenCLBackend()
    spec = kvhal.CacheSpec(1, 1, 4096, "f32", "f32", 16)
    too_many = int(b.dev.device.max_mem_alloc_size) // (16 * 4096 * 4) + 1
    with pytest.raises(kvhal.CapacityError, match="lower capacity_tokens"):
        b.allocate(spec, too_many)


def private_device(backend: OpenCLBackend) -> device.Device:
    """A private runtime of the backend's device, for tests that change what it reports."""
    d = device.Device(backend.dev.cl, backend.dev.device, backend.dev.index)
    backend.dev = d
    return d


def test_device_without_exact_division_refuses_quantized_specs_before_allocating() -> None:
    b = OpenCLBackend()
    d = private_device(b)
    d.div_options = None  # as on a device with neither CORRECTLY_ROUNDED_DIVIDE_SQRT nor cl_khr_fp64
    q8 = kvhal.CacheSpec(1, 2, 64, "q8_0", "f16", 16)
    for op in ("store", "load", "attention"):
        why = b.supports(q8, op)
        assert why is not None and "neither correctly rounded float32 division nor cl_khr_fp64" in why and "q8_0" in why
    assert b.supports(kvhal.CacheSpec(1, 2, 64, "f16", "bf16", 16), "attention") is None
    with pytest.raises(kvhal.UnsupportedError, match="neither correctly rounded"):
        kvhal.KVCache(q8, 64, backend=b)
    assert not d.programs  # refused before anything was built
    with pytest.warns(UserWarning, match="falling back"):
        c = kvhal.KVCache(q8, 64, backend=b, allow_fallback=True)
    assert c.backend.name != "opencl"


def test_raw_blocks_in_batches_and_bad_ids() -> None:
    """Staging buffers larger than the device allows are split into batches; ids are checked first."""
    rng = np.random.default_rng(9)
    b = OpenCLBackend()
    d = private_device(b)
    spec = kvhal.CacheSpec(2, 2, 32, "q4_1", "f32", 4)
    c, r = kvhal.KVCache(spec, 40, backend=b), kvhal.KVCache(spec, 40, backend="reference")
    fresh = kvhal.KVCache(spec, 40, backend=b)
    k, v = rng.standard_normal((2, 37, 2, 32), dtype=F32)
    for cache in (c, r):
        s = cache.new_seq()
        for layer in (0, 1):
            cache.store(s, layer, k, v)
    d.max_alloc = 2 * spec.block_nbytes + 1  # two blocks per batch
    assert b.supports(spec, "store") is None
    ids = np.array([5, 0, 9, 3, 1], np.int64)
    want = r.backend.read_blocks(r.pools, ids)
    np.testing.assert_array_equal(b.read_blocks(c.pools, ids), want)
    b.write_blocks(fresh.pools, ids, want)
    np.testing.assert_array_equal(b.read_blocks(fresh.pools, ids), want)
    assert b.read_blocks(c.pools, np.array([], np.int64)).shape == (0, spec.block_nbytes)
    before = b.read_blocks(fresh.pools, np.arange(10))
    for bad in (np.array([10]), np.array([-1]), np.array([0.0]), np.array([[0]])):
        with pytest.raises(kvhal.PositionError, match=r"block ids must be ints in \[0, 10\)"):
            b.write_blocks(fresh.pools, bad, want[: bad.size])
    with pytest.raises(kvhal.ShapeError, match="one id per block"):
        b.write_blocks(fresh.pools, ids[:2], want)
    np.testing.assert_array_equal(b.read_blocks(fresh.pools, np.arange(10)), before)
    d.max_alloc = spec.block_nbytes - 1
    assert "lower block_size" in b.supports(spec, "store")


def test_one_spec_on_four_threads() -> None:
    """Caches of one spec share kernel objects; four threads storing and attending at once stay exact."""
    import threading

    spec = kvhal.CacheSpec(2, 2, 64, "q5_0", "q8_0", 8)
    rng = np.random.default_rng(12)
    data = [rng.standard_normal((2, 90, 2, 64), dtype=F32) for _ in range(4)]
    q = rng.standard_normal((3, 4, 64), dtype=F32)
    backend = OpenCLBackend()
    caches = [kvhal.KVCache(spec, 128, backend=backend) for _ in range(4)]
    outs: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            c, (k, v) = caches[i], data[i]
            s = c.new_seq()
            for t in range(0, 90, 3):
                for layer in (0, 1):
                    c.store(s, layer, k[t : t + 3], v[t : t + 3])
                outs[i] = kvhal.to_numpy(c.attention(1, q, [s], [3]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: between setting a kernel's arguments and enqueueing it
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i, c in enumerate(caches):
        r = kvhal.KVCache(spec, 128, backend="reference")
        s = r.new_seq()
        for layer in (0, 1):
            r.store(s, layer, *data[i])
        ids = np.arange(c.n_blocks)
        np.testing.assert_array_equal(c.backend.read_blocks(c.pools, ids), r.backend.read_blocks(r.pools, ids))
        want = r.attention(1, q, [s], [3])
        assert np.abs(outs[i] - want).max() <= OpenCLBackend.attention_tolerance


def test_options_are_typed() -> None:
    with pytest.raises(kvhal.SpecError, match="has no option threads; the options it takes: device"):
        OpenCLBackend(threads=2)
    with pytest.raises(kvhal.SpecError, match="option device must be str, got int"):
        OpenCLBackend(device=0)
    with pytest.raises(kvhal.SpecError, match="option device must be str"):
        kvhal.KVCache(kvhal.CacheSpec(1, 2, 64), 16, backend="opencl", backend_options={"device": True})


# ---- device selection and unavailable reasons ------------------------------------------------------


@pytest.fixture()
def fresh_select():
    device.select.cache_clear()
    yield device.select
    device.select.cache_clear()


def test_device_env_var_by_index_and_name(monkeypatch, fresh_select) -> None:
    import pyopencl as cl

    first = cl.get_platforms()[0].get_devices()[0]
    monkeypatch.setenv(ENV_DEVICE, "0:0")
    assert OpenCLBackend.probe().device.startswith("opencl:0:0 ")
    monkeypatch.setenv(ENV_DEVICE, first.name.strip()[2:9].upper())  # case-insensitive substring
    assert first.name.strip() in OpenCLBackend.probe().device
    assert OpenCLBackend().dev.device.int_ptr == first.int_ptr
    monkeypatch.setenv(ENV_DEVICE, "7:3")
    probe = OpenCLBackend.probe()
    assert probe.score is None and not probe.available
    assert "KVHAL_OPENCL_DEVICE='7:3' matches no OpenCL device" in probe.reason and "[0:0]" in probe.reason
    with pytest.raises(kvhal.BackendUnavailableError, match="matches no OpenCL device"):
        OpenCLBackend(device="no such device anywhere")
    info = {i.name: i for i in kvhal.backends()}["opencl"]
    assert not info.available and info.reason == probe.reason
    monkeypatch.delenv(ENV_DEVICE)
    assert OpenCLBackend(device="0:0").dev.device.int_ptr == first.int_ptr  # the option, not the environment


def test_default_prefers_gpu_then_accelerator_then_cpu() -> None:
    types = SimpleNamespace(GPU=4, ACCELERATOR=8, CPU=2)
    cl = SimpleNamespace(device_type=types)

    def dev(name: str, t: int) -> SimpleNamespace:
        return SimpleNamespace(name=name, type=t, platform=SimpleNamespace(name="plat"))

    cpu, acc, gpu, gpu2 = dev("cpu", 2), dev("acc", 8), dev("gpu", 4), dev("gpu2", 4)
    choose = device.choose
    assert choose(cl, [("0:0", cpu), ("1:0", acc), ("1:1", gpu), ("2:0", gpu2)], "") == (gpu, "1:1")
    assert choose(cl, [("0:0", cpu), ("1:0", acc)], "") == (acc, "1:0")
    assert choose(cl, [("0:0", cpu)], "") == (cpu, "0:0")
    assert choose(cl, [("0:0", cpu), ("1:1", gpu)], "CPU") == (cpu, "0:0")
    assert choose(cl, [("0:0", cpu), ("1:1", gpu)], "plat") == (cpu, "0:0")  # platform names match too
    assert "pocl-opencl-icd ocl-icd-libopencl1" in choose(cl, [], "")


def test_reason_without_pyopencl(monkeypatch, fresh_select) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "pyopencl" else real(n, *a))
    probe = OpenCLBackend.probe()
    assert probe.score is None and probe.reason.startswith("pyopencl is not installed (pip install pyopencl")
    with pytest.raises(kvhal.BackendUnavailableError, match="pyopencl is not installed"):
        OpenCLBackend()


def test_reason_without_icd(tmp_path) -> None:
    """With no ICD registered (an empty vendors directory) the reason names the Debian packages."""
    code = "from kvhal_opencl import OpenCLBackend as B; p = B.probe(); print(p.score); print(p.reason)"
    env = {**os.environ, "OCL_ICD_VENDORS": str(tmp_path)}
    env.pop(ENV_DEVICE, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    probe, reason = out.strip().splitlines()
    assert probe == "None"
    assert (
        reason.startswith("no OpenCL platform found") and "apt-get install pocl-opencl-icd ocl-icd-libopencl1" in reason
    )


def test_gpu_launch_path_on_this_device() -> None:
    """The GPU launch logic (one unit per work item, queried work-group sizes, many KV splits) run on
    whatever device is here, against the reference and float64."""
    b = OpenCLBackend()
    d = device.Device(b.dev.cl, b.dev.device, b.dev.index)
    d.is_cpu = False
    b.dev = d
    rng = np.random.default_rng(5)
    spec = kvhal.CacheSpec(1, 2, 64, "q4_0", "q5_1", 16)
    c, r = kvhal.KVCache(spec, 1400, backend=b), kvhal.KVCache(spec, 1400, backend="reference")
    k, v = rng.standard_normal((2, 1000, 2, 64), dtype=F32)
    q = rng.standard_normal((3, 8, 64), dtype=F32)
    for cache in (c, r):
        s = cache.new_seq()
        cache.store(s, 0, k, v)
        cache.seq_cp(s, 5, 300)
    for x, y in ((c.pools.k[0].get(), r.pools.k[0]), (c.pools.v[0].get(), r.pools.v[0])):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(kvhal.to_numpy(c.load(1, 0)[1]), r.load(1, 0)[1])
    kd, vd = (f.dequantize(f.quantize(x)) for f, x in ((spec.k_fmt, k), (spec.v_fmt, v)))
    out = kvhal.to_numpy(c.attention(0, q, [0], [3]))
    assert np.abs(out - attention_f64(q, [kd], [vd], [3])).max() <= OpenCLBackend.attention_tolerance
    assert d.local and all(size >= 1 for size in d.local.values())


def test_attention_half_reader_is_exact_for_every_finite_half() -> None:
    """formats.cl's halves16 / half1 (the attention-side f16 reader) against numpy on all 63488 finite halves."""
    import pyopencl as cl
    import pyopencl.array as cl_array

    dev = OpenCLBackend().dev
    src = (
        device.format_header()
        + device.source("formats.cl")
        + (
            "kernel void one(global const ushort* h, global float* a) {"
            " a[get_global_id(0)] = half1((global const uchar*)(h + get_global_id(0))); }"
            "kernel void sixteen(global const ushort* h, global float* b) {"
            " vstore16(halves16(h + 16 * get_global_id(0)), get_global_id(0), b); }"
        )
    )
    prog = cl.Program(dev.ctx, src).build(options=["-DHEAD_DIM=32", *dev.ftz])
    bits_ = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits_ = bits_[np.isfinite(bits_.view(np.float16))]  # 63488 = 16 * 3968
    h = cl_array.to_device(dev.queue, bits_)
    a, b = (cl_array.zeros(dev.queue, len(bits_), np.float32) for _ in range(2))
    prog.one(dev.queue, (len(bits_),), None, h.data, a.data)
    prog.sixteen(dev.queue, (len(bits_) // 16,), None, h.data, b.data)
    want = bits_.view(np.float16).astype(F32)
    np.testing.assert_array_equal(bits(b.get()), bits(want))
    np.testing.assert_array_equal(bits(a.get()), bits(want))
