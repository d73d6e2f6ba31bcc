#!/usr/bin/env bash
# The GPU check in one command, for a bare machine with an NVIDIA GPU (x86-64, python3 >= 3.10, pip to PyPI):
#   1. reads the driver's CUDA major from nvidia-smi and picks the matching cupy (cupy-cuda12x / cupy-cuda13x,
#      the cuda12 / cuda13 variants of backends/cuda/pyproject.toml) plus the CUDA runtime and NVRTC wheels;
#   2. installs kvhal and the cuda backend into a venv (.gpu-check/venv); where the machine's python3 already
#      has a working cupy for that CUDA major (an image with CUDA's Python stack, often offline), kvhal and the
#      backend are installed next to it instead (pip --target .gpu-check/site, no dependencies fetched);
#   3. runs what `nox -s test-cuda13 -- --strict` (or test-cuda12) runs, in that venv: the contract suite and
#      backends/cuda/tests on the GPU, KVHAL_STRICT=1;
#   4. runs `kvhal bench --backend cuda`: decode 4k..128k, prefill 512 queries over 4k and 16k, load, every
#      format (one process each, so a format that fails leaves the others' figures; the target formats q8_0,
#      fp8_e4m3 and q4_0 first), as fractions of the HBM read bandwidth measured in the same run, with torch SDPA
#      ratios where torch has CUDA;
#   5. prints one summary block (also written to $OUT/summary.txt), with the performance targets: prefill at 16k
#      against torch SDPA bf16 on the same K/V, decode at 32k as a fraction of the HBM read bandwidth, for
#      q8_0, fp8_e4m3 and q4_0.
#
# Prefill runs through torch SDPA (the cuda backend's default prefill="sdpa", kvhal-cuda[torch]): install adds
# torch with CUDA; where torch cannot be installed or sees no GPU, tests and bench run prefill="kernel" (kvhal.cu's
# own prefill kernel) and the summary says so.
#
#   bash ci/gpu-check.sh                 # outputs under $OUT, default .gpu-check/out
#
# GPU_CHECK_BUDGET (seconds, default 450) bounds the whole run: each step gets what is left, so the summary
# always prints. GPU_CHECK_CONTEXTS (default 4096,8192,16384,32768,65536,131072) sets the decode contexts. pip honours PIP_INDEX_URL / PIP_FIND_LINKS / PIP_NO_INDEX for a machine without PyPI (the
# build needs hatchling and its requirements from there).
# Exit status: 0 every step passed; 1 a step failed or timed out; 3 no usable NVIDIA GPU or Python (one line).
set -uo pipefail

fail() { echo "gpu-check: $1" >&2; exit 3; }
# builtins only up to here: this line must come out even where PATH has next to nothing
command -v nvidia-smi >/dev/null 2>&1 || fail "no NVIDIA GPU (nvidia-smi not found)"
smi=$(nvidia-smi 2>&1) || fail "no NVIDIA GPU (nvidia-smi failed: ${smi%%$'\n'*})"
[[ $smi =~ CUDA\ Version:\ *([0-9]+)\.([0-9]+) ]] || fail "nvidia-smi reports no CUDA version (driver too old?)"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
driver_cuda=$major.$minor
case $major in
  12 | 13) cuda=$major ;;
  1[4-9] | [2-9][0-9]) cuda=13 ;;  # newer drivers run CUDA 13 builds
  *) fail "the driver supports CUDA $driver_cuda; kvhal's cuda backend needs a CUDA 12 or 13 driver" ;;
esac
# CUDA runtime and NVRTC wheels no newer than the driver: NVRTC output a driver is too old for does not load
if [ "$major" = "$cuda" ]; then toolkit="cuda-toolkit[cudart,nvrtc]>=$cuda.0,<$cuda.$((minor + 1))"
else toolkit="cuda-toolkit[cudart,nvrtc]==$cuda.*"; fi
command -v python3 >/dev/null 2>&1 || fail "python3 not found"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "python3 is older than 3.10"

here=${BASH_SOURCE[0]%/*}
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.." || fail "cannot cd to the repository root"
root=$PWD
OUT=${OUT:-$root/.gpu-check/out}
mkdir -p "$OUT"
venv=$root/.gpu-check/venv
py=$venv/bin/python
budget=${GPU_CHECK_BUDGET:-450}
contexts=${GPU_CHECK_CONTEXTS:-4096,8192,16384,32768,65536,131072}
site=$root/.gpu-check/site
# an image that already has cupy for this CUDA major: use that python3 and its packages (torch too, for SDPA)
if python3 -c 'import sys, cupy; sys.exit(cupy.cuda.runtime.runtimeGetVersion() // 1000 != int(sys.argv[1]))' \
  "$cuda" >/dev/null 2>&1; then
  python=system py=python3
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
else
  python=venv
fi
printf '%s\n' "$smi" >"$OUT/nvidia-smi.txt"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1)

export py venv site python root cuda toolkit contexts OUT
declare -A status seconds
left() { local l=$((budget - SECONDS)); echo $((l > 10 ? l : 10)); }
# step NAME: run the function NAME with what is left of the budget, output in $OUT/NAME.log;
# record ok / failed / timed out and its seconds
step() {
  local name=$1 t0=$SECONDS rc
  echo "gpu-check: $name ..." >&2
  timeout "$(left)" bash -o pipefail -c "$name" >"$OUT/$name.log" 2>&1
  rc=$?
  seconds[$name]=$((SECONDS - t0))
  case $rc in
    0) status[$name]=ok ;;
    124) status[$name]="timed out" ;;
    *) status[$name]="failed (exit $rc)" ;;
  esac
  return $rc
}

install() {
  # where nvcc 13 is on the machine, the cubins the kvhal-cuda13 wheel ships (build_kernels.py, as
  # nox -s compile-cuda13; --reuse keeps ones already built from this kvhal.cu); else NVRTC compiles at first use
  if [ "$cuda" = 13 ] && command -v nvcc >/dev/null 2>&1; then
    PYTHONPATH=$root python3 backends/cuda/build_kernels.py cuda13 --reuse ||
      echo "no prebuilt cubins (build_kernels.py failed); kvhal.cu is compiled by NVRTC at first use"
  fi
  if [ "$python" = system ]; then
    # kvhal and the backend only, built from this tree; what they need comes from the image
    rm -rf "$site"
    python3 -m pip install -q --disable-pip-version-check --no-deps --target "$site" . backends/cuda || return 1
    python3 -c 'import numpy, pytest, cupy, kvhal_cuda; print("system python3: cupy", cupy.__version__)' &&
      prefill_route python3
    return
  fi
  if [ ! -x "$py" ]; then
    python3 -m venv "$venv" || {
      # Debian without python3-venv: virtualenv from PyPI into a private directory
      python3 -m pip install -q --target "$root/.gpu-check/virtualenv" virtualenv &&
        PYTHONPATH="$root/.gpu-check/virtualenv" python3 -m virtualenv -q "$venv"
    } || return 1
  fi
  local pip=("$py" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip || echo "pip could not upgrade itself; going on with $("$py" -m pip --version)"
  # cupy compiles its own kernels with NVRTC and the backend compiles kvhal.cu when no prebuilt cubin fits:
  # the CUDA runtime and NVRTC come as wheels for the driver's CUDA major (no toolkit on the machine)
  "${pip[@]}" -e ".[test,bench]" -e "backends/cuda[cuda$cuda]" "$toolkit" || return 1
  local smoke='import cupy as cp; x = cp.arange(1 << 20, dtype=cp.float32); assert float((x * 2).sum()) > 0'
  if ! "$py" -c "$smoke"; then
    echo "cupy with the runtime and NVRTC wheels alone failed; installing cupy-cuda${cuda}x[ctk] (every CUDA wheel)"
    "${pip[@]}" "cupy-cuda${cuda}x[ctk]" "$toolkit" && "$py" -c "$smoke" || return 1
  fi
  # the SDPA prefill route's torch (PyPI's Linux torch is a CUDA build); without it prefill="kernel" runs
  "${pip[@]}" -e "backends/cuda[torch]" || echo "torch could not be installed"
  prefill_route "$py"
}

# $OUT/prefill-route: sdpa where PYTHON has torch with a CUDA device, else kernel (KVHAL_CUDA_PREFILL for the rest)
prefill_route() {
  if "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo sdpa >"$OUT/prefill-route"
  else
    echo "no torch with CUDA: prefill runs kvhal.cu's own kernel (prefill=kernel)"
    echo kernel >"$OUT/prefill-route"
  fi
}

route() { cat "$OUT/prefill-route" 2>/dev/null || echo kernel; }

tests() {
  export KVHAL_CUDA_PREFILL=$(route)
  # the test-cuda$cuda session's command (noxfile.py), in this venv
  # (test_cuda_emulated runs kvhal.cu on the CPU emulator: test-cuda-host's job, not the GPU's)
  KVHAL_TEST_BACKENDS=cuda KVHAL_STRICT=1 "$py" -m pytest -q -p no:cacheprovider tests/contract backends/cuda/tests \
    --ignore=backends/cuda/tests/test_cuda_emulated.py --junitxml="$OUT/contract.xml"
}

bench() {
  # one process per format: a kernel that faults the CUDA context costs that format's figures only.
  # SDPA (where torch has CUDA) runs in the first process; the summary's merge gives every row its ratios.
  local parts=$root/.gpu-check/bench rc=0 sdpa=() fmt
  export KVHAL_CUDA_PREFILL=$(route)
  rm -rf "$parts" && mkdir -p "$parts"
  "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null || sdpa=(--no-sdpa)
  for fmt in $("$py" -c 'import kvhal, kvhal.tools.bench as b
cuda = {i.name: i for i in kvhal.backends()}["cuda"]
first = ["q8_0", "fp8_e4m3", "q4_0"]  # the targets, before the budget runs out
names = first + [f for f in kvhal.formats.names() if f not in first]
print(" ".join(b.job_format("cuda", f) for f in names if f in cuda.formats))'); do
    echo "== $fmt"
    "$py" -m kvhal bench --backend cuda --format "$fmt" --contexts "$contexts" \
      --prefill-contexts 4096,16384 --repeats 5 "${sdpa[@]}" --json -o "$parts/${fmt//\//_}.json" >/dev/null || rc=1
    sdpa=(--no-sdpa)
  done
  python3 "$root/ci/gpu_check_summary.py" --merge "$parts" -o "$OUT/bench-cuda.json" && return $rc
}

export -f install prefill_route route tests bench
rm -f "$OUT/prefill-route"
step install && {
  step tests
  step bench
}

summary_args=(--gpu "$gpu" --driver-cuda "$driver_cuda" --cuda "$cuda" --python "$python" --out "$OUT" --budget "$budget"
  --prefill-route "$(cat "$OUT/prefill-route" 2>/dev/null || echo unknown)")
for s in install tests bench; do
  summary_args+=(--step "$s=${status[$s]:-not run}=${seconds[$s]:-0}")
done
python3 ci/gpu_check_summary.py "${summary_args[@]}" | tee "$OUT/summary.txt"
for s in install tests bench; do
  [ "${status[$s]:-}" = ok ] || exit 1
done
exit 0
