"""File-system helpers the lifecycle layer shares (snapshots, the disk tier)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the writer of a temp file named by its pid)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (a pid beyond the kernel's pid_t, in a stray name: no process)
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: str) -> None:
    """fsync a file or a directory (after a create, rename or unlink in it) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
