"""The ``[tool.kvhal]`` tables: what each backend needs from the build matrix, read with the stdlib only.

noxfile.py, ci/matrix.py and ci/apt_packages.py import this before anything is installed. A backend
declares itself in ``backends/<name>/pyproject.toml``:

    [tool.kvhal]
    tags = ["cpu"]                  # cpu | gpu | npu: the hardware its sessions need (default ["cpu"])
    apt = ["pocl-opencl-icd"]       # Debian packages its tests need (ci/apt.sh installs them)
    env = {KVHAL_VULKAN_ALLOW_CPU = "1"}
    [tool.kvhal.variants]           # optional: one nox session test-<variant> each (default: test-<name>)
    cuda12 = ["cupy-cuda12x"]       # extra pip requirements, or {requires = [...], env = {...}, tags = [...]}

The root pyproject.toml may carry ``[tool.kvhal] apt = [...]`` for what the core tests need.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKEND_KEYS = {"tags", "apt", "env", "variants"}
VARIANT_KEYS = {"requires", "env", "tags"}
ROOT_KEYS = {"apt"}


class TableError(Exception):
    """A [tool.kvhal] table that does not say what this module reads; the message names the file and key."""


@dataclass(frozen=True)
class Variant:
    """One ``test-<name>`` nox session of a backend."""

    name: str
    backend: str
    dir: str  # the backend's project dir, relative to the root
    tags: tuple[str, ...]
    requires: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def session(self) -> str:
        return f"test-{self.name}"


@dataclass(frozen=True)
class Backend:
    name: str
    dir: str
    tags: tuple[str, ...]
    apt: tuple[str, ...]
    env: dict[str, str]
    variants: tuple[Variant, ...]


def _table(path: Path, allowed: set[str]) -> dict[str, Any]:
    table = tomllib.loads(path.read_text()).get("tool", {}).get("kvhal", {})
    unknown = set(table) - allowed
    if unknown:
        raise TableError(f"{path}: [tool.kvhal] has unknown keys {sorted(unknown)}; known: {sorted(allowed)}")
    return table


def _strings(path: Path, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise TableError(f"{path}: [tool.kvhal] {key} must be a list of strings, got {value!r}")
    return tuple(value)


def _env(path: Path, key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise TableError(f"{path}: [tool.kvhal] {key} must be a table of NAME = value, got {value!r}")
    return {k: str(v) for k, v in value.items()}


def _variant(path: Path, backend: str, rel: str, name: str, spec: Any, tags: tuple[str, ...], env: dict[str, str]) -> Variant:
    key = f"variants.{name}"
    if isinstance(spec, list):
        spec = {"requires": spec}
    if not isinstance(spec, dict) or set(spec) - VARIANT_KEYS:
        raise TableError(f"{path}: [tool.kvhal] {key} must be a list of requirements or a table of {sorted(VARIANT_KEYS)}")
    return Variant(
        name=name,
        backend=backend,
        dir=rel,
        tags=_strings(path, f"{key}.tags", spec["tags"]) if "tags" in spec else tags,
        requires=_strings(path, f"{key}.requires", spec.get("requires", [])),
        env=env | _env(path, f"{key}.env", spec.get("env", {})),
    )


def backend(path: Path, root: Path = ROOT) -> Backend:
    """The table of one ``backends/<name>/pyproject.toml``."""
    table = _table(path, BACKEND_KEYS)
    name, rel = path.parent.name, path.parent.relative_to(root).as_posix()
    tags = _strings(path, "tags", table.get("tags", ["cpu"]))
    env = _env(path, "env", table.get("env", {}))
    variants = table.get("variants") or {name: []}
    if not isinstance(variants, dict):
        raise TableError(f"{path}: [tool.kvhal] variants must be a table")
    return Backend(
        name=name,
        dir=rel,
        tags=tags,
        apt=_strings(path, "apt", table.get("apt", [])),
        env=env,
        variants=tuple(_variant(path, name, rel, v, s, tags, env) for v, s in variants.items()),
    )


def backends(root: Path = ROOT) -> list[Backend]:
    """Every backend of ``root/backends/*/pyproject.toml``, by name."""
    return [backend(pp, root) for pp in sorted(root.glob("backends/*/pyproject.toml"))]


def variants(root: Path = ROOT) -> list[Variant]:
    return [v for b in backends(root) for v in b.variants]


def root_apt(root: Path = ROOT) -> tuple[str, ...]:
    """The Debian packages the core tests need (the root pyproject.toml's ``[tool.kvhal] apt``)."""
    path = root / "pyproject.toml"
    return _strings(path, "apt", _table(path, ROOT_KEYS).get("apt", []))


def apt_packages(root: Path = ROOT) -> list[str]:
    """The union of the root's and every backend's apt list, sorted."""
    return sorted({*root_apt(root), *(p for b in backends(root) for p in b.apt)})
