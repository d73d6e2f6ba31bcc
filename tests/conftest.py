"""Shared fixtures: which backends the contract suite runs on.

``KVHAL_TEST_BACKENDS=opencl`` (comma list) limits the run to those backends; a named backend that
is unavailable skips with its probe reason, or fails when ``KVHAL_STRICT=1``.
"""

from __future__ import annotations

import os

import pytest

import kvhal


def _selected() -> list[str]:
    wanted = os.environ.get("KVHAL_TEST_BACKENDS", "").strip()
    infos = {i.name: i for i in kvhal.backends()}
    if not wanted:
        return [n for n, i in infos.items() if i.available]
    return [w.strip() for w in wanted.split(",") if w.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", _selected(), scope="session")


@pytest.fixture(scope="session")
def backend_info(backend_name: str) -> kvhal.BackendInfo:
    infos = {i.name: i for i in kvhal.backends()}
    info = infos.get(backend_name)
    if info is None or not info.available:
        reason = info.reason if info else "not installed"
        msg = f"backend {backend_name} unavailable: {reason}"
        if os.environ.get("KVHAL_STRICT") == "1":
            pytest.fail(msg + " (KVHAL_STRICT=1)")
        pytest.skip(msg)
    return info
