"""Device memory of one cache: its pools (split into chunks of whole pages, one binding each) and its
command context (uniform slots, scratch buffers, bind groups). Nothing here is shared between caches,
so caches on one device never race on a buffer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhal.errors import CapacityError

from . import shaders
from .adapter import PARAM_STRIDE, Gpu


@dataclass(eq=False)
class VulkanPool:
    """One layer's K or V pool: whole pages in one or more buffers (one storage binding each)."""

    buffers: list[Any]
    shape: tuple[int, int, int, int]  # spec.pool_shape
    geometry: shaders.PoolGeometry

    @property
    def page_bytes(self) -> int:
        return self.shape[1] * self.shape[2] * self.shape[3]

    @property
    def row_words(self) -> int:
        """u32 words of one row in word-aligned scratch (gather/scatter)."""
        return -(-self.shape[3] // 4)

    @property
    def nbytes(self) -> int:
        return sum(int(b.size) for b in self.buffers)


@dataclass(frozen=True)
class Dispatch:
    kernel: shaders.Kernel
    buffers: tuple[Any, ...]  # bindings 1..
    params: tuple[int, ...]  # u32 words after nx
    workgroups: int


class Context:
    """One cache's command state: ``slots`` uniform slots (one per dispatch of a submission), scratch
    buffers that grow by powers of two and are reused, and the bind groups over them."""

    def __init__(self, gpu: Gpu, slots: int, scratch_limit: int) -> None:
        self.gpu = gpu
        self.slots = slots
        self.scratch_limit = scratch_limit
        usage = gpu.wgpu.BufferUsage
        self.params = gpu.device.create_buffer(size=PARAM_STRIDE * slots, usage=usage.UNIFORM | usage.COPY_DST)
        self._scratch: dict[str, Any] = {}
        # (pipeline, buffers) -> (bind group, the buffers): holding them keeps their ids from being reused
        self._groups: dict[tuple[int, ...], tuple[Any, tuple[Any, ...]]] = {}

    def buffer(self, role: str, nbytes: int) -> Any:
        """The scratch buffer of ``role``, at least ``nbytes`` long."""
        wgpu = self.gpu.wgpu
        nbytes = max(16, -(-nbytes // 4) * 4)
        buf = self._scratch.get(role)
        if buf is not None and buf.size >= nbytes:
            return buf
        size = 1 << max(12, (nbytes - 1).bit_length())
        if role == "stage":
            usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        else:
            if nbytes > self.scratch_limit:
                raise CapacityError(
                    f"vulkan: one call needs {nbytes} bytes of {role!r} scratch, above the adapter's "
                    f"{self.scratch_limit}-byte storage binding limit; pass fewer tokens per call"
                )
            size = min(size, self.scratch_limit)
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        if buf is not None:  # bind groups of the old buffer go with it
            self._groups = {k: g for k, g in self._groups.items() if id(buf) not in k}
            buf.destroy()
        buf = self.gpu.device.create_buffer(label=f"kvhal-{role}", size=size, usage=usage)
        self._scratch[role] = buf
        return buf

    def upload(self, role: str, arrays: Sequence[np.ndarray]) -> tuple[Any, list[int]]:
        """Write arrays back to back (4-byte elements) into one scratch buffer; their u32 offsets."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total // 4)
            total += a.nbytes
        buf = self.buffer(role, total)
        pos = 0
        for a in arrays:
            if a.nbytes:
                self.gpu.queue.write_buffer(buf, pos, np.ascontiguousarray(a))
            pos += a.nbytes
        return buf, offsets

    def _group(self, layout: Any, pipe: Any, buffers: tuple[Any, ...]) -> Any:
        key = (id(pipe), *map(id, buffers))
        hit = self._groups.get(key)
        if hit is None:
            entries = [{"binding": 0, "resource": {"buffer": self.params, "offset": 0, "size": PARAM_STRIDE}}]
            entries += [
                {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                for i, b in enumerate(buffers, start=1)
            ]
            hit = self._groups[key] = (self.gpu.device.create_bind_group(layout=layout, entries=entries), buffers)
        return hit[0]

    def encode(self, steps: Sequence[Dispatch]) -> Any:
        """A command encoder holding the steps in one compute pass (each its own uniform slot)."""
        if len(steps) > self.slots:
            raise AssertionError(f"internal: {len(steps)} dispatches in one submission, {self.slots} uniform slots")
        max_x = self.gpu.limits["max-compute-workgroups-per-dimension"]
        params = np.zeros((max(len(steps), 1), PARAM_STRIDE // 4), np.uint32)
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
        self.gpu.queue.write_buffer(self.params, 0, params)
        cp = enc.begin_compute_pass()
        for i, (s, (nx, ny)) in enumerate(zip(steps, grids, strict=True)):
            if s.workgroups:
                pipe, layout = self.gpu.pipeline(s.kernel)
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, self._group(layout, pipe, s.buffers), [i * PARAM_STRIDE])
                cp.dispatch_workgroups(nx, ny)
        cp.end()
        return enc

    def submit(self, steps: Sequence[Dispatch]) -> None:
        self.gpu.queue.submit([self.encode(steps).finish()])

    def read(self, steps: Sequence[Dispatch], buf: Any, nbytes: int) -> np.ndarray:
        """Run the steps, then copy the first ``nbytes`` of ``buf`` back to the host."""
        size = -(-nbytes // 4) * 4
        stage = self.buffer("stage", size)
        enc = self.encode(steps)
        enc.copy_buffer_to_buffer(buf, 0, stage, 0, size)
        self.gpu.queue.submit([enc.finish()])
        stage.map_sync(self.gpu.wgpu.MapMode.READ, 0, size)
        try:
            return np.frombuffer(stage.read_mapped(0, size), np.uint8)[:nbytes].copy()
        finally:
            stage.unmap()
