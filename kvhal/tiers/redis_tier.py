"""RedisTier: blocks in a Redis or Valkey server, or a Redis Cluster, shared by every process that reaches it.

One key per block, ``kvhal:{<namespace hex[:16]>}:<block hash hex>``: the braces are a Cluster hash tag, so all
blocks of one model/cache share a slot and one MGET fetches a whole prefix. Writes are ``SET NX`` (a block's bytes
never change, the first writer wins); lookups are pipelined ``EXISTS``/``MGET``: one round trip per call.
Memory is the server's business (``maxmemory`` + ``allkeys-lru``): an evicted block is a miss. A tier never fails
to start for want of a server: an unreachable server (at construction or later: refused, reset, timed out) makes
the tier "degraded": every call is a miss (or a False flag) at once, with no network wait, counted in
``stats().down_misses``, logged once per outage; a reconnect is tried after a backoff (``reconnect_s`` doubling to
``max_reconnect_s``), and the first call that gets through makes it "connected" again.
The ``redis`` package is imported here only when a RedisTier is made (``pip install 'kvhal[tiers]'``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ..errors import TierError
from .base import Tier
from .blob import encode_blob, payload_view
from .keys import BlockKey, check_count, check_seconds

SCHEMES = ("redis", "rediss", "unix")
log = logging.getLogger("kvhal.tiers")


def redis_key(key: BlockKey) -> str:
    return f"kvhal:{{{key.namespace.hex()[:16]}}}:{key.block_hash.hex()}"


class RedisTier(Tier):
    """``url``: ``redis://host:port/db``, ``rediss://`` (TLS) or ``unix:///path.sock``.

    ``cluster``: True for Redis Cluster, False for one server, None to ask the server (``INFO cluster``) now, or
    at the first reconnect if it cannot be reached now (``self.cluster`` is None until then).
    ``reconnect_s`` / ``max_reconnect_s``: the first and the longest wait between reconnect tries while degraded.
    ``socket_timeout`` / ``connect_timeout``: seconds before a call gives up on the server (then: a miss).
    ``workers``: threads that checksum the blocks of one call in parallel. The CRC-32 runs at several GB/s
    in C, so a thread hand-off only pays for itself with free cores and several MiB per call: 1 by default.
    ``get`` hands out each payload as a read-only memoryview of the value received (no copy).
    """

    def __init__(
        self,
        url: str,
        *,
        cluster: bool | None = None,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        workers: int = 1,
        reconnect_s: float = 0.05,
        max_reconnect_s: float = 2.0,
    ) -> None:
        if not isinstance(url, str):
            raise TierError(f"url must be a str such as 'redis://127.0.0.1:6379', got {type(url).__name__}")
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in SCHEMES:
            raise TierError(f"url {url!r} must start with redis://, rediss:// or unix://")
        if cluster is not None and not isinstance(cluster, bool):
            raise TierError(f"cluster must be True, False or None (ask the server), got {type(cluster).__name__}")
        if cluster and scheme == "unix":
            raise TierError("a Redis Cluster is reached over TCP: use a redis:// or rediss:// url")
        options: dict[str, Any] = {
            "socket_timeout": check_seconds("socket_timeout", socket_timeout),
            "socket_connect_timeout": check_seconds("connect_timeout", connect_timeout),
        }
        self._reconnect_s = check_seconds("reconnect_s", reconnect_s)
        self._max_reconnect_s = max(self._reconnect_s, check_seconds("max_reconnect_s", max_reconnect_s))
        super().__init__(check_count("workers", workers))
        self._stats.evictions = None  # the server evicts; a block it dropped shows as a miss
        try:
            import redis
        except ImportError as e:
            raise TierError("RedisTier needs the redis client: pip install 'kvhal[tiers]'") from e
        from redis.backoff import NoBackoff
        from redis.connection import parse_url
        from redis.retry import Retry

        try:
            parsed = parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as e:
            raise TierError(f"url {url!r} is malformed: {e}") from e
        # what redis-py lets pass: a db path that is not a number is dropped ("/abc") or run together ("/3/4")
        path = urlsplit(url).path
        if scheme == "unix" and "path" not in parsed:
            raise TierError(f"url {url!r} names no socket; pass unix:///path/to/redis.sock")
        if scheme != "unix" and path.strip("/") and not path.strip("/").isdigit():
            raise TierError(f"url {url!r}: the path after host:port is a db number such as /0, not {path!r}")
        if parsed.get("decode_responses"):  # every get would raise UnicodeDecodeError on a block's bytes
            raise TierError(f"url {url!r} asks for decode_responses; blocks are bytes: drop that option")
        # a url option redis-py does not take (?sockettimeout=1) or a bad value (?ssl_cert_reqs=x) fails only when a
        # connection is made: a TypeError out of every call, or a RedisError taken for an outage. Checked on one
        # server's connection class; a Cluster (cluster=True) takes options of its own (?read_from_replicas=...)
        if not cluster:
            try:
                pool = redis.ConnectionPool.from_url(url, **options)
                pool.connection_class(**pool.connection_kwargs)  # made, not connected
            except (TypeError, ValueError, redis.RedisError) as e:
                raise TierError(f"url {url!r} has an option redis cannot use ({e}); fix or drop it") from None
        self.url = url
        self._redis = redis
        # one retry: the first command after a server restart meets a dead pooled connection, the retry reconnects
        self._options = options | {"retry": Retry(NoBackoff(), 1)}
        self._failures = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
        self._connection_failures = (
            redis.ConnectionError,
            redis.TimeoutError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self._client: Any = None  # made on first use (a Cluster client connects on creation)
        self.cluster: bool | None = cluster
        self._stats.state = "untried"
        self._backoff = 0.0
        self._retry_at = 0.0
        self._logged = False
        if cluster is None:
            self._connect()  # ask now; if the server is down the tier starts degraded and asks on reconnect

    def client(self) -> Any:
        """The tier's redis client (same library, same connection pool), or None while the server is unreachable:
        what a benchmark of raw SET/GET on the same server uses."""
        self._check_open()  # (a closed tier's client would connect again, behind the tier's back)
        return self._connect()

    def _connect(self) -> Any:
        """The client, or None while degraded and the next reconnect try is not due (or it failed again)."""
        if self._stats.state == "degraded" and time.monotonic() < self._retry_at:
            return None
        try:
            if self.cluster is None:
                probe = self._redis.Redis.from_url(self.url, **self._options)
                try:
                    self.cluster = bool(probe.info("cluster").get("cluster_enabled"))
                finally:
                    if self.cluster is not False:
                        probe.close()
                if self.cluster is False:
                    self._client = probe
                self._up()
            if self._client is None:
                cls = self._redis.cluster.RedisCluster if self.cluster else self._redis.Redis
                self._client = cls.from_url(self.url, **self._options)
        except self._failures as e:
            self._down(e)
            return None
        return self._client

    def _down(self, e: BaseException) -> None:
        """The server is unreachable: degraded until a reconnect, tried after a growing backoff."""
        self._error(e)
        self._stats.state = "degraded"
        self._backoff = min(self._max_reconnect_s, self._backoff * 2 if self._backoff else self._reconnect_s)
        self._retry_at = time.monotonic() + self._backoff
        if self.cluster and self._client is not None:  # a Cluster client is made afresh (it maps slots on creation)
            self._client.close()
            self._client = None
        if not self._logged:
            self._logged = True
            log.warning(
                "kvhal RedisTier: cannot reach %s (%s: %s); blocks are misses until it is back (retried with backoff)",
                self.url,
                type(e).__name__,
                e,
            )

    def _up(self) -> None:
        if self._stats.state != "connected":
            if self._logged:
                log.warning("kvhal RedisTier: %s is reachable again", self.url)
            self._stats.state, self._backoff, self._logged = "connected", 0.0, False

    def _pipeline(self, build: Callable[[Any], object]) -> list[Any] | None:
        """Run the commands ``build`` queues in one round trip; None (error counted) if the server failed us.
        A command the server refused comes back as its exception, in place."""
        client = self._connect()
        if client is None:
            return None
        try:
            pipe = client.pipeline(transaction=False)
            build(pipe)
            results: list[Any] = pipe.execute(raise_on_error=False)
        except self._connection_failures as e:
            self._down(e)
            return None
        except self._failures as e:
            self._error(e)
            return None
        self._up()
        for r in results:
            if isinstance(r, Exception):
                self._error(r)
        return results

    def _contains(self, keys: list[BlockKey]) -> int:
        res = self._pipeline(lambda p: [p.exists(redis_key(k)) for k in keys])
        n = 0
        while res is not None and n < len(res) and res[n] == 1:
            n += 1
        return n

    def _get(self, keys: list[BlockKey]) -> list[bytes | memoryview | None]:
        groups: dict[bytes, list[int]] = {}  # one MGET per namespace: one slot each on a Cluster
        for i, k in enumerate(keys):
            groups.setdefault(k.namespace, []).append(i)
        # execute_command: redis-py's Cluster pipeline refuses its mget() method, but routes an MGET whose keys
        # share a slot, as one namespace's do
        res = self._pipeline(
            lambda p: [p.execute_command("MGET", *[redis_key(keys[i]) for i in idx]) for idx in groups.values()]
        )
        out: list[bytes | memoryview | None] = [None] * len(keys)
        if res is None:
            if self._stats.state == "degraded":
                self._stats.down_misses += len(keys)
            return out
        found = []
        for idx, blobs in zip(groups.values(), res):
            if not isinstance(blobs, Exception):
                found += [(i, blob) for i, blob in zip(idx, blobs) if blob is not None]
        bad = []
        for (i, _), payload in zip(found, self._map(payload_view, [(keys[i], blob) for i, blob in found])):
            out[i] = payload
            if payload is None:
                bad.append(keys[i])
        if bad:
            deleted = self._pipeline(lambda p: [p.delete(redis_key(k)) for k in bad])
            self._stats.corrupt_dropped += sum(r == 1 for r in deleted or [])
        return out

    def _put(self, keys: list[BlockKey], payloads: list[bytes | memoryview]) -> list[bool]:
        blobs = self._map(encode_blob, list(zip(keys, payloads)))
        res = self._pipeline(lambda p: [p.set(redis_key(k), b, nx=True) for k, b in zip(keys, blobs)])
        if res is None:
            return [False] * len(keys)
        self._stats.puts += sum(r is True for r in res)
        return [not isinstance(r, Exception) for r in res]  # None: SET NX found the block already there

    def _delete(self, keys: list[BlockKey]) -> int:
        res = self._pipeline(lambda p: [p.delete(redis_key(k)) for k in keys])
        return sum(r == 1 for r in res or [])

    def _usage(self) -> tuple[int | None, int | None]:
        return None, None  # only the server knows (and evicts)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
