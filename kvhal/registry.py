"""Backend discovery: the built-in reference plus entry points in the group ``kvhal.backends``.

Loading an entry point imports only the backend's small module; vendor SDKs are imported when a
backend is instantiated (or, at most, checked for with ``importlib.util.find_spec`` in ``probe``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

from .backend import Backend, Op, Probe
from .errors import BackendUnavailableError, KVHalError, UnsupportedError
from .reference import ReferenceBackend

GROUP = "kvhal.backends"


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    score: int | None
    reason: str
    device: str
    cls: type[Backend] | None

    def supports(self, fmt: str, op: Op) -> bool:
        return self.cls is not None and self.cls.supports(fmt, op)


@lru_cache(maxsize=1)
def _classes() -> dict[str, type[Backend] | str]:
    """name -> backend class, or the reason its module failed to import."""
    found: dict[str, type[Backend] | str] = {"reference": ReferenceBackend}
    for ep in entry_points(group=GROUP):
        if ep.name in found:
            continue
        try:
            found[ep.name] = ep.load()
        except Exception as e:  # a broken plugin must not break kvhal; info shows why
            found[ep.name] = f"its module failed to import: {type(e).__name__}: {e}"
    return found


def _info(name: str, entry: type[Backend] | str) -> BackendInfo:
    if isinstance(entry, str):
        return BackendInfo(name, False, None, entry, "", None)
    try:
        probe: Probe | None = entry.probe()
    except Exception as e:
        return BackendInfo(name, False, None, f"probe failed: {type(e).__name__}: {e}", "", entry)
    if probe is None:
        return BackendInfo(name, False, None, entry.unavailable_reason(), "", entry)
    return BackendInfo(name, True, probe.score, probe.reason, probe.device, entry)


def backends() -> list[BackendInfo]:
    """Every known backend with its probe result, best first (available ones before the rest)."""
    infos = [_info(n, e) for n, e in _classes().items()]
    return sorted(infos, key=lambda i: (not i.available, -(i.score or 0), i.name))


def _capable(formats: list[str]) -> list[str]:
    return [
        i.name
        for i in backends()
        if i.available and all(i.supports(f, op) for f in formats for op in ("store", "load", "attention"))
    ]


def resolve(name: str, formats: list[str], allow_fallback: bool = False) -> type[Backend]:
    """The backend class to use: ``name`` or "auto" (``KVHAL_BACKEND`` overrides "auto")."""
    requested = os.environ.get("KVHAL_BACKEND") if name == "auto" else name
    infos = {i.name: i for i in backends()}
    if requested and requested != "auto":
        info = infos.get(requested)
        if info is None:
            raise BackendUnavailableError(
                f"no backend named {requested!r}; installed: {', '.join(infos)} "
                f"(install kvhal-{requested} or check KVHAL_BACKEND)"
            )
        if not info.available or info.cls is None:
            raise BackendUnavailableError(f"backend {requested!r} is unavailable: {info.reason}")
        missing = [f for f in formats if not all(info.supports(f, op) for op in ("store", "load", "attention"))]
        if not missing:
            return info.cls
        capable = _capable(formats)
        if not allow_fallback or not capable:
            raise UnsupportedError(
                f"backend {requested!r} cannot run format(s) {', '.join(missing)}; "
                f"backends that can: {', '.join(capable) or 'none'} "
                "(pick one of them, or pass allow_fallback=True to use the best of them)"
            )
        warnings.warn(f"kvhal: {requested!r} cannot run {missing}; falling back to {capable[0]!r}", stacklevel=3)
        return infos[capable[0]].cls  # type: ignore[return-value]
    capable = _capable(formats)
    if not capable:
        raise UnsupportedError(f"no available backend runs format(s) {', '.join(formats)}")
    best = infos[capable[0]]
    if best.cls is None:  # pragma: no cover - _capable only lists loaded classes
        raise KVHalError("internal: capable backend without class")
    return best.cls
