"""The transformers versions ``kvhal.integrations.transformers`` follows, checked before it imports transformers:
an older or newer one is a typed error that names what is installed and what to install."""

from __future__ import annotations

import re
from importlib import metadata

from ..errors import UnsupportedError

TRANSFORMERS_NEEDED = (5, 25)  # the Cache and attention interfaces this module follows (pyproject's extra)


class TransformersVersionError(UnsupportedError, ImportError):
    """transformers (or torch) is missing or older than this integration needs."""


def transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def need_transformers(found: str | None, why: str) -> TransformersVersionError:
    need = ".".join(map(str, TRANSFORMERS_NEEDED))
    have = "is not installed" if found is None else f"{found} is installed"
    return TransformersVersionError(
        f"kvhal.integrations.transformers needs transformers >= {need}, < 6 and torch; transformers {have} ({why}): "
        f"pip install 'kvhal[transformers]' (or 'transformers>={need},<6')"
    )


def require_transformers() -> str | None:
    """The installed transformers version (None: not installed; the import that follows says so), after
    refusing one this integration does not follow."""
    found = transformers_version()
    m = re.match(r"(\d+)\.(\d+)", found or "")
    if found is not None and (m is None or (int(m[1]), int(m[2])) < TRANSFORMERS_NEEDED or int(m[1]) >= 6):
        raise need_transformers(found, "too old" if m and int(m[1]) < 6 else "not a supported version")
    return found
