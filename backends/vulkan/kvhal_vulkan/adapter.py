"""Which Vulkan adapter to use, the probe, and the one wgpu device per adapter that every cache shares.

Adapter options (argument, else environment variable): ``adapter`` (``KVHAL_VULKAN_ADAPTER``: an index
into the Vulkan adapters or a name substring), ``power_preference`` (``KVHAL_VULKAN_POWER_PREFERENCE``)
and ``allow_cpu`` (``KVHAL_VULKAN_ALLOW_CPU=1``: accept a software adapter such as lavapipe).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvhal.backend import Probe
from kvhal.backend_util import Option, one_of, parse_options
from kvhal.errors import SpecError

from . import shaders

# adapter types in order of preference (wgpu reports virtual GPUs as "Unknown")
RANK = {
    "high-performance": ("DiscreteGPU", "IntegratedGPU", "Unknown", "CPU"),
    "low-power": ("IntegratedGPU", "DiscreteGPU", "Unknown", "CPU"),
}
SCORE = {"DiscreteGPU": 80, "IntegratedGPU": 70, "Unknown": 60, "CPU": 5}
OPTIONS = (
    Option("adapter", str, "", env="KVHAL_VULKAN_ADAPTER", help="adapter index or name substring"),
    Option(
        "power_preference",
        str,
        "high-performance",
        env="KVHAL_VULKAN_POWER_PREFERENCE",
        check=one_of(*RANK),
        help="which kind of GPU comes first",
    ),
    Option("allow_cpu", int, 0, env="KVHAL_VULKAN_ALLOW_CPU", check=one_of(0, 1), help="1: accept a software adapter"),
)
_NAMED = "KVHAL_VULKAN_ADAPTER or option adapter"
PARAM_STRIDE = 256  # bytes per dispatch's uniform slot; >= every adapter's uniform offset alignment


def describe(info: Mapping[str, Any]) -> str:
    return (
        f"{info.get('device') or '?'} ({info.get('adapter_type')}, vendor {info.get('vendor') or '?'} "
        f"0x{int(info.get('vendor_id', 0)):04x}, device 0x{int(info.get('device_id', 0)):04x}, "
        f"{info.get('description') or 'no driver description'})"
    )


def select_adapter(
    infos: Sequence[Mapping[str, Any]],
    want: str = "",
    power_preference: str = "high-performance",
    allow_cpu: bool = False,
) -> tuple[int | None, str]:
    """Which of the Vulkan adapters ``infos`` (wgpu ``adapter.info`` dicts) to use, or None and why."""
    if not infos:
        return None, (
            "no Vulkan adapter found: install a Vulkan driver (the GPU vendor's, or Mesa's lavapipe: "
            "apt install mesa-vulkan-drivers libvulkan1)"
        )
    listing = "; ".join(f"[{i}] {describe(a)}" for i, a in enumerate(infos))
    want = want.strip()
    if want:
        if want.isdigit():
            idx = int(want)
            if idx >= len(infos):
                return None, f"adapter {want} ({_NAMED}) is out of range: {len(infos)} Vulkan adapter(s): {listing}"
        else:
            text = [f"{a.get('device', '')} {a.get('vendor', '')} {a.get('description', '')}".lower() for a in infos]
            hits = [i for i, t in enumerate(text) if want.lower() in t]
            if not hits:
                return None, f"adapter {want!r} ({_NAMED}) matches no Vulkan adapter: {listing}"
            idx = hits[0]
        if infos[idx].get("adapter_type") == "CPU" and not allow_cpu:
            return None, (
                f"adapter {want!r} ({_NAMED}) selects the software adapter {describe(infos[idx])}; "
                "set KVHAL_VULKAN_ALLOW_CPU=1 (or allow_cpu=1) to use it"
            )
        return idx, describe(infos[idx])
    rank = RANK[power_preference]

    def order(i: int) -> tuple[int, int]:
        kind = infos[i].get("adapter_type", "Unknown")
        return (rank.index(kind) if kind in rank else 2, i)

    usable = [i for i in sorted(range(len(infos)), key=order) if allow_cpu or infos[i].get("adapter_type") != "CPU"]
    if not usable:
        return None, (
            f"only a software Vulkan adapter is present ({listing}); it runs the shaders correctly but "
            "slowly: set KVHAL_VULKAN_ALLOW_CPU=1 (or allow_cpu=1) to use it"
        )
    return usable[0], describe(infos[usable[0]])


def _quiet_driver() -> None:
    # Mesa's Vulkan loader complains on stderr when XDG_RUNTIME_DIR is unset (CI, containers)
    if not os.environ.get("XDG_RUNTIME_DIR"):
        path = tempfile.mkdtemp(prefix="kvhal-xdg-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["XDG_RUNTIME_DIR"] = path


@functools.lru_cache(maxsize=1)
def adapters() -> tuple[Any, ...]:
    """The Vulkan adapters wgpu sees (enumerated once per process; its OpenGL ones are ignored)."""
    _quiet_driver()
    import wgpu

    return tuple(a for a in wgpu.gpu.enumerate_adapters_sync() if a.info.get("backend_type") == "Vulkan")


@functools.lru_cache(maxsize=16)
def choose(want: str, power_preference: str, allow_cpu: bool) -> tuple[Any | None, str]:
    """The adapter for these settings, or None; and the adapter's description or why there is none."""
    if importlib.util.find_spec("wgpu") is None:
        return None, "the wgpu package is not installed (pip install kvhal-vulkan, or pip install wgpu)"
    try:
        found = adapters()
    except Exception as e:  # no Vulkan loader, broken driver: say so rather than crash kvhal info
        return None, f"wgpu could not enumerate adapters: {type(e).__name__}: {e}"
    idx, reason = select_adapter([a.info for a in found], want, power_preference, allow_cpu)
    return (None if idx is None else found[idx]), reason


def choose_from(options: Mapping[str, Any]) -> tuple[Any | None, str]:
    return choose(options["adapter"], options["power_preference"], bool(options["allow_cpu"]))


def probe() -> Probe:
    """The adapter the environment selects (the shared instance's), scored by its kind."""
    try:
        found, reason = choose_from(parse_options("vulkan", {}, OPTIONS))
    except SpecError as e:
        return Probe(None, str(e))
    if found is None:
        return Probe(None, reason)
    kind = found.info.get("adapter_type", "Unknown")
    note = " (software driver: correct but slow)" if kind == "CPU" else ""
    return Probe(score=SCORE.get(kind, 60), reason=f"wgpu on Vulkan{note}", device=reason)


class Gpu:
    """One wgpu device: its limits, and the compiled pipelines every cache on it shares."""

    def __init__(self, adapter: Any) -> None:
        import wgpu

        self.wgpu = wgpu
        self.info = dict(adapter.info)
        self.device = adapter.request_device_sync(label="kvhal-vulkan")  # wgpu-py asks for the adapter's limits
        self.limits = dict(self.device.limits)
        self.queue = self.device.queue
        self._pipelines: dict[shaders.Kernel, tuple[Any, Any]] = {}
        self._lock = threading.Lock()  # caches on several threads compile and synchronize through it
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
        with self._lock:
            enc = self.device.create_command_encoder()
            enc.copy_buffer_to_buffer(src, 0, dst, 0, 4)
            self.queue.submit([enc.finish()])
            dst.map_sync(self.wgpu.MapMode.READ, 0, 4)
            dst.unmap()

    def pipeline(self, kernel: shaders.Kernel) -> tuple[Any, Any]:
        """(pipeline, bind group layout) of a kernel, compiled once per device."""
        hit = self._pipelines.get(kernel)
        if hit is not None:
            return hit
        with self._lock:
            if kernel not in self._pipelines:
                self._pipelines[kernel] = self._compile(kernel)
            return self._pipelines[kernel]

    def _compile(self, kernel: shaders.Kernel) -> tuple[Any, Any]:
        wgpu = self.wgpu
        stage = wgpu.ShaderStage.COMPUTE
        uniform = {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True}
        entries = [{"binding": 0, "visibility": stage, "buffer": uniform}]
        for i, kind in enumerate(kernel.bindings, start=1):
            t = wgpu.BufferBindingType.read_only_storage if kind == "read" else wgpu.BufferBindingType.storage
            entries.append({"binding": i, "visibility": stage, "buffer": {"type": t}})
        layout = self.device.create_bind_group_layout(entries=entries)
        module = self.device.create_shader_module(code=kernel.source)
        pipe = self.device.create_compute_pipeline(
            layout=self.device.create_pipeline_layout(bind_group_layouts=[layout]),
            compute={"module": module, "entry_point": "main"},
        )
        return pipe, layout


_gpus: dict[int, Gpu] = {}
_gpus_lock = threading.Lock()


def gpu(adapter: Any) -> Gpu:
    """The device of ``adapter``: one per adapter per process (adapters are enumerated once, so ids are stable)."""
    with _gpus_lock:
        if id(adapter) not in _gpus:
            _gpus[id(adapter)] = Gpu(adapter)
        return _gpus[id(adapter)]
