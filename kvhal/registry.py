"""Backend discovery and choice: the built-in reference plus entry points in the group ``kvhal.backends``.

Loading an entry point imports only the backend's small module; vendor SDKs are imported when a
backend is instantiated (``probe`` at most checks for them with ``importlib.util.find_spec``).
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

from .backend import OPS, Backend, Probe
from .errors import BackendUnavailableError, KVHalError, SpecError, UnsupportedError
from .reference import ReferenceBackend
from .spec import CacheSpec

GROUP = "kvhal.backends"


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    score: int | None
    reason: str
    device: str
    cls: type[Backend] | None
    misconfigured: bool = False  # Probe.misconfigured

    @property
    def formats(self) -> frozenset[str]:
        """The formats it claims (every op); ``refusal`` adds the device limits for a given spec."""
        return self.cls.formats if self.cls is not None else frozenset()

    def refusal(self, spec: CacheSpec) -> str | None:
        """None when this backend would take ``spec`` for every op, else why not (probe reason included)."""
        if not isinstance(spec, CacheSpec):
            raise SpecError(f"spec must be a kvhal.CacheSpec, got {type(spec).__name__}")
        if not self.available or self.cls is None:
            return f"unavailable: {self.reason}"
        try:
            backend = instance(self.name)
        except KVHalError as e:
            return f"failed to start: {e}"
        return refusal(backend, spec)


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
        probe: Probe = entry.probe()
    except Exception as e:
        return BackendInfo(name, False, None, f"probe failed: {type(e).__name__}: {e}", "", entry)
    return BackendInfo(name, probe.available, probe.score, probe.reason, probe.device, entry, probe.misconfigured)


def backends() -> list[BackendInfo]:
    """Every known backend with its probe result, best first (available ones before the rest)."""
    infos = [_info(n, e) for n, e in _classes().items()]
    return sorted(infos, key=lambda i: (not i.available, -(i.score or 0), i.name))


_instances: dict[str, Backend] = {}
_instances_lock = threading.Lock()


def instance(name: str, options: dict[str, Any] | None = None) -> Backend:
    """A backend instance. Without options, one shared instance per name (a backend serves any number
    of caches); with options, a new one."""
    entry = _classes().get(name)
    if entry is None:
        raise BackendUnavailableError(
            f"no backend named {name!r}; installed: {', '.join(_classes())} (install kvhal-{name} or check the name)"
        )
    if isinstance(entry, str):
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {entry}")
    if options:
        return entry(**options)
    with _instances_lock:
        if name not in _instances:
            _instances[name] = entry()
        return _instances[name]


def refusal(backend: Backend, spec: CacheSpec) -> str | None:
    """Why ``backend`` refuses ``spec`` for some op, or None."""
    for op in OPS:
        why = backend.supports(spec, op)
        if why is not None:
            return f"{op}: {why}" if op != "store" else why
    return None


def _capable(
    spec: CacheSpec, skip: str = "", infos: list[BackendInfo] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Available backends that take ``spec``, best first, and why each other one does not."""
    ok, why = [], {}
    for info in backends() if infos is None else infos:
        if info.name == skip:
            continue
        reason = info.refusal(spec)
        if reason is None:
            ok.append(info.name)
        else:
            why[info.name] = reason
    return ok, why


def resolve(
    name: str | Backend, spec: CacheSpec, allow_fallback: bool = False, options: dict[str, Any] | None = None
) -> Backend:
    """The backend a cache of ``spec`` runs on: an instance, a name, or "auto" (``KVHAL_BACKEND``
    overrides "auto"). A backend that refuses the spec is an ``UnsupportedError`` naming those that
    take it, unless ``allow_fallback`` (then the best of them, with a warning)."""
    if options is not None and not isinstance(options, dict):
        raise SpecError(f"backend_options must be a dict, got {type(options).__name__}")
    if options and (bad := [k for k in options if not isinstance(k, str)]):  # ** would raise a raw TypeError
        raise SpecError(f"backend_options keys are option names (str), got {bad[0]!r}; see the backend's docs")
    if isinstance(name, Backend):
        if options:
            raise SpecError("backend_options apply to a backend given by name; configure the instance instead")
        backend, requested, source, infos = name, name.name, "", None
    elif isinstance(name, str):
        # stripped as backend options' variables are; every error below names the variable (the caller passed "auto")
        env = (os.environ.get("KVHAL_BACKEND") or "").strip() if name == "auto" else ""
        requested = env or name
        source = " (from KVHAL_BACKEND; unset it or set another backend)" if env and env != "auto" else ""
        picked = requested == "auto"
        infos = backends()  # one probe of each per call
        if picked:
            for i in infos:  # "auto" would pass it over for a slower one: say so instead
                if i.misconfigured:
                    raise SpecError(
                        f"backend {i.name!r} is set up wrongly in this process ({i.reason}); backend='auto' does "
                        "not pass it over for another: fix the setting, or name the backend to use"
                    )
            ok, why = _capable(spec, infos=infos)
            if not ok:
                raise UnsupportedError(
                    "no available backend takes this spec: " + "; ".join(f"{n}: {r}" for n, r in why.items())
                )
            # _capable asked the shared instance: the one built with options is checked below like a named one
            requested = ok[0]
        info = {i.name: i for i in infos}.get(requested)
        if info is not None and not info.available and not options:  # options may name a usable device
            raise BackendUnavailableError(f"backend {requested!r} is unavailable: {info.reason}{source}")
        try:
            backend = instance(requested, options)
        except BackendUnavailableError as e:
            if not source:
                raise
            raise BackendUnavailableError(f"{e}{source}") from None
        except SpecError as e:
            if not picked:
                raise
            raise SpecError(
                f"{e} (backend='auto' picked {requested!r}: name the backend these options are for)"
            ) from None
    else:
        raise SpecError(f"backend must be a name, 'auto' or a kvhal.Backend instance, got {type(name).__name__}")
    why_not = refusal(backend, spec)
    if why_not is None:
        return backend
    ok, _ = _capable(spec, skip=requested, infos=infos)  # the probes this call already made, if any
    if not allow_fallback or not ok:
        raise UnsupportedError(
            f"backend {requested!r}{source} refuses this spec ({why_not}); "
            f"backends that take it: {', '.join(ok) or 'none'} "
            "(pick one of them, or pass allow_fallback=True to use the best of them)"
        )
    warnings.warn(f"kvhal: {requested!r} refuses this spec ({why_not}); falling back to {ok[0]!r}", stacklevel=3)
    return instance(ok[0])
