"""Build matrix. Sessions: test-<backend> (one per backends/*/, generated), test-reference, lint, bench.

A backend declares itself in ``backends/<name>/pyproject.toml`` under ``[tool.kvhal]``:

    tags = ["cpu"]                  # cpu | gpu | npu: the hardware its session needs
    apt = ["pocl-opencl-icd"]       # Debian packages .ci/run installs before the session
    env = {KVHAL_VULKAN_ALLOW_CPU = "1"}
    [tool.kvhal.variants]           # optional: one session per variant, extra pip requirements
    cuda12 = ["cupy-cuda12x"]       # or a table: {requires = [...], env = {...}, tags = [...]}

A session whose backend is unavailable here skips with one line naming the probe's reason;
``nox -s test-<name> -- --strict`` (or ``KVHAL_STRICT=1``) makes that a failure.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "test-reference"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch would pull a multi-GB CUDA build


def strict(session: nox.Session) -> bool:
    return "--strict" in session.posargs or os.environ.get("KVHAL_STRICT") == "1"


def pytest_args(session: nox.Session) -> list[str]:
    return [a for a in session.posargs if a != "--strict"]


def backend_table() -> dict[str, dict]:
    """name -> its [tool.kvhal] table (plus "dir"), for every backends/<name>/pyproject.toml."""
    out = {}
    for pp in sorted(ROOT.glob("backends/*/pyproject.toml")):
        table = tomllib.loads(pp.read_text()).get("tool", {}).get("kvhal", {})
        out[pp.parent.name] = {**table, "dir": pp.parent.relative_to(ROOT).as_posix()}
    return out


@nox.session(name="test-reference", tags=["cpu"])
def test_reference(session: nox.Session) -> None:
    """Unit tests, the stateful property test and the contract suite on the numpy reference."""
    session.install("-e", ".[test,bench]", TORCH)  # torch: DLPack interop tests
    session.run("pytest", "tests/unit", "tests/contract", *pytest_args(session),
                env={"KVHAL_TEST_BACKENDS": "reference"})


def _make_backend_session(session_name: str, backend: str, table: dict, variant: list[str] | dict) -> None:
    spec = variant if isinstance(variant, dict) else {"requires": variant}
    tags = list(spec.get("tags", table.get("tags", ["cpu"])))
    env = {k: str(v) for k, v in (table.get("env", {}) | spec.get("env", {})).items()}

    @nox.session(name=session_name, tags=tags)
    def _session(session: nox.Session) -> None:
        session.install("-e", ".[test,bench]", "-e", table["dir"], *spec.get("requires", []))
        # the probe runs in the session's venv: a backend absent here skips with its reason
        probe = session.run(
            "python", "-c",
            "import kvhal,sys; i={b.name: b for b in kvhal.backends()}.get(sys.argv[1]); "
            "print('ok' if i and i.available else (i.reason if i else 'not registered'))",
            backend, silent=True, env=env,
        ).strip().splitlines()[-1]
        if probe != "ok":
            msg = f"{session_name}: backend {backend} unavailable here: {probe}"
            if strict(session):
                session.error(msg + " (--strict)")
            session.skip(msg)
        tests = [p for p in (f"{table['dir']}/tests", f"tests/{backend}") if (ROOT / p).is_dir()]
        session.run("pytest", "tests/contract", *tests, *pytest_args(session),
                    env={**env, "KVHAL_TEST_BACKENDS": backend, "KVHAL_STRICT": "1"})

    _session.__doc__ = f"tests/contract on the {backend} backend ({table['dir']})"


for _name, _table in backend_table().items():
    variants = _table.get("variants") or {_name: []}
    for _variant, _spec in variants.items():
        _make_backend_session(f"test-{_variant}", _name, _table, _spec)


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff on everything, mypy --strict on kvhal/."""
    session.install("-e", ".[lint,test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "kvhal")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """kvhal bench on the host backends with PyTorch SDPA as the baseline (docs/benchmarks.md).

    Default: the cpu backend's decode figures of issue 5; pass your own arguments after ``--``.
    """
    host = [t["dir"] for t in backend_table().values() if "cpu" in t.get("tags", ["cpu"])]
    session.install("-e", ".[bench]", TORCH, *[a for d in host for a in ("-e", d)])
    default = ["--backend", "cpu", "--format", "q8_0", "--format", "q4_0", "--repeats", "7", "-o", "bench.json"]
    session.run("kvhal", "bench", *(session.posargs or default))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run with nox: nox -l")
