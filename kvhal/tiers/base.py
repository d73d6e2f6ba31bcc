"""The tier interface every store implements, its stats, and the byte-budget LRU the local tiers share."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

from ..errors import TierError
from .keys import BlockKey, Payload, check_keys, check_payloads

T = TypeVar("T")


@dataclass
class TierStats:
    """Counters since the tier was opened. ``contains`` is a probe and counts nothing.

    hits / misses: blocks ``get`` returned / did not (absent, evicted, corrupt, or an error).
    puts: blocks ``put`` wrote; rejected: blocks it did not hold afterwards (larger than the budget, pushed
    out by later blocks of the same call, or an I/O/connection error). deletes: blocks ``delete`` removed.
    evictions: blocks the tier dropped for space (None where the server evicts unseen, e.g. Redis).
    corrupt_dropped: foreign, torn or corrupt blobs found and deleted (and a crashed writer's temp files).
    errors: I/O or connection failures, each answered as a miss or a False flag; last_error: the latest one.
    blocks / bytes_stored: what the tier holds now (None where only the server knows; DiskTier: every byte of its
    segment files, dead records included, which is what its budget counts).
    state: "ok" for a local tier; RedisTier: "untried" (not yet connected), "connected" or "degraded" (the server
    unreachable: every call a miss until a reconnect, tried with backoff, succeeds). down_misses: blocks asked for
    (get) while degraded.
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    deletes: int = 0
    evictions: int | None = 0
    corrupt_dropped: int = 0
    errors: int = 0
    last_error: str | None = None
    blocks: int | None = None
    bytes_stored: int | None = None
    state: str = "ok"
    down_misses: int = 0


TierT = TypeVar("TierT", bound="Tier")


class Tier(ABC):
    """A store of blocks by BlockKey. Arguments are checked before anything changes (TierError); after that no
    call raises for a store's failure: a missing, corrupt or unreachable block is a miss, counted in stats()."""

    def __init__(self, workers: int = 1) -> None:
        """``workers`` > 1: threads that checksum and do file I/O for the blocks of one call in parallel
        (both release the GIL)."""
        self._stats = TierStats()
        self._closed = False
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvhal-tier") if workers > 1 else None

    def contains(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, the tier holds: the length of the prefix it can serve."""
        ks = self._open_keys(keys)
        return self._contains(ks) if ks else 0

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | memoryview | None]:
        """Each key's payload, or None for a miss. A bad blob is a miss and is deleted. A payload is ``bytes``, or
        a read-only ``memoryview`` (RedisTier: of the value as the server sent it; DiskTier: of the buffer one read
        of adjacent records filled), so it is not copied again."""
        ks = self._open_keys(keys)
        out = self._get(ks) if ks else []
        hits = sum(p is not None for p in out)
        self._stats.hits += hits
        self._stats.misses += len(out) - hits
        return out

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> list[bool]:
        """Store blocks (in order, each the most recently used); True where the tier holds the block afterwards
        (written now or already there)."""
        ks = self._open_keys(keys)
        ps = check_payloads(payloads, len(ks))
        flags = self._put(ks, ps) if ks else []
        self._stats.rejected += flags.count(False)
        return flags

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many were there."""
        ks = self._open_keys(keys)
        n = self._delete(ks) if ks else 0
        self._stats.deletes += n
        return n

    def stats(self) -> TierStats:
        self._check_open()
        blocks, nbytes = self._usage()
        return dataclasses.replace(self._stats, blocks=blocks, bytes_stored=nbytes)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def __enter__(self: TierT) -> TierT:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _open_keys(self, keys: object) -> list[BlockKey]:
        self._check_open()
        return check_keys(keys)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"this {type(self).__name__} is closed; open a new one")

    def _map(self, fn: Callable[..., T], args: list[tuple[Any, ...]]) -> list[T]:
        """``[fn(*a) for a in args]``, split into one contiguous chunk per worker thread when there are several
        (a future per item would cost as much as checksumming a 64 KiB block)."""
        if self._pool is None or len(args) < 2:
            return [fn(*a) for a in args]
        size = -(-len(args) // self._workers)
        chunks = [args[i : i + size] for i in range(0, len(args), size)]
        return [r for part in self._pool.map(lambda c: [fn(*a) for a in c], chunks) for r in part]

    def _evicted(self, n: int = 1) -> None:
        self._stats.evictions = (self._stats.evictions or 0) + n

    def _error(self, exc: BaseException) -> None:
        self._stats.errors += 1
        self._stats.last_error = f"{type(exc).__name__}: {exc}"

    @abstractmethod
    def _contains(self, keys: list[BlockKey]) -> int: ...

    @abstractmethod
    def _get(self, keys: list[BlockKey]) -> list[bytes | memoryview | None]: ...

    @abstractmethod
    def _put(self, keys: list[BlockKey], payloads: list[bytes | memoryview]) -> list[bool]: ...

    @abstractmethod
    def _delete(self, keys: list[BlockKey]) -> int: ...

    @abstractmethod
    def _usage(self) -> tuple[int | None, int | None]: ...

    def _close(self) -> None:
        pass


K = TypeVar("K", bound=Hashable)


class ByteLRU(Generic[K]):
    """Entry sizes in least-recently-used order; ``add`` evicts from the old end until the total fits."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._sizes: OrderedDict[K, int] = OrderedDict()

    def __contains__(self, key: K) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: K) -> None:
        self._sizes.move_to_end(key)

    def add(self, key: K, size: int) -> list[K]:
        """Insert ``key`` as the most recent (size <= max_bytes); returns the keys evicted to make room, oldest first."""
        self.remove(key)
        self._sizes[key] = size
        self.total += size
        evicted = []
        while self.total > self.max_bytes:
            old, old_size = self._sizes.popitem(last=False)
            self.total -= old_size
            evicted.append(old)
        return evicted

    def remove(self, key: K) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.total -= size
        return True
