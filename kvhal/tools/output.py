"""The tools' output paths (``-o FILE``, ``OUT``, ``--calibrate DIR``...): checked before a run that may take
minutes, written with a typed error."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import SpecError


def output_path(path: str | None, flag: str = "-o") -> str | None:
    """A file to write: not a directory, in an existing directory this process may write."""
    if path is None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SpecError(f"{flag} {path}: is a directory; pass a file path such as {os.path.join(path, 'out.json')}")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise SpecError(f"{flag} {path}: the directory {parent} does not exist (or is not writable); create it first")
    return path


def output_dir(path: str, flag: str) -> str:
    """A directory to write into: one that exists, or one to make in an existing directory (no parents made)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(f"{flag} {path}: exists and is not a directory; name a directory (made if missing)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path) and not os.path.isdir(parent):
        raise SpecError(f"{flag} {path}: the directory {parent} does not exist; create it first")
    return path


def write_json(path: str | None, data: Any) -> None:
    if path is not None:
        try:
            with open(path, "w") as fh:
                json.dump(data, fh, indent=2)
        except OSError as e:
            raise SpecError(f"-o {path}: cannot write the result ({e.strerror})") from e
