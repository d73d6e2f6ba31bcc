"""Fixtures for the tier tests: keys, and real redis-server processes on free loopback ports.

Without redis-server (Debian: apt-get install redis-server) or the redis client (pip install 'kvhal[tiers]') the
Redis tests skip with one line; under KVHAL_STRICT=1 they fail instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.tiers import BlockKey
from kvhal.tools.tiers_server import RedisServer, redis_server_path

NS = hashlib.sha256(b"model-a").digest()
NS_B = hashlib.sha256(b"model-b").digest()


def key(i: int, ns: bytes = NS) -> BlockKey:
    return BlockKey(ns, hashlib.sha256(i.to_bytes(8, "little")).digest())


def keys(n: int, ns: bytes = NS, start: int = 0) -> list[BlockKey]:
    return [key(i, ns) for i in range(start, start + n)]


def payload(i: int, size: int = 4096) -> bytes:
    """Deterministic bytes for block i (a subprocess can rebuild them)."""
    seed = hashlib.sha256(b"payload" + i.to_bytes(8, "little")).digest()
    return (seed * (size // 32 + 1))[:size]


def version1_blob(k: BlockKey, data: bytes) -> bytes:
    """A blob of format 1 as it was written: a 112-byte header ending in the payload's sha256."""
    header = b"KVHB" + struct.pack("<HH", 1, 0) + k.namespace + k.block_hash + struct.pack("<Q", len(data))
    return header + hashlib.sha256(data).digest() + data


def unavailable(why: str) -> None:
    if os.environ.get("KVHAL_STRICT") == "1":
        pytest.fail(f"{why} (KVHAL_STRICT=1)")
    pytest.skip(why)


def require_redis() -> None:
    if redis_server_path() is None:
        unavailable("redis-server not installed: apt-get install redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        unavailable("redis client not installed: pip install 'kvhal[tiers]'")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (the test may kill, stop or restart it on the same port)."""
    require_redis()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Three cluster-enabled redis-server nodes on loopback, slots split by redis-cli; yields a node's url."""
    require_redis()
    if shutil.which("redis-cli") is None:
        unavailable("redis-cli not installed (Debian package redis-tools): needed to create a cluster")
    base = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        for i in range(3):
            port = cluster_port()
            args = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            nodes.append(RedisServer(base / f"node{i}", port=port, args=args).start())
        create = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes]]
        r = subprocess.run([*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True)
        if r.returncode != 0:
            unavailable(f"redis-cli --cluster create failed here: {(r.stdout + r.stderr).strip()[-300:]}")
        for n in nodes:  # every node, not one: a client may be redirected to any of them at once
            _wait_cluster_ok(n.port, len(nodes))
        yield nodes[0].url
    finally:
        for n in nodes:
            n.stop(kill=True)


def cluster_port() -> int:
    """A free port <= 55535 whose bus port (+10000) is free too: what a cluster node needs."""
    import random
    import socket

    for _ in range(100):
        port = random.randrange(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    pytest.fail("no free port pair (p, p + 10000) for a cluster node on loopback")


def _wait_cluster_ok(port: int, n_nodes: int) -> None:
    """Until the node says the cluster is up, every slot assigned, and it knows all ``n_nodes`` nodes (a node
    still learning the others over the bus answers CLUSTERDOWN to a client it is redirected to)."""
    import time

    want = ("cluster_state:ok", "cluster_slots_assigned:16384", "cluster_slots_ok:16384", f"cluster_known_nodes:{n_nodes}")
    for _ in range(400):
        out = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout
        lines = set(out.split())
        if all(w in lines for w in want):
            return
        time.sleep(0.05)
    pytest.fail(f"cluster node on port {port} never reported {', '.join(want)}")
