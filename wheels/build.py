"""Build every wheel of wheels/variants.toml into dist/, or check the built ones in fresh venvs.

    python wheels/build.py [--strict] [NAME ...]        # build (all rows, or the named ones)
    python wheels/build.py --smoke [--with-deps] [NAME ...]   # install each in a fresh venv, run `kvhal info`

Needs pip, hatchling, setuptools, wheel>=0.40 and tomli-w in the running interpreter (`nox -s wheels`
installs them). A row whose source dir is not in this checkout (a partial clone)
or whose compiled artifacts are missing is skipped with one line; ``--strict`` makes either an error.
``--smoke`` installs each wheel with ``--no-deps`` plus numpy (so a CPU machine can check GPU wheels:
their SDK is imported lazily and `kvhal info` says why the backend is unavailable); ``--with-deps``
installs the real dependencies instead, for hardware runners.
"""

from __future__ import annotations

import argparse
import email.parser
import fnmatch
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "wheels" / "variants.toml"
DIST = ROOT / "dist"
IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".nox", "*.pyc")


@dataclass
class Variant:
    name: str
    source: str
    platform: str = "any"
    dependencies: list[str] | None = None
    extras: dict[str, list[str]] | None = None
    entry_points: dict[str, str] | None = None
    artifacts: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    compile: str = ""
    backends: list[str] = field(default_factory=list)
    smoke: str = ""  # python run in the fresh venv after kvhal info

    @property
    def src(self) -> Path:
        return ROOT / self.source

    @property
    def norm(self) -> str:
        return self.name.replace("-", "_")


def load_table(path: Path = TABLE) -> list[Variant]:
    rows = tomllib.loads(path.read_text())["variant"]
    out = [Variant(**row) for row in rows]
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: duplicate variant names")
    return out


class Skip(Exception):
    pass


def check_source(v: Variant) -> None:
    if not (v.src / "pyproject.toml").is_file():
        raise Skip(f"{v.source}/pyproject.toml is not in this checkout")
    for pattern in v.artifacts:
        if not list(v.src.glob(pattern)):
            raise Skip(f"no {v.source}/{pattern}: run `nox -s {v.compile}` first")


def stage(v: Variant, tmp: Path) -> Path:
    """The source as this variant builds it: in place, or a copy with its pyproject rewritten."""
    meta = tomllib.loads((v.src / "pyproject.toml").read_text())
    project = meta["project"]
    if project["name"] == v.name and v.dependencies is None and v.entry_points is None and not v.exclude:
        return v.src
    import tomli_w  # noqa: PLC0415  (build-time only)

    dst = tmp / "src"
    shutil.copytree(v.src, dst, ignore=IGNORE)
    for rel in v.exclude:
        shutil.rmtree(dst / rel, ignore_errors=True)
    project["name"] = v.name
    if v.dependencies is not None:
        project["dependencies"] = v.dependencies
    if v.extras is not None:
        project["optional-dependencies"] = v.extras
    if v.entry_points is not None:
        project.setdefault("entry-points", {})["kvhal.backends"] = v.entry_points
    meta.get("tool", {}).pop("kvhal", None)  # the build matrix's table, not part of the wheel
    (dst / "pyproject.toml").write_text(tomli_w.dumps(meta))
    return dst


def run(cmd: list[str], **kw: Any) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout


def retag(whl: Path, platform: str) -> Path:
    if platform == "build" or whl.name.endswith(f"-{platform}.whl"):
        return whl
    tag = "any" if platform == "any" else platform
    out = run([sys.executable, "-m", "wheel", "tags", "--platform-tag", tag, "--remove", str(whl)])
    return whl.parent / out.strip().splitlines()[-1]


def verify(v: Variant, whl: Path, staged: Path) -> int:
    """Metadata, entry points and compiled artifacts in the built wheel; returns the artifact count."""
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(info).decode())
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode() if any(
            n.endswith("entry_points.txt") for n in names) else ""  # fmt: skip
    if msg["Name"] != v.name:
        raise RuntimeError(f"{whl.name}: METADATA Name is {msg['Name']}, expected {v.name}")
    if v.dependencies is not None:
        reqs = [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r]
        if sorted(r.replace(" ", "") for r in reqs) != sorted(d.replace(" ", "") for d in v.dependencies):
            raise RuntimeError(f"{whl.name}: Requires-Dist {reqs} != table {v.dependencies}")
    for b in v.backends:
        if b != "reference" and f"{b} =" not in eps:
            raise RuntimeError(f"{whl.name}: no kvhal.backends entry point {b!r}")
    n = 0
    for pattern in v.artifacts:
        want = [p.relative_to(staged).as_posix() for p in staged.glob(pattern)]
        missing = [w for w in want if w not in names]
        if missing or not want:
            raise RuntimeError(f"{whl.name}: lacks compiled artifacts {missing or pattern}")
        n += len(want)
    for rel in v.exclude:
        if any(fnmatch.fnmatch(x, rel + "/*") for x in names):
            raise RuntimeError(f"{whl.name}: carries {rel}, which belongs to another variant")
    return n


def build(v: Variant) -> Path:
    check_source(v)
    with tempfile.TemporaryDirectory(prefix=f"kvhal-wheel-{v.name}-") as t:
        tmp = Path(t)
        staged = stage(v, tmp)
        out = tmp / "out"
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        run([*pip_wheel, "-w", str(out), str(staged)])
        (whl,) = out.glob(f"{v.norm}-*.whl")
        whl = retag(whl, v.platform)
        n = verify(v, whl, staged)
        DIST.mkdir(exist_ok=True)
        for old in DIST.glob(f"{v.norm}-*.whl"):
            old.unlink()
        final = DIST / whl.name
        shutil.move(str(whl), final)
    size = final.stat().st_size / 1024
    print(f"{v.name}: {final.name} ({size:.0f} KiB" + (f", {n} compiled artifacts)" if n else ")"))
    return final


def smoke(v: Variant, with_deps: bool) -> None:
    """A fresh venv, the wheel (and kvhal's), then `kvhal info --json` from that venv."""
    wheels = sorted(DIST.glob(f"{v.norm}-*.whl"))
    if not wheels:
        raise Skip("not built")
    core = sorted(DIST.glob("kvhal-*.whl"))
    if not core:
        raise RuntimeError("dist/ has no kvhal core wheel to install beside it")
    with tempfile.TemporaryDirectory(prefix=f"kvhal-smoke-{v.name}-") as t:
        venv = Path(t) / "venv"
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)])  # this pip installs into it: faster
        py = venv / ("Scripts" if sys.platform == "win32" else "bin") / "python"
        pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--disable-pip-version-check"]
        targets = sorted({str(core[-1]), str(wheels[-1])})
        if with_deps:
            run([*pip, "--find-links", str(DIST), *targets])
        else:
            run([*pip, "--no-deps", *targets])
            run([*pip, "numpy>=1.24"])  # kvhal's one dependency
        kvhal = py.parent / "kvhal"
        data = json.loads(run([str(kvhal), "info", "--json"], cwd=t))
        extra = run([str(py), "-c", v.smoke], cwd=t).strip() if v.smoke else ""
    listed = {b["name"]: b for b in data["backends"]}
    for b in v.backends:
        if b not in listed:
            raise RuntimeError(f"kvhal info in a fresh venv does not list {b!r} (got {sorted(listed)})")
        reason = listed[b]["reason"]
        if reason.startswith(("its module failed to import", "probe failed")):
            raise RuntimeError(f"{b}: {reason}")
        state = "available" if listed[b]["available"] else "unavailable"
        print(f"{v.name}: fresh venv, kvhal info: {b} {state}: {reason}")
    if extra:
        print(f"{v.name}: fresh venv: {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="variant names (default: every row)")
    ap.add_argument("--strict", action="store_true", help="a missing source dir or artifact is an error")
    ap.add_argument("--smoke", action="store_true", help="install each built wheel in a fresh venv, run kvhal info")
    ap.add_argument("--with-deps", action="store_true", help="--smoke with the wheels' real dependencies")
    args = ap.parse_args(argv)
    table = load_table()
    unknown = set(args.names) - {v.name for v in table}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; the table has {[v.name for v in table]}")
    rows = [v for v in table if not args.names or v.name in args.names]
    done, skipped, failed = 0, 0, 0
    for v in rows:
        try:
            smoke(v, args.with_deps) if args.smoke else build(v)
            done += 1
        except Skip as e:
            skipped += 1
            print(f"{v.name}: {'ERROR' if args.strict else 'skipped'}, {e}")
            failed += args.strict
        except RuntimeError as e:
            failed += 1
            print(f"{v.name}: FAILED\n{e}", file=sys.stderr)
    what = "checked" if args.smoke else "built"
    print(f"wheels: {done} {what}, {skipped} skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
