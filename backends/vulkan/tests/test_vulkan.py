"""Vulkan-specific behaviour: adapter choice and options, spec limits refused up front, exact quantization
on hard inputs, pools split across bindings, batched raw-row moves, and no buffer allocation in the decode
loop. Runs on any Vulkan adapter (lavapipe in CI)."""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
from kvhal import formats
from kvhal.reference import ReferenceBackend
from tests.oracle import attention_f64

kvhal_vulkan = pytest.importorskip("kvhal_vulkan")
from kvhal_vulkan import VulkanBackend, VulkanPool, adapter, backend, select_adapter, shaders  # noqa: E402

FMTS = sorted(VulkanBackend.formats)

# ---- adapter selection (pure: no device needed) -----------------------------------------------------------


def info(device: str, kind: str, vendor: str = "acme") -> dict[str, object]:
    return {
        "device": device,
        "adapter_type": kind,
        "vendor": vendor,
        "vendor_id": 0x10DE,
        "device_id": 1,
        "description": "driver 1.0",
        "backend_type": "Vulkan",
    }


LAVAPIPE = info("llvmpipe (LLVM 15.0.6, 256 bits)", "CPU", "llvmpipe")
DISCRETE = info("NVIDIA H200", "DiscreteGPU", "nvidia")
INTEGRATED = info("Intel(R) Graphics (RPL-S)", "IntegratedGPU", "intel")


def test_select_prefers_a_hardware_gpu_over_the_software_one():
    assert select_adapter([LAVAPIPE, INTEGRATED, DISCRETE])[0] == 2
    assert select_adapter([LAVAPIPE, INTEGRATED, DISCRETE], power_preference="low-power")[0] == 1
    assert select_adapter([LAVAPIPE, INTEGRATED], allow_cpu=True)[0] == 1


def test_select_refuses_software_only_unless_allowed():
    idx, reason = select_adapter([LAVAPIPE])
    assert idx is None and "KVHAL_VULKAN_ALLOW_CPU=1" in reason and "llvmpipe" in reason
    assert select_adapter([LAVAPIPE], allow_cpu=True)[0] == 0
    idx, reason = select_adapter([LAVAPIPE, DISCRETE], "llvmpipe")
    assert idx is None and "KVHAL_VULKAN_ALLOW_CPU=1" in reason


def test_select_by_index_or_name():
    adapters = [LAVAPIPE, INTEGRATED, DISCRETE]
    assert select_adapter(adapters, "1")[0] == 1
    assert select_adapter(adapters, "h200")[0] == 2
    assert select_adapter(adapters, "INTEL")[0] == 1
    assert select_adapter(adapters, "0", allow_cpu=True)[0] == 0
    idx, reason = select_adapter(adapters, "7")
    assert idx is None and "3 Vulkan adapter(s)" in reason and "NVIDIA H200" in reason
    idx, reason = select_adapter(adapters, "radeon")
    assert idx is None and "matches no Vulkan adapter" in reason and "[2] NVIDIA H200" in reason


def test_select_explains_missing_driver():
    idx, reason = select_adapter([])
    assert idx is None and "mesa-vulkan-drivers" in reason


def test_bad_settings_are_spec_errors_and_unavailable_probes(monkeypatch):
    """Options and their environment variables go through kvhal's option parser: a bad value is a SpecError
    naming the option (and the variable), and the probe reports it as the reason."""
    monkeypatch.setenv("KVHAL_VULKAN_POWER_PREFERENCE", "fast")
    p = VulkanBackend.probe()
    assert not p.available and "high-performance" in p.reason and "KVHAL_VULKAN_POWER_PREFERENCE" in p.reason
    with pytest.raises(kvhal.SpecError, match="KVHAL_VULKAN_POWER_PREFERENCE"):
        VulkanBackend()
    monkeypatch.delenv("KVHAL_VULKAN_POWER_PREFERENCE")
    monkeypatch.setenv("KVHAL_VULKAN_ALLOW_CPU", "yes")
    assert "KVHAL_VULKAN_ALLOW_CPU" in VulkanBackend.probe().reason
    monkeypatch.setenv("KVHAL_VULKAN_ALLOW_CPU", "1")
    for bad in (
        {"max_binding_bytes": 0},
        {"max_binding_bytes": "big"},
        {"max_binding_bytes": 1.5e6},
        {"power_preference": "fast"},
        {"allow_cpu": 2},
        {"allow_cpu": True},
        {"adapter": 0},
        {"device": "0"},
    ):
        with pytest.raises(kvhal.SpecError) as info:
            VulkanBackend(**bad)
        assert next(iter(bad)) in str(info.value)


# ---- probe on this machine ----------------------------------------------------------------------------------


def _real_adapters() -> list[dict[str, object]]:
    return [dict(a.info) for a in adapter.adapters()]


def test_probe_reports_the_adapter(monkeypatch):
    monkeypatch.setenv("KVHAL_VULKAN_ALLOW_CPU", "1")
    monkeypatch.delenv("KVHAL_VULKAN_ADAPTER", raising=False)
    adapters = _real_adapters()
    if not adapters:
        pytest.skip("no Vulkan adapter on this machine")
    p = VulkanBackend.probe()
    assert p.available
    chosen = adapters[select_adapter(adapters, allow_cpu=True)[0]]
    assert str(chosen["device"]) in p.device and str(chosen["adapter_type"]) in p.device
    assert f"0x{int(chosen['vendor_id']):04x}" in p.device
    infos = {i.name: i for i in kvhal.backends()}
    assert infos["vulkan"].available and infos["vulkan"].device == p.device


def test_probe_refuses_software_adapter_without_opt_in(monkeypatch):
    adapters = _real_adapters()
    if not adapters or any(a["adapter_type"] != "CPU" for a in adapters):
        pytest.skip("needs a machine whose only Vulkan adapters are software ones (lavapipe)")
    monkeypatch.delenv("KVHAL_VULKAN_ALLOW_CPU", raising=False)
    monkeypatch.delenv("KVHAL_VULKAN_ADAPTER", raising=False)
    p = VulkanBackend.probe()
    assert p.score is None and "KVHAL_VULKAN_ALLOW_CPU=1" in p.reason
    with pytest.raises(kvhal.BackendUnavailableError, match="KVHAL_VULKAN_ALLOW_CPU"):
        VulkanBackend()
    assert VulkanBackend(allow_cpu=1).gpu.info["adapter_type"] == "CPU"  # the option, not only the variable
    monkeypatch.setenv("KVHAL_VULKAN_ADAPTER", "no-such-gpu")
    monkeypatch.setenv("KVHAL_VULKAN_ALLOW_CPU", "1")
    p = VulkanBackend.probe()
    assert p.score is None and "matches no Vulkan adapter" in p.reason


# ---- the backend on the device --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def available() -> None:
    p = VulkanBackend.probe()
    if not p.available:
        pytest.skip(f"vulkan unavailable: {p.reason}")


def spec(fmt: str, fmt_v: str | None = None, heads: int = 2, dim: int = 64, bs: int = 16, layers: int = 1):
    return kvhal.CacheSpec(
        n_layers=layers, n_kv_heads=heads, head_dim=dim, k_format=fmt, v_format=fmt_v or fmt, block_size=bs
    )


def pool_bytes(cache: kvhal.KVCache, layer: int = 0) -> list[np.ndarray]:
    p = cache.pools
    return [
        np.asarray(cache.backend.to_numpy(x)).view(np.uint8).reshape(cache.spec.pool_shape(cache.n_blocks, w))
        for x, w in ((p.k[layer], "k"), (p.v[layer], "v"))
    ]


def hard_blocks(rng: np.random.Generator, fmt: str) -> np.ndarray:
    """32-value blocks at the edges of the quantizers: ties, zero scales, subnormals, rounding halfway points."""
    b: list[np.ndarray] = []
    for e in range(-44, 16, 3):  # every magnitude the formats store, subnormal f32 scales included
        b.append(rng.standard_normal(32) * 2.0**e)
    t = np.arange(32) - 15.5
    b += [np.r_[127.0, (t[1:] * 7).round() + 0.5][:32]]  # q8_0: d = 1, products on .5 ties
    b += [np.r_[-8.0, np.clip(t[1:], -7.5, 7.5)]]  # q4_0: d = 1, x + 8.5 on integers
    b += [np.r_[-16.0, np.clip(t[1:], -15.5, 15.5)]]  # q5_0
    b += [np.r_[0.0, 15.0, np.clip(t[2:], 0.5, 14.5)]]  # q4_1: d = 1, (x - 0) + 0.5 on integers
    b += [np.r_[0.0, 31.0, np.clip(t[2:] + 15, 0.5, 30.5)]]  # q5_1
    b += [np.full(32, 0.3), np.zeros(32), -np.zeros(32), np.full(32, -2.5)]
    b += [np.r_[-0.0, 0.0, np.zeros(30)], np.r_[np.zeros(5), -0.0, np.zeros(26)], np.r_[-0.0, np.ones(31)]]
    b += [np.r_[np.zeros(31), -1e-3], np.r_[5.0, -5.0, rng.standard_normal(30)], np.r_[-5.0, 5.0, np.ones(30)]]
    b += [rng.standard_normal(32) * 1e-38, np.full(32, 1e-40), np.r_[1.2e-38, rng.uniform(-1e-39, 1e-39, 31)]]
    b += [np.r_[65504.0, -65504.0, rng.uniform(-65504, 65504, 30)], rng.uniform(-6e4, 6e4, 32)]
    h = rng.integers(1, 0x7B00, 32, dtype=np.uint16).view(np.float16).astype(np.float32)
    b += [h * np.float32(1 + 2.0**-11), h * np.float32(1 - 2.0**-12)]  # f16 halfway and just below
    sub = rng.integers(1, 0x3FF, 32, dtype=np.uint16).view(np.float16).astype(np.float32)
    b += [sub + np.float32(2.0**-25), sub - np.float32(2.0**-25)]  # halfway between f16 subnormals
    u = rng.integers(0x00800000, 0x477FE000, 32, dtype=np.uint32)
    b += [((u & ~np.uint32(0xFFFF)) | np.uint32(0x8000)).view(np.float32)]  # bf16 halfway
    out = np.stack([np.asarray(x, np.float32)[:32] for x in b])
    return out[np.abs(out).max(axis=1) <= formats.get(fmt).max_abs]


@pytest.mark.parametrize("fmt", FMTS)
def test_hard_values_byte_identical(available, fmt):
    rng = np.random.default_rng(7)
    blocks = hard_blocks(rng, fmt)
    x = np.concatenate([blocks, rng.standard_normal((-len(blocks) % 4, 32), dtype=np.float32)]).reshape(-1, 2, 64)
    k, v = x, x[::-1].copy()
    caches = [kvhal.KVCache(spec(fmt), 256, backend=b) for b in ("vulkan", "reference")]
    for c in caches:
        s = c.new_seq()
        c.store(s, 0, k[:3], v[:3])
        c.store(s, 0, k[3:], v[3:])
    for got, want in zip(pool_bytes(caches[0]), pool_bytes(caches[1]), strict=True):
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{len(bad)} bytes differ, first at {bad[0].tolist()}"
    f = formats.get(fmt)
    got_k, _ = (kvhal.to_numpy(a) for a in caches[0].load(0, 0))
    np.testing.assert_allclose(got_k, f.dequantize(f.quantize(k)), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_1", "q5_0"])
def test_head_dims_and_odd_geometry(available, fmt):
    """Rows of 2 mod 4 bytes, odd block sizes and heads: rows straddle u32 words everywhere."""
    rng = np.random.default_rng(3)
    dim = 3 if fmt == "f16" else 96
    sp = spec(fmt, heads=3, dim=dim, bs=5)
    caches = [kvhal.KVCache(sp, 64, backend=b) for b in ("vulkan", "reference")]
    k = rng.standard_normal((23, 3, dim), dtype=np.float32)
    v = rng.standard_normal((23, 3, dim), dtype=np.float32)
    for c in caches:
        s = c.new_seq()
        for lo, hi in ((0, 1), (1, 2), (2, 9), (9, 23)):
            c.store(s, 0, k[lo:hi], v[lo:hi])
        t = c.seq_cp(s, 3, 20)
        c.seq_rm(s, 2, 7)
        c.store(t, 0, k[:4], v[:4])
    for got, want in zip(pool_bytes(caches[0]), pool_bytes(caches[1]), strict=True):
        np.testing.assert_array_equal(got, want)
    q = rng.standard_normal((4, 6, dim), dtype=np.float32)
    ref = caches[1]
    got = kvhal.to_numpy(caches[0].attention(0, q, [0, 1], [3, 1], window=6))
    ks = [ref.load(i, 0)[0] for i in (0, 1)]
    vs = [ref.load(i, 0)[1] for i in (0, 1)]
    want = attention_f64(q, ks, vs, [3, 1], window=6)
    assert float(np.abs(got - want).max()) <= VulkanBackend.attention_tolerance


# ---- pools split across bindings --------------------------------------------------------------------------


@pytest.mark.parametrize("fk,fv", [("q4_1", "q4_1"), ("q8_0", "f16"), ("q5_0", "bf16")])
def test_pool_split_across_bindings(available, fk, fv):
    """An artificially small binding limit splits each pool into chunks; results stay reference-identical."""
    sp = spec(fk, fv, bs=8, layers=2)
    per_stage = VulkanBackend().gpu.limits["max-storage-buffers-per-shader-stage"]
    page = max(sp.n_kv_heads * sp.block_size * rb for rb in (sp.k_row_bytes, sp.v_row_bytes))
    n_blocks = 32
    per_pool = max(2, min(6, (per_stage - 3) // 2))
    limit = page * -(-n_blocks // per_pool) + 2  # not a whole number of pages or words
    be = VulkanBackend(max_binding_bytes=limit)
    caches = [kvhal.KVCache(sp, n_blocks * 8, backend=be), kvhal.KVCache(sp, n_blocks * 8, backend=ReferenceBackend())]
    pool = caches[0].pools.k[0]
    assert isinstance(pool, VulkanPool) and len(pool.buffers) > 1
    assert all(b.size <= limit for b in pool.buffers)
    rng = np.random.default_rng(11)
    k = rng.standard_normal((200, 2, 64), dtype=np.float32)
    v = rng.standard_normal((200, 2, 64), dtype=np.float32)
    for c in caches:
        a, b = c.new_seq(), c.new_seq()
        for layer in (0, 1):
            c.store(a, layer, k[:90], v[:90])
            c.store(b, layer, k[90:160], v[90:160])
        t = c.seq_cp(a, 3, 80)  # unaligned: rows move between chunks
        c.seq_rm(b, 10, 30)
        for layer in (0, 1):
            c.store(t, layer, k[160:170], v[160:170])
    for layer in (0, 1):
        for got, want in zip(pool_bytes(caches[0], layer), pool_bytes(caches[1], layer), strict=True):
            np.testing.assert_array_equal(got, want)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    seqs = caches[1].seqs
    got = kvhal.to_numpy(caches[0].attention(1, q, seqs, [1, 1, 1]))
    want = kvhal.to_numpy(caches[1].attention(1, q, seqs, [1, 1, 1]))
    assert float(np.abs(got - want).max()) <= VulkanBackend.attention_tolerance
    for s in seqs:
        np.testing.assert_allclose(
            kvhal.to_numpy(caches[0].load(s, 1)[1]), caches[1].load(s, 1)[1], rtol=1e-6, atol=1e-6
        )


def test_too_many_chunks_is_a_capacity_error(available):
    be = VulkanBackend(max_binding_bytes=8192)
    with pytest.raises(kvhal.CapacityError, match="storage buffers per shader stage"):
        kvhal.KVCache(spec("f16"), 1 << 16, backend=be)
    small = VulkanBackend(max_binding_bytes=1024)
    assert "block_size" in small.supports(spec("f16", bs=64), "store")  # refused before anything is allocated
    with pytest.raises(kvhal.UnsupportedError, match="block_size"):
        kvhal.KVCache(spec("f16", bs=64), 128, backend=small)


# ---- limits refused by supports(), before anything is allocated -------------------------------------------


def test_workgroup_memory_limit_is_refused_up_front(available):
    """A head_dim whose attention workgroup does not fit the adapter's memory: supports() says so for
    attention (store and load still run), a named cache is refused, and auto moves on to another backend."""
    be = VulkanBackend()
    budget = be.workgroup_memory
    fits = max(d for d in range(32, 1 << 15, 32) if shaders.attention_workgroup_bytes(d, 1) <= budget)
    ok, big = spec("f16", dim=fits, heads=1), spec("f16", dim=fits + 32, heads=1)
    assert be.supports(ok, "attention") is None
    assert be.supports(big, "store") is None and be.supports(big, "load") is None
    why = be.supports(big, "attention")
    assert why is not None and "workgroup memory" in why and str(budget) in why
    with pytest.raises(kvhal.UnsupportedError, match="workgroup memory"):
        kvhal.KVCache(big, 16, backend="vulkan")
    infos = {i.name: i for i in kvhal.backends()}
    assert "workgroup memory" in infos["vulkan"].refusal(big)
    assert kvhal.KVCache(big, 16, backend="auto").backend.name != "vulkan"
    # the largest accepted head_dim really runs attention
    cache = kvhal.KVCache(ok, 16, backend=be)
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((2, 5, 1, fits), dtype=np.float32)
    s = cache.new_seq()
    cache.store(s, 0, k, v)
    q = rng.standard_normal((1, 2, fits), dtype=np.float32)
    f = formats.get("f16")
    want = attention_f64(q, [f.dequantize(f.quantize(k))], [f.dequantize(f.quantize(v))], [1])
    assert float(np.abs(kvhal.to_numpy(cache.attention(0, q, [s])) - want).max()) <= VulkanBackend.attention_tolerance


def test_large_moves_go_in_batches(available, monkeypatch):
    """Copies too big for one scratch binding go through the host, and raw block I/O splits into batches
    (both by rows and by pools); the bytes stay reference-identical."""
    monkeypatch.setattr(backend, "BATCH_BYTES", 3000)  # a few rows per batch, not a whole number of them
    sp = spec("q5_1", "bf16", bs=4, layers=3)
    caches = [kvhal.KVCache(sp, 256, backend="vulkan"), kvhal.KVCache(sp, 256, backend="reference")]
    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((2, 40, 2, 64), dtype=np.float32)
    for c in caches:
        s = c.new_seq()
        for layer in range(3):
            c.store(s, layer, k, v)
    caches[0].pools.state.scratch_limit = 4096  # below what copying these rows in one pass needs
    for c in caches:
        c.seq_cp(s, 1, 39)  # unaligned: 38 rows per layer moved by copy_slots
        c.seq_rm(s, 2, 6)  # shift down within the same pages
    for layer in range(3):
        for got, want in zip(pool_bytes(caches[0], layer), pool_bytes(caches[1], layer), strict=True):
            np.testing.assert_array_equal(got, want)
    ids = np.array([9, 0, 4, 3, 5, 1], np.int64)
    raw = caches[1].backend.read_blocks(caches[1].pools, ids)
    np.testing.assert_array_equal(caches[0].backend.read_blocks(caches[0].pools, ids), raw)
    fresh = kvhal.KVCache(sp, 256, backend="vulkan")
    fresh.backend.write_blocks(fresh.pools, ids, raw)
    np.testing.assert_array_equal(fresh.backend.read_blocks(fresh.pools, ids), raw)
    assert fresh.backend.read_blocks(fresh.pools, ids[:0]).shape == (0, sp.block_nbytes)


def test_shader_constants_come_from_the_format_registry():
    """Block lengths and sizes reach the shaders through one generated table, not numbers typed in .wgsl."""
    from kvhal.backend_util import format_table

    text = shaders.prelude()
    for name, _, length, nbytes in format_table():
        if name in shaders.FORMATS:
            assert f"const {name.upper()}_LEN: u32 = {length}u;" in text
            assert f"const {name.upper()}_BYTES: u32 = {nbytes}u;" in text
            if length > 1:
                assert f"{nbytes}u" not in shaders.kernel_text(f"formats/{name}.wgsl")
    assert shaders.FORMATS == VulkanBackend.formats


# ---- decode loop: nothing allocated per step ----------------------------------------------------------------


def test_decode_steps_allocate_nothing(available, monkeypatch):
    be = VulkanBackend()
    cache = kvhal.KVCache(spec("q8_0", "q4_0"), 2048, backend=be)
    rng = np.random.default_rng(2)
    seqs = [cache.new_seq() for _ in range(3)]
    for i, s in enumerate(seqs):
        cache.store(s, 0, *rng.standard_normal((2, 100 + 200 * i, 2, 64), dtype=np.float32))

    def step() -> np.ndarray:
        for s in seqs:
            cache.store(s, 0, *rng.standard_normal((2, 1, 2, 64), dtype=np.float32))
        return kvhal.to_numpy(cache.attention(0, rng.standard_normal((3, 8, 64), dtype=np.float32), seqs))

    step()  # first step builds pipelines, bind groups and scratch buffers
    device = be.gpu.device
    calls: dict[str, int] = {}
    for name in ("create_buffer", "create_bind_group", "create_shader_module", "create_compute_pipeline"):
        real = getattr(device, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kw)

        monkeypatch.setattr(device, name, counted)
    for _ in range(40):  # crosses partition-count boundaries (every 256 keys) of the longest sequence
        out = step()
    be.synchronize()
    assert calls == {}, f"decode steps created GPU objects: {calls}"
    assert out.shape == (3, 8, 64) and np.isfinite(out).all()


# ---- the integer helpers every stored bit goes through -----------------------------------------------------

HELPERS = """
@group(0) @binding(0) var<storage, read> a: array<u32>;
@group(0) @binding(1) var<storage, read> b: array<u32>;
@group(0) @binding(2) var<storage, read_write> o: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&a)) { return; }
    o[7u * i] = div_rn(a[i], b[i]);
    o[7u * i + 1u] = inv_bits(b[i]);
    o[7u * i + 2u] = f16_bits(a[i]);
    o[7u * i + 3u] = bf16_bits(a[i]);
    o[7u * i + 4u] = bitcast<u32>(f16_to_f32(a[i] & 0xffffu));
    o[7u * i + 5u] = floor_add(a[i], b[i], true);
    o[7u * i + 6u] = floor_add(a[i], b[i], false);
}
"""


def run_helpers(be: VulkanBackend, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dev, usage = be.gpu.device, be.gpu.wgpu.BufferUsage
    mod = dev.create_shader_module(code=shaders.prelude() + HELPERS)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    bufs = [
        dev.create_buffer_with_data(data=np.ascontiguousarray(x, np.uint32).tobytes(), usage=usage.STORAGE)
        for x in (a, b)
    ]
    out = dev.create_buffer(size=28 * len(a), usage=usage.STORAGE | usage.COPY_SRC)
    entries = [{"binding": i, "resource": {"buffer": x}} for i, x in enumerate((*bufs, out))]
    group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, group)
    cp.dispatch_workgroups(-(-len(a) // 64))
    cp.end()
    dev.queue.submit([enc.finish()])
    return np.frombuffer(dev.queue.read_buffer(out), np.uint32).reshape(-1, 7)


def test_integer_helpers_match_numpy(available):
    """div_rn, inv_bits, f16/bf16 rounding, f16 decoding and floor_add against numpy's IEEE float32."""
    rng = np.random.default_rng(5)
    n = 1 << 15
    bits = rng.integers(0, 1 << 32, (2, n), dtype=np.uint64).astype(np.uint32)
    sub = bits & np.uint32(0x807FFFFF)  # f32 subnormals
    near_f16 = bits & np.uint32(0x80FFFFFF) | np.uint32(0x37000000)  # f16 subnormal and normal range
    a = np.concatenate([bits[0], sub[0], near_f16[0], bits[0]])
    b = np.concatenate([bits[1], sub[1], bits[1], np.full(n, 0x42FE0000, np.uint32)])  # and x / 127
    keep = np.isfinite(a.view(np.float32)) & np.isfinite(b.view(np.float32)) & (b.view(np.float32) != 0)
    a, b = a[keep], b[keep]
    be = VulkanBackend()
    got = run_helpers(be, a, b)
    af, bf = a.view(np.float32), b.view(np.float32)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got[:, 0], (af / bf).view(np.uint32), err_msg="div_rn")
        inv = np.float32(1) / bf
    inv = np.where(np.isfinite(inv), inv, np.float32(0)).astype(np.float32)  # kvhal's _inverse
    np.testing.assert_array_equal(got[:, 1], inv.view(np.uint32), err_msg="inv_bits")
    ok = np.abs(af) <= 65504
    np.testing.assert_array_equal(got[ok, 2], af[ok].astype(np.float16).view(np.uint16), err_msg="f16_bits")
    bf16 = ((a.astype(np.uint64) + 0x7FFF + ((a >> 16) & 1)) >> 16).astype(np.uint32)
    np.testing.assert_array_equal(got[:, 3], bf16, err_msg="bf16_bits")
    h = (a & 0xFFFF).astype(np.uint16)
    ok = (h & 0x7C00) != 0x7C00  # finite halves
    want = h[ok].view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(got[ok, 4], want, err_msg="f16_to_f32")

    # floor_add(p, c * 2^25) = floor(fl(p + c)) or floor(p + c) (0 below 0), for the shaders' constants
    c = rng.choice(np.float32([0.5, 8.5, 16.5]), n)
    p = np.concatenate(
        [
            rng.uniform(-17, 60, n // 4),
            np.round(rng.uniform(-17, 60, n // 4)) - c[: n // 4],  # p + c exactly an integer
            np.round(rng.uniform(-17, 60, n // 4)) + 0.5,  # halves
            rng.standard_normal(n // 4) * 10.0 ** rng.integers(-45, 1, n // 4),  # tiny and subnormal p
        ]
    ).astype(np.float32)
    ulp = np.spacing(p.astype(np.float32))
    p = np.concatenate([p, p + ulp, p - ulp]).astype(np.float32)  # and their neighbours
    c = np.resize(c, len(p)).astype(np.float32)
    got = run_helpers(be, p.view(np.uint32), (c.astype(np.float64) * 2**25).astype(np.uint32))
    want = np.maximum(np.floor(p + c), 0).astype(np.uint32)  # p + c rounded in float32, as the reference
    np.testing.assert_array_equal(got[:, 5], want, err_msg="floor_add, rounded")
    exact = np.maximum(np.floor(p.astype(np.float64) + c), 0).astype(np.uint32)
    np.testing.assert_array_equal(got[:, 6], exact, err_msg="floor_add, exact")
