"""kvhal's Vulkan backend: WGSL compute shaders on any Vulkan device through wgpu (wgpu-native).

WGSL has no 8-bit types, so the shaders read and write the ggml blocks as ``u32`` words; every bit
that lands in a pool is computed in integer arithmetic (kernels/common.wgsl), which keeps the pools
byte-identical to kvhal/formats/ggml.py on any driver. A pool larger than one storage binding
(``maxStorageBufferBindingSize``, 128 MiB on lavapipe) is split into chunks of whole pages, one
buffer and one binding each; the shaders pick the chunk per page.

Environment: ``KVHAL_VULKAN_ADAPTER`` (index into the Vulkan adapters, or a name substring),
``KVHAL_VULKAN_POWER_PREFERENCE`` (``high-performance``, the default, or ``low-power``) and
``KVHAL_VULKAN_ALLOW_CPU=1`` (accept a software adapter such as lavapipe, which CI uses).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

import numpy as np

from kvhal import formats
from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, CapacityError, ShapeError
from kvhal.spec import CacheSpec

__all__ = ["VulkanBackend", "VulkanPool", "select_adapter"]

FORMATS = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"})
# adapter types in order of preference (wgpu reports virtual GPUs as "Unknown")
_RANK = {
    "high-performance": ("DiscreteGPU", "IntegratedGPU", "Unknown", "CPU"),
    "low-power": ("IntegratedGPU", "DiscreteGPU", "Unknown", "CPU"),
}
_SCORE = {"DiscreteGPU": 80, "IntegratedGPU": 70, "Unknown": 60, "CPU": 5}
_PARAM_STRIDE = 256  # bytes per dispatch's uniform slot; >= every adapter's uniform offset alignment
_PARAM_SLOTS = 16
_WG_ATTN = 64


def _describe(info: Mapping[str, Any]) -> str:
    return (
        f"{info.get('device') or '?'} ({info.get('adapter_type')}, vendor {info.get('vendor') or '?'} "
        f"0x{int(info.get('vendor_id', 0)):04x}, device 0x{int(info.get('device_id', 0)):04x}, "
        f"{info.get('description') or 'no driver description'})"
    )


def select_adapter(infos: Sequence[Mapping[str, Any]], env: Mapping[str, str]) -> tuple[int | None, str]:
    """Which of the Vulkan adapters ``infos`` (wgpu ``adapter.info`` dicts) to use, or None and why."""
    allow_cpu = env.get("KVHAL_VULKAN_ALLOW_CPU", "") == "1"
    want = env.get("KVHAL_VULKAN_ADAPTER", "").strip()
    pref = env.get("KVHAL_VULKAN_POWER_PREFERENCE", "high-performance").strip() or "high-performance"
    if pref not in _RANK:
        return None, f"KVHAL_VULKAN_POWER_PREFERENCE={pref!r} is not one of {', '.join(_RANK)}"
    if not infos:
        return None, (
            "no Vulkan adapter found: install a Vulkan driver (the GPU vendor's, or Mesa's lavapipe: "
            "apt install mesa-vulkan-drivers libvulkan1)"
        )
    listing = "; ".join(f"[{i}] {_describe(a)}" for i, a in enumerate(infos))
    if want:
        if want.isdigit():
            idx = int(want)
            if idx >= len(infos):
                return None, f"KVHAL_VULKAN_ADAPTER={want} but there are {len(infos)} Vulkan adapter(s): {listing}"
        else:
            hits = [
                i
                for i, a in enumerate(infos)
                if want.lower() in f"{a.get('device', '')} {a.get('vendor', '')} {a.get('description', '')}".lower()
            ]
            if not hits:
                return None, f"KVHAL_VULKAN_ADAPTER={want!r} matches no Vulkan adapter: {listing}"
            idx = hits[0]
        if infos[idx].get("adapter_type") == "CPU" and not allow_cpu:
            return None, (
                f"KVHAL_VULKAN_ADAPTER={want!r} selects the software adapter {_describe(infos[idx])}; "
                "set KVHAL_VULKAN_ALLOW_CPU=1 to use it"
            )
        return idx, _describe(infos[idx])
    rank = _RANK[pref]
    order = sorted(
        range(len(infos)),
        key=lambda i: (
            rank.index(infos[i].get("adapter_type", "Unknown")) if infos[i].get("adapter_type") in rank else 2,
            i,
        ),
    )
    usable = [i for i in order if allow_cpu or infos[i].get("adapter_type") != "CPU"]
    if not usable:
        return None, (
            f"only a software Vulkan adapter is present ({listing}); it runs the shaders correctly but "
            "slowly: set KVHAL_VULKAN_ALLOW_CPU=1 to use it"
        )
    return usable[0], _describe(infos[usable[0]])


def _quiet_driver() -> None:
    # Mesa's Vulkan loader complains on stderr when XDG_RUNTIME_DIR is unset (CI, containers)
    if not os.environ.get("XDG_RUNTIME_DIR"):
        path = tempfile.mkdtemp(prefix="kvhal-xdg-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["XDG_RUNTIME_DIR"] = path


@functools.lru_cache(maxsize=1)
def _adapters() -> tuple[Any, ...]:
    """The Vulkan adapters wgpu sees (enumerated once per process)."""
    _quiet_driver()
    import wgpu

    return tuple(a for a in wgpu.gpu.enumerate_adapters_sync() if a.info.get("backend_type") == "Vulkan")


def _choose() -> tuple[Any | None, str]:
    if importlib.util.find_spec("wgpu") is None:
        return None, "the wgpu package is not installed (pip install kvhal-vulkan, or pip install wgpu)"
    try:
        adapters = _adapters()
    except Exception as e:  # no Vulkan loader, broken driver: say so rather than crash kvhal info
        return None, f"wgpu could not enumerate adapters: {type(e).__name__}: {e}"
    idx, reason = select_adapter([a.info for a in adapters], os.environ)
    return (None if idx is None else adapters[idx]), reason


# ---- shader sources --------------------------------------------------------------------------------


def _kernel_text(name: str) -> str:
    return resources.files(__package__).joinpath("kernels", name).read_text()


@functools.cache
def _format_section(fmt: str, section: str, prefix: str) -> str:
    text = _kernel_text(f"formats/{fmt}.wgsl")
    parts: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("//! "):
            current = line[4:].strip()
            continue
        parts.setdefault(current, []).append(line)
    return Template("\n".join(parts[section])).substitute(P=prefix)


def _pool_access(prefix: str, n: int, first: int, mode: str) -> str:
    """Bindings for a pool split into ``n`` chunks, and accessors that pick the chunk ``c``.

    ``mode`` "read": word/half/byte readers; "atomic": atomic store/and/or (writers of rows that
    share their boundary words with rows other invocations write).
    """
    elem = "atomic<u32>" if mode == "atomic" else "u32"
    access = "read_write" if mode == "atomic" else "read"
    lines = [f"@group(0) @binding({first + i}) var<storage, {access}> {prefix}{i}: array<{elem}>;" for i in range(n)]

    def fn(head: str, stmt: str) -> None:
        if n == 1:
            body = stmt.format(i=0)
        else:
            cases = [f"case {i}u: {{ {stmt.format(i=i)} }}" for i in range(n - 1)]
            body = "switch c { " + " ".join(cases) + f" default: {{ {stmt.format(i=n - 1)} }} }}"
        lines.append(f"fn {prefix}_{head} {{ {body} }}")

    if mode == "atomic":
        fn("st(c: u32, w: u32, x: u32)", f"atomicStore(&{prefix}{{i}}[w], x);")
        fn("and(c: u32, w: u32, x: u32)", f"atomicAnd(&{prefix}{{i}}[w], x);")
        fn("or(c: u32, w: u32, x: u32)", f"atomicOr(&{prefix}{{i}}[w], x);")
        return "\n".join(lines)
    fn("rd(c: u32, w: u32) -> u32", f"return {prefix}{{i}}[w];")
    lines.append(f"""
fn {prefix}_h(c: u32, byte: u32) -> u32 {{ return ({prefix}_rd(c, byte >> 2u) >> ((byte & 2u) * 8u)) & 0xffffu; }}
fn {prefix}_b(c: u32, byte: u32) -> u32 {{ return ({prefix}_rd(c, byte >> 2u) >> ((byte & 3u) * 8u)) & 0xffu; }}
fn {prefix}_w(c: u32, byte: u32) -> u32 {{
    let i = byte >> 2u;
    let lo = {prefix}_rd(c, i);
    if ((byte & 2u) == 0u) {{ return lo; }}
    return (lo >> 16u) | ({prefix}_rd(c, i + 1u) << 16u);
}}""")
    return "\n".join(lines)


def _source(kernel: str, consts: Mapping[str, int], body: str) -> str:
    main = Template(_kernel_text(kernel)).substitute({**{k: str(v) for k, v in consts.items()}, "FORMAT": body})
    return _kernel_text("common.wgsl") + "\n" + main


# ---- device context ---------------------------------------------------------------------------------


class _Gpu:
    """One wgpu device per adapter, with the compiled pipelines shared by every cache on it."""

    def __init__(self, adapter: Any) -> None:
        import wgpu

        self.wgpu = wgpu
        self.info = dict(adapter.info)
        self.device = adapter.request_device_sync(label="kvhal-vulkan")  # wgpu-py asks for the adapter's limits
        self.limits = dict(self.device.limits)
        self.queue = self.device.queue
        self.params = self.device.create_buffer(
            size=_PARAM_STRIDE * _PARAM_SLOTS, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        )
        self._pipelines: dict[str, tuple[Any, Any]] = {}
        usage = wgpu.BufferUsage
        self._fence = (
            self.device.create_buffer(size=4, usage=usage.COPY_SRC),
            self.device.create_buffer(size=4, usage=usage.MAP_READ | usage.COPY_DST),
        )

    def wait(self) -> None:
        """Block until all submitted work is done.

        wgpu 0.32's ``queue.on_submitted_work_done_sync`` fails (cffi callback signature), so map a
        buffer written by a last, tiny submission: a queue finishes its work in submission order.
        """
        src, dst = self._fence
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, dst, 0, 4)
        self.queue.submit([enc.finish()])
        dst.map_sync(self.wgpu.MapMode.READ, 0, 4)
        dst.unmap()

    def pipeline(self, source: str, kinds: tuple[str, ...]) -> tuple[Any, Any]:
        """(pipeline, bind group layout) for a shader; ``kinds`` are bindings 1.. ("read" or "rw")."""
        key = source
        if key not in self._pipelines:
            wgpu = self.wgpu
            entries = [
                {
                    "binding": 0,
                    "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True},
                }
            ]
            for i, kind in enumerate(kinds, start=1):
                t = wgpu.BufferBindingType.read_only_storage if kind == "read" else wgpu.BufferBindingType.storage
                entries.append({"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": t}})
            layout = self.device.create_bind_group_layout(entries=entries)
            module = self.device.create_shader_module(code=source)
            pipe = self.device.create_compute_pipeline(
                layout=self.device.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": module, "entry_point": "main"},
            )
            self._pipelines[key] = (pipe, layout)
        return self._pipelines[key]


@functools.cache
def _gpu(adapter: Any) -> _Gpu:
    return _Gpu(adapter)


# ---- pools --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class VulkanPool:
    """One layer's K or V pool: whole pages in one or more buffers (one storage binding each)."""

    buffers: list[Any]
    shape: tuple[int, int, int, int]  # spec.pool_shape
    pages_per_chunk: int
    fmt: formats.Format = field(repr=False)

    @property
    def page_bytes(self) -> int:
        return self.shape[1] * self.shape[2] * self.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(int(b.size) for b in self.buffers)


@dataclass(frozen=True)
class _Step:
    pipe: Any
    layout: Any
    buffers: tuple[Any, ...]
    params: tuple[int, ...]  # u32 words after nx
    workgroups: int


class VulkanBackend(Backend):
    name = "vulkan"
    formats = FORMATS
    # f32 accumulation in the shaders against float64 in the oracle
    attention_tolerance = 5e-5

    @classmethod
    def probe(cls) -> Probe | None:
        adapter, reason = _choose()
        if adapter is None:
            return None
        kind = adapter.info.get("adapter_type", "Unknown")
        note = " (software driver: correct but slow)" if kind == "CPU" else ""
        return Probe(score=_SCORE.get(kind, 60), reason=f"wgpu on Vulkan{note}", device=reason)

    @classmethod
    def unavailable_reason(cls) -> str:
        return _choose()[1]

    def __init__(self, *, max_binding_bytes: int | None = None) -> None:
        """``max_binding_bytes`` lowers the per-binding limit below the adapter's (to test pool splitting)."""
        adapter, reason = _choose()
        if adapter is None:
            raise BackendUnavailableError(f"backend 'vulkan' is unavailable: {reason}")
        self.gpu = _gpu(adapter)
        limit = min(self.gpu.limits["max-storage-buffer-binding-size"], self.gpu.limits["max-buffer-size"])
        self.binding_limit = limit // 4 * 4  # scratch buffers
        if max_binding_bytes is not None:
            if max_binding_bytes < 4:
                raise ValueError(f"max_binding_bytes must be at least 4, got {max_binding_bytes}")
            limit = min(limit, max_binding_bytes)
        self.pool_binding_limit = limit // 4 * 4
        self._scratch: dict[str, Any] = {}
        # (pipeline, buffers) -> (bind group, the buffers): holding them keeps their ids from being reused
        self._groups: dict[tuple[int, ...], tuple[Any, tuple[Any, ...]]] = {}

    # -- buffers --------------------------------------------------------------------------------------

    def _buffer(self, role: str, nbytes: int) -> Any:
        """A scratch buffer that grows (by powers of two) and is reused across calls."""
        wgpu = self.gpu.wgpu
        nbytes = max(16, -(-nbytes // 4) * 4)
        buf = self._scratch.get(role)
        if buf is not None and buf.size >= nbytes:
            return buf
        size = 1 << max(12, (nbytes - 1).bit_length())
        if role == "stage":
            usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        else:
            if nbytes > self.binding_limit:
                raise CapacityError(
                    f"vulkan: one call needs {nbytes} bytes of {role!r} scratch, above the adapter's "
                    f"{self.binding_limit}-byte storage binding limit; pass fewer tokens per call"
                )
            size = min(size, self.binding_limit)
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        if buf is not None:  # bind groups of the old buffer go with it
            self._groups = {k: g for k, g in self._groups.items() if id(buf) not in k}
            buf.destroy()
        buf = self.gpu.device.create_buffer(label=f"kvhal-{role}", size=size, usage=usage)
        self._scratch[role] = buf
        return buf

    def _upload(self, role: str, arrays: Sequence[np.ndarray]) -> tuple[Any, list[int]]:
        """Write arrays back to back (4-byte elements) into one scratch buffer; their u32 offsets."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total // 4)
            total += a.nbytes
        buf = self._buffer(role, total)
        pos = 0
        for a in arrays:
            if a.nbytes:
                self.gpu.queue.write_buffer(buf, pos, np.ascontiguousarray(a))
            pos += a.nbytes
        return buf, offsets

    def _group(self, step: _Step) -> Any:
        key = (id(step.pipe), *map(id, step.buffers))
        hit = self._groups.get(key)
        if hit is None:
            entries = [{"binding": 0, "resource": {"buffer": self.gpu.params, "offset": 0, "size": _PARAM_STRIDE}}]
            entries += [
                {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                for i, b in enumerate(step.buffers, start=1)
            ]
            hit = self._groups[key] = (
                self.gpu.device.create_bind_group(layout=step.layout, entries=entries),
                step.buffers,
            )
        return hit[0]

    def _encode(self, steps: Sequence[_Step]) -> Any:
        """A command encoder holding the steps in one compute pass (each its own uniform slot)."""
        if len(steps) > _PARAM_SLOTS:
            raise AssertionError(f"internal: {len(steps)} steps in one submit, {_PARAM_SLOTS} uniform slots")
        max_x = self.gpu.limits["max-compute-workgroups-per-dimension"]
        params = np.zeros((max(len(steps), 1), _PARAM_STRIDE // 4), np.uint32)
        grids = []
        for i, s in enumerate(steps):
            nx = min(max(s.workgroups, 1), max_x)
            ny = -(-max(s.workgroups, 1) // nx)
            if ny > max_x:
                raise CapacityError(f"vulkan: {s.workgroups} workgroups exceed the adapter's grid; pass fewer tokens")
            params[i, 0] = nx
            params[i, 1 : 1 + len(s.params)] = s.params
            grids.append((nx, ny))
        enc = self.gpu.device.create_command_encoder()
        if not steps:
            return enc
        self.gpu.queue.write_buffer(self.gpu.params, 0, params)
        cp = enc.begin_compute_pass()
        for i, (s, (nx, ny)) in enumerate(zip(steps, grids, strict=True)):
            if s.workgroups:
                cp.set_pipeline(s.pipe)
                cp.set_bind_group(0, self._group(s), [i * _PARAM_STRIDE])
                cp.dispatch_workgroups(nx, ny)
        cp.end()
        return enc

    def _submit(self, steps: Sequence[_Step]) -> None:
        self.gpu.queue.submit([self._encode(steps).finish()])

    def _read(self, steps: Sequence[_Step], buf: Any, nbytes: int, reuse: bool = True) -> np.ndarray:
        """Run the steps, then copy the first ``nbytes`` of ``buf`` back to the host."""
        size = -(-nbytes // 4) * 4
        if reuse:
            stage = self._buffer("stage", size)
        else:  # one-off reads (whole pools) must not leave a pool-sized staging buffer behind
            usage = self.gpu.wgpu.BufferUsage
            stage = self.gpu.device.create_buffer(size=size, usage=usage.MAP_READ | usage.COPY_DST)
        enc = self._encode(steps)
        enc.copy_buffer_to_buffer(buf, 0, stage, 0, size)
        self.gpu.queue.submit([enc.finish()])
        stage.map_sync(self.gpu.wgpu.MapMode.READ, 0, size)
        try:
            return np.frombuffer(stage.read_mapped(0, size), np.uint8)[:nbytes].copy()
        finally:
            stage.unmap()
            if not reuse:
                stage.destroy()

    # -- pipelines ------------------------------------------------------------------------------------

    def _geometry(self, pool: VulkanPool) -> dict[str, int]:
        _, h, bs, rb = pool.shape
        return {"H": h, "BS": bs, "PPC": pool.pages_per_chunk, "RB": rb}

    def _pipe(self, kernel: str, pool: VulkanPool) -> tuple[Any, Any]:
        spec = self.spec
        g = self._geometry(pool)
        n = len(pool.buffers)
        fmt = pool.fmt
        if kernel == "store":
            vb = 0 if fmt.block_len > 1 else fmt.block_bytes
            ub = fmt.block_bytes if vb == 0 else 32 * vb
            consts = {**g, "D": spec.head_dim, "UPR": -(-spec.head_dim // 32), "UB": ub, "VB": vb}
            body = _pool_access("p", n, 3, "atomic") + "\n" + _format_section(fmt.name, "quant", "p")
            kinds = ("read", "read") + ("rw",) * n
        elif kernel == "load":
            consts = {**g, "D": spec.head_dim}
            body = _pool_access("p", n, 3, "read") + "\n" + _format_section(fmt.name, "deq", "p")
            kinds = ("read", "rw") + ("read",) * n
        elif kernel == "gather":
            consts, body, kinds = g, _pool_access("p", n, 3, "read"), ("read", "rw") + ("read",) * n
        else:  # scatter
            consts, body, kinds = g, _pool_access("p", n, 3, "atomic"), ("read", "read") + ("rw",) * n
        return self.gpu.pipeline(_source(f"{kernel}.wgsl", consts, body), kinds)

    def _heads_per_group(self, group: int) -> int:
        """Query heads one attention workgroup serves (a divisor of the GQA group that fits its memory)."""
        d, wg = self.spec.head_dim, self._wg
        budget = self.gpu.limits["max-compute-workgroup-storage-size"]
        for ht in range(min(group, 8), 0, -1):
            if group % ht == 0 and 4 * (ht * (d + -(-d // 32) + 2 * wg) + 2 * wg + 3) <= budget:
                return ht
        raise ShapeError(
            f"vulkan: head_dim {d} needs more workgroup memory than this adapter's {budget} bytes; use a smaller head_dim"
        )

    def _attention_pipes(self, pools: LayerPools, ht: int) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        k, v = pools.k, pools.v
        nk, nv = len(k.buffers), len(v.buffers)
        consts = {
            "D": self.spec.head_dim,
            "H": self.spec.n_kv_heads,
            "BS": self.spec.block_size,
            "KPPC": k.pages_per_chunk,
            "VPPC": v.pages_per_chunk,
            "KRB": k.shape[3],
            "VRB": v.shape[3],
            "WG": self._wg,
            "HT": ht,
        }
        body = "\n".join(
            [
                _pool_access("k", nk, 4, "read"),
                _pool_access("v", nv, 4 + nk, "read"),
                _format_section(k.fmt.name, "dot", "k"),
                _format_section(v.fmt.name, "deq", "v"),
            ]
        )
        attn = self.gpu.pipeline(
            _source("attention.wgsl", consts, body), ("read", "read", "rw") + ("read",) * (nk + nv)
        )
        comb = self.gpu.pipeline(_source("combine.wgsl", {"D": self.spec.head_dim}, ""), ("read", "rw"))
        return attn, comb

    # -- the Backend contract ----------------------------------------------------------------------------

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        self._groups.clear()  # groups of an earlier allocation's pools
        self._wg = min(
            _WG_ATTN,
            self.gpu.limits["max-compute-invocations-per-workgroup"],
            self.gpu.limits["max-compute-workgroup-size-x"],
        )
        wg_bytes = 4 * (spec.head_dim + -(-spec.head_dim // 32) + 4 * self._wg + 3)  # attention, one head per group
        if wg_bytes > self.gpu.limits["max-compute-workgroup-storage-size"]:
            raise ShapeError(
                f"vulkan: head_dim {spec.head_dim} needs {wg_bytes} bytes of workgroup memory, above this "
                f"adapter's {self.gpu.limits['max-compute-workgroup-storage-size']}; use a smaller head_dim"
            )
        chunks = {}
        for which in ("k", "v"):
            shape = spec.pool_shape(n_blocks, which)
            page = shape[1] * shape[2] * shape[3]
            # pages per chunk depends on the limit only, not on n_blocks: caches of any size share pipelines
            ppc = self.pool_binding_limit // page
            if ppc < 1:
                raise CapacityError(
                    f"vulkan: one page of the {which.upper()} pool is {page} bytes, above the "
                    f"{self.pool_binding_limit}-byte storage binding limit; use a smaller block_size"
                )
            chunks[which] = (shape, ppc, math.ceil(n_blocks / ppc))
        need = 3 + chunks["k"][2] + chunks["v"][2]
        have = self.gpu.limits["max-storage-buffers-per-shader-stage"]
        if need > have:
            raise CapacityError(
                f"vulkan: {n_blocks} blocks need {need - 3} pool bindings of at most {self.pool_binding_limit} bytes "
                f"plus 3, above this adapter's {have} storage buffers per shader stage; allocate fewer blocks"
            )
        usage = self.gpu.wgpu.BufferUsage
        out = []
        try:
            for _ in range(spec.n_layers):
                pools = []
                for which, fmt in (("k", spec.k_fmt), ("v", spec.v_fmt)):
                    shape, ppc, n = chunks[which]
                    page = shape[1] * shape[2] * shape[3]
                    bufs = []
                    for c in range(n):
                        pages = min(ppc, n_blocks - c * ppc)
                        bufs.append(  # WebGPU zero-fills new buffers
                            self.gpu.device.create_buffer(
                                label=f"kvhal-{which}-pool",
                                size=-(-pages * page // 4) * 4,
                                usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST,
                            )
                        )
                    pools.append(VulkanPool(bufs, shape, ppc, fmt))
                out.append(LayerPools(pools[0], pools[1], pools[0].nbytes + pools[1].nbytes))
        except self.gpu.wgpu.GPUError as e:
            total = n_blocks * spec.n_layers * spec.n_kv_heads * spec.block_size * (spec.k_row_bytes + spec.v_row_bytes)
            raise CapacityError(
                f"vulkan: could not allocate {total} bytes of pools on {self.gpu.info.get('device')}: {e}; "
                "allocate fewer blocks or layers"
            ) from e
        return out

    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        spec = self.spec
        kx = np.ascontiguousarray(k, np.float32).reshape(-1).view(np.uint32)
        vx = np.ascontiguousarray(v, np.float32).reshape(-1).view(np.uint32)
        n = int(k.shape[0])
        x, (koff, voff) = self._upload("x", [kx, vx])
        meta, (soff,) = self._upload("meta", [np.asarray(slots, np.uint32)])
        units = n * spec.n_kv_heads * -(-spec.head_dim // 32)
        steps = []
        for pool, off in ((pools.k, koff), (pools.v, voff)):
            pipe, layout = self._pipe("store", pool)
            steps.append(_Step(pipe, layout, (x, meta, *pool.buffers), (n, off, soff), -(-units // 64)))
        self._submit(steps)

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        shape = (n, spec.n_kv_heads, spec.head_dim)
        size = n * spec.n_kv_heads * spec.head_dim
        if size == 0:
            return np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        meta, (ioff,) = self._upload("meta", [np.asarray(block_ids, np.uint32)])
        out = self._buffer("out", 8 * size)
        steps = []
        for pool, ooff in ((pools.k, 0), (pools.v, size)):
            pipe, layout = self._pipe("load", pool)
            steps.append(_Step(pipe, layout, (meta, out, *pool.buffers), (n, ioff, ooff), -(-size // 64)))
        kv = self._read(steps, out, 8 * size).view(np.float32)
        return kv[:size].reshape(shape), kv[size:].reshape(shape)

    def attention(
        self,
        q: Any,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> np.ndarray:
        spec = self.spec
        qx = np.ascontiguousarray(q, np.float32)
        rows, hq, d = qx.shape
        seq_lens = np.asarray(seq_lens, np.int64)
        q_lens = np.asarray(q_lens, np.int64)
        seq = np.repeat(np.arange(len(q_lens)), q_lens)
        starts = np.cumsum(q_lens) - q_lens
        pos = seq_lens[seq] - q_lens[seq] + (np.arange(rows) - starts[seq])
        hi = pos + 1 if causal else seq_lens[seq]
        lo = np.maximum(pos - window + 1, 0) if window is not None else np.zeros(rows, np.int64)
        info = np.stack([seq, lo, hi, np.zeros(rows, np.int64)], axis=1).astype(np.uint32)
        group = hq // spec.n_kv_heads
        ht = self._heads_per_group(group)
        tiles = rows * spec.n_kv_heads * (group // ht)
        # split long contexts into partitions of >= 256 keys until there are enough workgroups
        parts = max(1, min(-(-512 // tiles), -(-int((hi - lo).max()) // 256)))
        table = np.asarray(block_table, np.int64).astype(np.uint32)  # -1 padding is never read
        qbuf, _ = self._upload("q", [qx.reshape(-1)])
        meta, (_, toff) = self._upload("meta", [info.reshape(-1), table.reshape(-1)])
        # tiles * parts < tiles + 512: sized so a growing context never regrows it
        part = self._buffer("part", (tiles + 512) * ht * (d + 2) * 4)
        out = self._buffer("out", rows * hq * d * 4)
        (apipe, alayout), (cpipe, clayout) = self._attention_pipes(pools, ht)
        scale_bits = int(np.float32(scale).view(np.uint32))
        steps = [
            _Step(
                apipe,
                alayout,
                (qbuf, meta, part, *pools.k.buffers, *pools.v.buffers),
                (rows, hq, group, parts, table.shape[1], toff, scale_bits),
                tiles * parts,
            ),
            _Step(cpipe, clayout, (part, out), (rows * hq, parts), rows * hq),
        ]
        return self._read(steps, out, rows * hq * d * 4).view(np.float32).reshape(rows, hq, d)

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        n = len(src)
        if n == 0:
            return
        h = self.spec.n_kv_heads
        meta, (soff, doff) = self._upload("meta", [np.asarray(src, np.uint32), np.asarray(dst, np.uint32)])
        rw = [-(-p.shape[3] // 4) for p in (pools.k, pools.v)]
        tmp = self._buffer("tmp", 4 * n * h * sum(rw))
        gathers, scatters = [], []
        for pool, toff, words in ((pools.k, 0, rw[0]), (pools.v, n * h * rw[0], rw[1])):
            pipe, layout = self._pipe("gather", pool)
            gathers.append(_Step(pipe, layout, (meta, tmp, *pool.buffers), (n, soff, toff), -(-n * h * words // 64)))
            pipe, layout = self._pipe("scatter", pool)
            scatters.append(_Step(pipe, layout, (meta, tmp, *pool.buffers), (n, doff, toff), -(-n * h // 64)))
        self._submit(gathers + scatters)

    def synchronize(self) -> None:
        self.gpu.wait()

    def to_numpy(self, x: Any) -> np.ndarray:
        if not isinstance(x, VulkanPool):
            return super().to_numpy(x)
        page = x.page_bytes
        chunks = []
        n_blocks = x.shape[0]
        for c, buf in enumerate(x.buffers):
            pages = min(x.pages_per_chunk, n_blocks - c * x.pages_per_chunk)
            chunks.append(self._read([], buf, pages * page, reuse=False))
        return np.concatenate(chunks).reshape(x.shape)
