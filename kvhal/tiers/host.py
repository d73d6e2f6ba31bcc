"""HostTier: blocks in this process's RAM, least recently used dropped first to stay within a byte budget."""

from __future__ import annotations

from .base import ByteLRU, Tier
from .keys import BlockKey, check_count


class HostTier(Tier):
    """Payload bytes in a dict; the budget counts payload bytes (no blob header: nothing here can tear)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self._lru: ByteLRU[BlockKey] = ByteLRU(check_count("max_bytes", max_bytes))
        self._data: dict[BlockKey, bytes] = {}

    def _contains(self, keys: list[BlockKey]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._data:
            n += 1
        return n

    def _get(self, keys: list[BlockKey]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        for k in keys:
            data = self._data.get(k)
            if data is not None:
                self._lru.touch(k)
            out.append(data)
        return out

    def _put(self, keys: list[BlockKey], payloads: list[bytes | memoryview]) -> list[bool]:
        pending: dict[BlockKey, bytes | memoryview] = {}
        for k, p in zip(keys, payloads):
            if k in self._lru:
                self._lru.touch(k)
            elif len(p) <= self._lru.max_bytes:
                pending[k] = p
                for old in self._lru.add(k, len(p)):
                    if pending.pop(old, None) is None:  # else: pushed out by a later block of this call
                        del self._data[old]
                        self._evicted()
        for k, p in pending.items():
            self._data[k] = bytes(p)  # no copy for bytes; a view is copied so the caller may reuse its buffer
        self._stats.puts += len(pending)
        return [k in self._lru for k in keys]

    def _delete(self, keys: list[BlockKey]) -> int:
        n = 0
        for k in keys:
            if self._data.pop(k, None) is not None:
                self._lru.remove(k)
                n += 1
        return n

    def _usage(self) -> tuple[int | None, int | None]:
        return len(self._data), self._lru.total
