"""The build matrix: [tool.kvhal] tables read once (ci/kvhal_tables.py), rows and apt lists derived from them."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import kvhal_tables  # noqa: E402
import matrix  # noqa: E402


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_every_backend_dir_is_read():
    dirs = sorted(p.parent.name for p in (ROOT / "backends").glob("*/pyproject.toml"))
    assert [b.name for b in kvhal_tables.backends()] == dirs


def test_variant_forms_and_inheritance(tmp_path):
    write(tmp_path, "pyproject.toml", '[tool.kvhal]\napt = ["redis-server"]\n')
    write(tmp_path, "backends/plain/pyproject.toml", '[tool.kvhal]\napt = ["gcc"]\nenv = {A = 1}\n')
    write(tmp_path, "backends/gpu/pyproject.toml", """
[tool.kvhal]
tags = ["gpu"]
apt = ["hipcc", "gcc"]
env = {A = "x", B = "y"}
[tool.kvhal.variants]
gpu-a = ["pkg-a"]
gpu-cpu = {requires = ["pkg-b"], env = {B = "z"}, tags = ["cpu"]}
""")  # fmt: skip
    plain, gpu = sorted(kvhal_tables.backends(tmp_path), key=lambda b: b.name != "plain")
    (only,) = plain.variants
    assert (only.session, only.tags, only.requires, only.env, only.dir) == (
        "test-plain", ("cpu",), (), {"A": "1"}, "backends/plain")  # fmt: skip
    a, b = gpu.variants
    assert (a.session, a.tags, a.requires, a.env) == ("test-gpu-a", ("gpu",), ("pkg-a",), {"A": "x", "B": "y"})
    assert (b.session, b.tags, b.requires, b.env) == ("test-gpu-cpu", ("cpu",), ("pkg-b",), {"A": "x", "B": "z"})
    assert kvhal_tables.apt_packages(tmp_path) == ["gcc", "hipcc", "redis-server"]
    core = [r.session for r in matrix.CORE_CPU]
    assert [r.session for r in matrix.cpu_rows(tmp_path)][: len(core) + 2] == [*core, "test-gpu-cpu", "test-plain"]
    with pytest.raises(SystemExit, match=r"\['test-gpu-a'\] need hardware"):
        matrix.hardware_rows(tmp_path)


@pytest.mark.parametrize(
    "table, message",
    [
        ('tag = ["cpu"]', r"unknown keys \['tag'\]"),
        ('apt = "gcc"', "apt must be a list of strings"),
        ("env = 3", "env must be a table"),
        ('[tool.kvhal.variants]\nx = {require = ["a"]}', "variants.x must be a list of requirements or a table"),
    ],
)
def test_a_mistyped_table_names_its_file_and_key(tmp_path, table, message):
    write(tmp_path, "backends/bad/pyproject.toml", f"[tool.kvhal]\n{table}\n")
    with pytest.raises(kvhal_tables.TableError, match=message) as e:
        kvhal_tables.backends(tmp_path)
    assert "backends/bad/pyproject.toml" in str(e.value)


def test_root_apt_list_holds_what_the_core_tests_start():
    assert "redis-server" in kvhal_tables.root_apt()


def test_apt_packages_script_prints_the_union():
    out = subprocess.run([sys.executable, "ci/apt_packages.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    want = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["kvhal"]["apt"])
    for pp in (ROOT / "backends").glob("*/pyproject.toml"):
        want |= set(tomllib.loads(pp.read_text()).get("tool", {}).get("kvhal", {}).get("apt", []))
    assert out.stdout.split() == sorted(want)


def test_cpu_rows_are_the_cpu_tagged_variants_and_the_fixed_sessions():
    sessions = [r.session for r in matrix.cpu_rows()]
    variants = [v.session for v in kvhal_tables.variants() if "cpu" in v.tags]
    core = [r.session for r in matrix.CORE_CPU]
    assert core == ["lint", "test-reference", "test-transformers", "test-llamacpp", "test-vllm"]
    assert sessions == [*core, *variants, *[r.session for r in matrix.FIXED_CPU]]
    assert "test-cuda13" not in sessions  # gpu-only: a hardware row
    out = subprocess.run([sys.executable, "ci/matrix.py", "--cpu"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == sessions


def test_workflow_is_generated_from_the_matrix():
    p = subprocess.run([sys.executable, "ci/matrix.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_every_matrix_row_is_a_nox_session():
    p = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=ROOT, capture_output=True, text=True, check=True)
    listed = set(re.findall(r"^[*-] (\S+)", p.stdout, re.M))
    rows = {r.session for r in [*matrix.cpu_rows(), *matrix.hardware_rows()]}
    assert rows - listed == set()
