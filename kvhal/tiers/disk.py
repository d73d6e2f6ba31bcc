"""DiskTier: one file per block under a directory, written crash-safe, least recently used dropped first.

Layout: ``<root>/<namespace hex[:16]>/<block hash hex>.kvb``, each file one blob (blob.py). A write goes to a
temp file in the same directory, is fsynced, renamed over the final name and the directory fsynced, so a reader
(or a restart after kill -9) sees a whole blob or none. The LRU order lives in memory and is rebuilt from file
mtimes at start (a hit refreshes a file's mtime once it is a minute old), so a restart keeps every block, in
the order of use to the minute.
One writing process per directory: temp files of a live writer are left alone, those of a dead one removed.
"""

from __future__ import annotations

import os
import re
import secrets
import time
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


def _read(path: str, key: BlockKey) -> tuple[int, Any]:
    """(state, payload or exception); header and payload are read apart so the payload is not copied again."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return _MISSING, None
    except OSError as e:
        return _ERROR, e
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


def _write(path: str, key: BlockKey, payload: bytes | memoryview) -> BaseException | None:
    """Write one blob crash-safe (temp, fsync, rename); the caller fsyncs the directory once per call."""
    header = blob_header(key, payload)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name[:-4]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = os.writev(fd, [header, payload])
            rest = memoryview(header + payload)[done:] if done < len(header) + len(payload) else b""
            while rest:
                rest = rest[os.write(fd, rest) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return e
    return None


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

    def _get(self, keys: list[BlockKey]) -> list[bytes | None]:
        rels = [_rel(k) for k in keys]
        out: list[bytes | None] = []
        results = self._map(_read, [(self._abs(r), k) for r, k in zip(rels, keys)])
        for rel, (state, value) in zip(rels, results):
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
        for k, p, rel in zip(keys, payloads, rels):
            if rel in pending:
                self._lru.touch(rel)
                continue
            try:
                size_on_disk: int | None = os.stat(self._abs(rel)).st_size
            except FileNotFoundError:
                size_on_disk = None
            except OSError as e:
                self._error(e)
                continue
            if size_on_disk is not None:  # already there (ours, or another process's)
                if rel in self._lru:
                    self._lru.touch(rel)
                else:
                    self._track(rel, size_on_disk)
                continue
            self._lru.remove(rel)  # indexed but deleted behind our back
            size = blob_size(len(p))
            if size > self._lru.max_bytes:
                continue
            pending[rel] = (k, p)
            for old in self._lru.add(rel, size):
                if pending.pop(old, None) is None:  # pushed out by a later block of this call: never written
                    self._evict(old)
        self._write_pending(pending)
        return [rel in self._lru for rel in rels]

    def _write_pending(self, pending: dict[str, tuple[BlockKey, bytes | memoryview]]) -> None:
        dirs = {rel.split("/", 1)[0] for rel in pending}
        created = False
        for d in dirs:
            created |= not os.path.isdir(self._abs(d))
            try:
                os.makedirs(self._abs(d), exist_ok=True)
            except OSError as e:
                self._error(e)
        args = [(self._abs(rel), k, p) for rel, (k, p) in pending.items()]
        for rel, err in zip(pending, self._map(_write, args)):
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
