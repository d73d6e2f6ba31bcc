"""The tools' ``-o FILE``: checked before a run that may take minutes, written with a typed error."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import KVHalError


def output_path(path: str | None) -> str | None:
    """``-o FILE`` checked before a run that may take minutes: a file in an existing, writable directory."""
    if path is None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise KVHalError(f"-o {path}: is a directory; pass a file path such as {os.path.join(path, 'result.json')}")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise KVHalError(f"-o {path}: directory {parent} does not exist or is not writable")
    return path


def write_json(path: str | None, data: Any) -> None:
    if path is not None:
        try:
            with open(path, "w") as fh:
                json.dump(data, fh, indent=2)
        except OSError as e:
            raise KVHalError(f"-o {path}: cannot write the result ({e.strerror})") from e
