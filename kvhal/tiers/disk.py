"""DiskTier: one file per block under a directory, written crash-safe, least recently used dropped first.

Layout: ``<root>/<namespace hex[:16]>/<block hash hex>.kvb``, each file one blob (blob.py). A ``put`` writes
each blob to a temp file in the same directory, makes them all durable at once (one syncfs on Linux, else an
fsync each), renames them over their final names and fsyncs the directory, so a reader (or a restart after
kill -9 or a power cut) sees a whole blob or none. A ``put`` that evicts writes its new blobs into the evicted
files (renamed to temp names first), so a tier at its budget allocates no inodes. A ``get`` opens a call's
files and starts readahead on all of them before worker threads read and checksum them. The LRU order lives in
memory and is rebuilt from file mtimes at start (a hit refreshes a file's mtime once it is a minute old), so a
restart keeps every block, in the order of use to the minute.
One writing process per directory: temp files of a live writer are left alone, those of a dead one removed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TierError
from .base import ByteLRU, Tier
from .blob import HEADER_SIZE, blob_header, blob_size, payload_length, payload_matches
from .keys import BlockKey, check_count

_DIR = re.compile(r"[0-9a-f]{16}")
_FILE = re.compile(r"[0-9a-f]{64}\.kvb")
_TEMP = re.compile(r"\.[0-9a-f]{64}\.(\d+)\.[0-9a-f]+\.tmp")

_OK, _MISSING, _CORRUPT, _ERROR = range(4)
TOUCH_AFTER_S = 60.0
WORKERS = 16


def _rel(key: BlockKey) -> str:
    return f"{key.namespace.hex()[:16]}/{key.block_hash.hex()}.kvb"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(path: str) -> tuple[int, Any]:
    """(state, fd or exception), asking the kernel to start reading the whole file now (readahead): a call's
    files are all opened and advised before any is read, so the device sees every request of the call at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return _MISSING, None
    except OSError as e:
        return _ERROR, e
    if _FADVISE:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint only: the read below still reads the file
    return _OK, fd


def _read(fd: int, key: BlockKey) -> tuple[int, Any]:
    """(state, payload or exception) from an open blob file, which it closes; header and payload are read
    apart so the payload lands in its own bytes object, copied once (kernel to bytes)."""
    try:
        st = os.fstat(fd)
        header = os.read(fd, HEADER_SIZE)
        n = payload_length(key, header)
        if n is None or st.st_size != HEADER_SIZE + n:
            return _CORRUPT, None
        payload = os.read(fd, n)
        while len(payload) < n and (more := os.read(fd, n - len(payload))):
            payload += more
        if not payload_matches(header, payload):
            return _CORRUPT, None
        if time.time() - st.st_mtime > TOUCH_AFTER_S:
            os.utime(fd)  # the order a restart rebuilds follows use, at one metadata write per block per minute
    except OSError as e:
        return _ERROR, e
    finally:
        os.close(fd)
    return _OK, payload


def _syncfs_call() -> Callable[[int], int] | None:
    """Linux's syncfs(2) (write back and flush one filesystem, waiting for it) from the C library, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]


_FADVISE = hasattr(os, "posix_fadvise")


@functools.cache
def _syncfs_fn() -> Callable[[int], int] | None:
    return _syncfs_call()


def _syncfs(fd: int) -> None:
    fn = _syncfs_fn()
    assert fn is not None
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def _reuse(spare: str, tmp: str) -> int | None:
    """An evicted block file, renamed to ``tmp`` and opened for writing, or None (then a new file is made)."""
    try:
        os.rename(spare, tmp)
    except OSError:  # gone behind our back, or not movable: removed, as an evicted file is; the caller creates one
        _unlink_quiet(spare)
        return None
    try:
        return os.open(tmp, os.O_WRONLY)
    except OSError:
        _unlink_quiet(tmp)
        return None


def _write(
    path: str, key: BlockKey, payload: bytes | memoryview, sync_each: bool, spare: str | None
) -> tuple[str, BaseException | None]:
    """Write one blob to a temp file next to ``path``; (temp path, error). The caller makes the bytes durable
    (``sync_each``: fsync here) before renaming the temp file over ``path``.

    ``spare``: a file this call evicted, whose inode and blocks are reused: renamed to the temp
    name (its old name gone, as an unlink would), overwritten from offset 0 and cut to the blob's size. Creating
    a file costs an inode allocation, which on ext4 without a journal scans past every inode of the group freed
    in the last ~30 s (``recently_deleted``): a cache at its budget frees one per block it writes."""
    header = blob_header(key, payload)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name[:-4]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = _reuse(spare, tmp) if spare else None
        if fd is None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            spare = None
        try:
            done = os.writev(fd, [header, payload])
            rest = memoryview(header + payload)[done:] if done < len(header) + len(payload) else b""
            while rest:
                rest = rest[os.write(fd, rest) :]
            if spare:  # cut to size (a no-op when the old blob was as long)
                os.ftruncate(fd, len(header) + len(payload))
            if sync_each:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        _unlink_quiet(tmp)
        return tmp, e
    return tmp, None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class DiskTier(Tier):
    """Blocks as files under ``path`` within ``max_bytes`` (whole blob files, header included).

    ``workers`` threads read, checksum and write blocks in parallel: fsyncs in flight together cost about
    one, and an SSD needs a queue deeper than one to reach its bandwidth.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, *, workers: int = WORKERS) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TierError(f"path must be a str or os.PathLike directory, got {type(path).__name__}")
        budget = check_count("max_bytes", max_bytes)
        super().__init__(check_count("workers", workers))
        self._lru: ByteLRU[str] = ByteLRU(budget)
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierError(f"cannot create the disk tier directory {self.path}: {e}; pass a writable directory") from e
        self._root = str(self.path)
        self._scan()

    def _abs(self, rel: str) -> str:
        return os.path.join(self._root, rel)

    def _scan(self) -> None:
        """Index every block file, oldest mtime first; remove a dead writer's temp files and short files."""
        found = []
        with os.scandir(self._root) as dirs:
            for d in dirs:
                if not (_DIR.fullmatch(d.name) and d.is_dir(follow_symlinks=False)):
                    continue
                with os.scandir(d.path) as files:
                    for f in files:
                        temp = _TEMP.fullmatch(f.name)
                        if temp and not _pid_alive(int(temp[1])):
                            self._drop_corrupt(f.path)
                        elif _FILE.fullmatch(f.name) and f.is_file(follow_symlinks=False):
                            st = f.stat(follow_symlinks=False)
                            if st.st_size < HEADER_SIZE:
                                self._drop_corrupt(f.path)
                            else:
                                found.append((st.st_mtime_ns, f"{d.name}/{f.name}", st.st_size))
        for _, rel, size in sorted(found):
            self._track(rel, size)

    def _track(self, rel: str, size: int) -> None:
        """Index a block file present on disk as the most recent, evicting older ones to stay within budget."""
        if size > self._lru.max_bytes:
            self._evict(rel)
            return
        for old in self._lru.add(rel, size):
            self._evict(old)

    def _evict(self, rel: str) -> None:
        self._lru.remove(rel)
        self._unlink(self._abs(rel))
        self._evicted()

    def _drop_corrupt(self, path: str) -> None:
        self._unlink(path)
        self._stats.corrupt_dropped += 1

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._error(e)

    def _contains(self, keys: list[BlockKey]) -> int:
        for n, k in enumerate(keys):
            rel = _rel(k)
            if not os.path.exists(self._abs(rel)):
                self._lru.remove(rel)  # deleted behind our back
                return n
        return len(keys)

    def _get(self, keys: list[BlockKey]) -> list[bytes | memoryview | None]:
        rels = [_rel(k) for k in keys]
        out: list[bytes | memoryview | None] = []
        opened = [_open(self._abs(r)) for r in rels]  # every file's readahead starts before the first read
        reads = self._map(_read, [(fd, k) for (state, fd), k in zip(opened, keys) if state == _OK])
        results = iter(reads)
        for rel, (state, value) in zip(rels, opened):
            if state == _OK:
                state, value = next(results)
            out.append(value if state == _OK else None)
            if state == _OK:
                if rel in self._lru:
                    self._lru.touch(rel)
                else:  # written by another process since our scan
                    self._track(rel, blob_size(len(value)))
            elif state == _ERROR:
                self._error(value)
            else:
                self._lru.remove(rel)
                if state == _CORRUPT:
                    self._drop_corrupt(self._abs(rel))
        return out

    def _put(self, keys: list[BlockKey], payloads: list[bytes | memoryview]) -> list[bool]:
        rels = [_rel(k) for k in keys]
        pending: dict[str, tuple[BlockKey, bytes | memoryview]] = {}
        spares: list[str] = []  # files of blocks this call evicted, reused by its writes
        evicted: set[str] = set()

        def drop(old: str) -> None:
            if pending.pop(old, None) is None:  # an indexed block on disk: evicted, its file reused below
                spares.append(self._abs(old))
                evicted.add(self._abs(old))
                self._evicted()
            # else a block of this call, pushed out by a later one: never written

        for k, p, rel in zip(keys, payloads, rels):
            if rel in pending:
                self._lru.touch(rel)
                continue
            try:  # a block this call evicted counts as gone: its file is reused for another block
                size_on_disk = None if self._abs(rel) in evicted else os.stat(self._abs(rel)).st_size
            except FileNotFoundError:
                size_on_disk = None
            except OSError as e:
                self._error(e)
                continue
            if size_on_disk is not None:  # already there (ours, or another process's)
                if rel in self._lru:
                    self._lru.touch(rel)
                elif size_on_disk > self._lru.max_bytes:
                    self._evict(rel)
                else:  # indexed now; what that pushes out goes as below (a pending block is then not written)
                    for old in self._lru.add(rel, size_on_disk):
                        drop(old)
                continue
            self._lru.remove(rel)  # indexed but deleted behind our back
            size = blob_size(len(p))
            if size > self._lru.max_bytes:
                continue
            pending[rel] = (k, p)
            for old in self._lru.add(rel, size):
                drop(old)
        for path in spares[len(pending) :]:  # more evicted than written: gone now, as before the writes
            self._unlink(path)
        self._write_pending(pending, spares[: len(pending)])
        return [rel in self._lru for rel in rels]

    def _write_pending(self, pending: dict[str, tuple[BlockKey, bytes | memoryview]], spares: list[str]) -> None:
        """Write the blocks crash-safe with one durability point for the whole call: every temp file written
        (into the files of ``spares``, blocks this call evicted, as far as they go), then one syncfs (their
        bytes durable), then the renames, then one fsync per directory touched (the names durable). A file
        appears under its final name only once its bytes are on the device. Without syncfs (not Linux) each
        temp file is fsynced by its writer thread instead."""
        if not pending:
            return
        dirs = {rel.split("/", 1)[0] for rel in pending}
        created = False
        for d in dirs:
            created |= not os.path.isdir(self._abs(d))
            try:
                os.makedirs(self._abs(d), exist_ok=True)
            except OSError as e:
                self._error(e)
        sync_each = _syncfs_fn() is None
        try:
            # opened before the writes: syncfs reports writeback errors seen since this descriptor was opened
            root_fd = os.open(self._root, os.O_RDONLY)
        except OSError as e:
            for rel in pending:
                self._lru.remove(rel)
            for path in spares:
                self._unlink(path)
            self._error(e)
            return
        try:
            reuse: list[str | None] = [*spares, *[None] * (len(pending) - len(spares))]
            args = [(self._abs(rel), k, p, sync_each, sp) for (rel, (k, p)), sp in zip(pending.items(), reuse)]
            written = list(zip(pending, self._map(_write, args)))
            if not sync_each and any(err is None for _, (_, err) in written):
                try:
                    _syncfs(root_fd)
                except OSError as e:  # nothing of this call is known durable: none of it is published
                    written = [(rel, (tmp, err or e)) for rel, (tmp, err) in written]
                    for _, (tmp, _) in written:
                        _unlink_quiet(tmp)
        finally:
            os.close(root_fd)
        for rel, (tmp, err) in written:
            if err is None:
                try:
                    os.replace(tmp, self._abs(rel))
                except OSError as e:
                    _unlink_quiet(tmp)
                    err = e
            if err is None:
                self._stats.puts += 1
            else:
                self._lru.remove(rel)
                self._error(err)
        for d in sorted(dirs) + ([""] if created else []):
            try:
                _fsync_dir(self._abs(d) if d else self._root)
            except OSError as e:
                self._error(e)

    def _delete(self, keys: list[BlockKey]) -> int:
        n = 0
        for k in keys:
            rel = _rel(k)
            self._lru.remove(rel)
            try:
                os.unlink(self._abs(rel))
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                self._error(e)
        return n

    def _usage(self) -> tuple[int | None, int | None]:
        return len(self._lru), self._lru.total
