"""kvhal's Vulkan backend: WGSL compute shaders on any Vulkan device through wgpu (wgpu-native).

WGSL has no 8-bit types, so the shaders read and write the ggml blocks as ``u32`` words; every bit
that lands in a pool is computed in integer arithmetic (kernels/common.wgsl), which keeps the pools
byte-identical to kvhal/formats/ggml.py on any driver. A pool larger than one storage binding
(``maxStorageBufferBindingSize``, 128 MiB on lavapipe) is split into chunks of whole pages, one
buffer and one binding each; the shaders pick the chunk per page.

Modules: ``adapter`` (adapter choice, probe, the shared device), ``shaders`` (WGSL templating),
``buffers`` (pools and each cache's command context), ``backend`` (the kvhal Backend).
"""

from .adapter import select_adapter
from .backend import VulkanBackend
from .buffers import VulkanPool

__all__ = ["VulkanBackend", "VulkanPool", "select_adapter"]
