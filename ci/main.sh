#!/usr/bin/env bash
# The main job (README.md): install kvhal and every backend this machine can run into .venv, show them
# (`kvhal info`), then benchmark the default backend against PyTorch SDPA (`kvhal bench`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/apt.sh
python3 -m venv .venv
# the host backends; cuda/rocm need a GPU (see `nox -s test-cuda13`), torch 2.13.0 is the CPU build
.venv/bin/pip install -q -e . torch==2.13.0 \
  -e backends/cpu -e backends/opencl -e backends/openvino -e backends/arm -e backends/ascend -e backends/vulkan
# without an NPU or a hardware Vulkan GPU, run those backends' code on the CPU (torch CPU device, lavapipe)
export KVHAL_ASCEND_DEVICE=${KVHAL_ASCEND_DEVICE:-cpu} KVHAL_VULKAN_ALLOW_CPU=${KVHAL_VULKAN_ALLOW_CPU:-1}
.venv/bin/kvhal info
.venv/bin/kvhal bench --backend auto --format q8_0 --format q4_0 --format f16 "$@"
