"""pytest plugin: registers ``cuda-emu`` (kvhal.cu on the CPU emulator) so tests/contract can run it.

KVHAL_TEST_BACKENDS=cuda-emu PYTHONPATH=.:backends/cuda/tests pytest -p cuda_emu_plugin tests/contract
"""

from __future__ import annotations

from cuda_emulator import EmulatedCudaBackend

from kvhal import registry

registry._classes()[EmulatedCudaBackend.name] = EmulatedCudaBackend  # the cached entry-point table
