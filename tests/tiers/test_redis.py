"""RedisTier against real redis-server processes: a crash and a restart, a frozen server, server-side eviction,
corrupt values, two OS processes sharing blocks, a unix socket, and a 3-node Redis Cluster."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvhal
from kvhal.tiers import RedisTier, encode_blob
from kvhal.tiers.redis_tier import redis_key
from kvhal.tools.tiers_server import RedisServer, free_port

from .conftest import NS_B, key, keys, payload, require_redis, unavailable, version1_blob

ROOT = Path(__file__).resolve().parents[2]


def raw_client(url: str):  # type: ignore[no-untyped-def]
    import redis

    return redis.Redis.from_url(url)


def wait_connected(t: RedisTier, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while t.stats().state != "connected":
        assert time.monotonic() < deadline, t.stats()
        t.contains(keys(1))
        time.sleep(0.02)


def test_server_killed_mid_run_then_back_on_the_same_port(redis_server: RedisServer, caplog):
    t = RedisTier(redis_server.url, socket_timeout=0.5, connect_timeout=0.5, reconnect_s=30)
    assert t.stats().state == "connected"
    ks = keys(4)
    data = [payload(i) for i in range(4)]
    assert t.put(ks[:2], data[:2]) == [True, True] and t.get(ks[:2]) == data[:2]
    redis_server.stop(kill=True)
    t0 = time.monotonic()
    assert t.contains(ks) == 0
    assert t.get(ks) == [None] * 4
    assert t.put(ks[2:], data[2:]) == [False, False]
    assert t.delete(ks) == 0
    s = t.stats()
    # the first call found the server gone; the others were misses at once, within the backoff
    assert s.errors == 1 and "ConnectionError" in str(s.last_error) and time.monotonic() - t0 < 2
    assert (s.hits, s.misses, s.rejected, s.state, s.down_misses) == (2, 4, 2, "degraded", 4)
    assert sum("cannot reach" in r.getMessage() for r in caplog.records) == 1  # logged once
    redis_server.start()  # same port, empty (no persistence)
    t._retry_at = 0.0  # (the 30 s backoff over)
    assert t.contains(ks) == 0 and t.get(ks[:1]) == [None] and t.stats().state == "connected"
    assert t.put(ks, data) == [True] * 4 and t.get(ks) == data and t.contains(ks) == 4
    assert t.stats().errors == 1  # nothing new failed once the server was back
    t.close()


def test_a_started_server_used_as_a_context_is_one_process_stopped_at_exit(tmp_path: Path):
    """``with RedisServer(...).start()`` (kvhal stress --tiers redis did this) started a second redis-server that
    failed to bind while the first answered, and left the first running after the block."""
    require_redis()
    with RedisServer(tmp_path / "redis").start() as server:
        proc = server.proc
        assert proc is not None and server.ping()
    assert proc.poll() is not None and not server.ping()


def test_server_down_at_construction_then_started(tmp_path: Path):
    require_redis()
    server = RedisServer(tmp_path / "redis")  # its port chosen, nothing listening yet
    for cluster in (None, False):
        t = RedisTier(server.url, cluster=cluster, connect_timeout=0.3, reconnect_s=0.05, max_reconnect_s=0.2)
        assert t.get(keys(2)) == [None, None] and t.put(keys(1), [b"x"]) == [False]
        s = t.stats()
        assert s.state == "degraded" and s.down_misses == 2 and s.errors >= 1 and t.cluster is cluster
        t.close()
    t = RedisTier(server.url, connect_timeout=0.3, reconnect_s=0.05, max_reconnect_s=0.2)
    server.start()
    try:
        wait_connected(t)
        assert t.cluster is False
        assert t.put(keys(2), [payload(0), payload(1)]) == [True, True] and t.get(keys(2)) == [payload(0), payload(1)]
    finally:
        t.close()
        server.stop(kill=True)


def test_frozen_server_times_out_as_misses(redis_server: RedisServer):
    t = RedisTier(redis_server.url, socket_timeout=0.3, connect_timeout=0.3)
    assert t.put(keys(2), [payload(0), payload(1)]) == [True, True]
    redis_server.signal(signal.SIGSTOP)
    try:
        assert t.get(keys(2)) == [None, None]
        assert t.contains(keys(2)) == 0
        assert t.put(keys(1, start=5), [payload(5)]) == [False]
        assert t.stats().errors == 1 and "Timeout" in str(t.stats().last_error)  # then degraded: no more waits
    finally:
        redis_server.signal(signal.SIGCONT)
    wait_connected(t)
    assert t.get(keys(2)) == [payload(0), payload(1)]
    t.close()


def test_server_side_eviction_is_a_miss(tmp_path: Path):
    require_redis()
    args = ("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    with RedisServer(tmp_path, args=args) as server:
        t = RedisTier(server.url)
        n, size = 200, 65536
        for start in range(0, n, 10):  # 12.5 MiB into a 4 MiB server
            assert t.put(keys(10, start=start), [payload(i, size) for i in range(start, start + 10)]) == [True] * 10
        got = t.get(keys(n))
        assert all(g == payload(i, size) for i, g in enumerate(got) if g is not None)
        assert got[-1] == payload(n - 1, size)  # the latest block is there, most older ones are not
        assert t.contains(keys(n)) == next(i for i, g in enumerate(got) if g is None)
        s = t.stats()
        assert s.misses > n // 2 and s.errors == 0 and s.evictions is None and s.corrupt_dropped == 0
        t.close()


def test_corrupt_and_foreign_values_are_misses_and_deleted(redis_server: RedisServer):
    t = RedisTier(redis_server.url)
    raw = raw_client(redis_server.url)
    ks = keys(4)
    assert t.put(ks, [payload(i) for i in range(4)]) == [True] * 4
    blob = bytearray(raw.get(redis_key(ks[0])))
    blob[200] ^= 1
    raw.set(redis_key(ks[0]), bytes(blob))
    raw.set(redis_key(ks[1]), encode_blob(key(1, NS_B), payload(1)))  # another model's block
    raw.set(redis_key(ks[2]), b"garbage")
    raw.set(redis_key(ks[3]), version1_blob(ks[3], payload(3)))  # format 1 (sha256), a previous release's
    ks.append(key(4))
    assert t.put(ks[4:], [payload(4)]) == [True]
    assert t.get(ks) == [None, None, None, None, payload(4)]
    assert [raw.exists(redis_key(k)) for k in ks] == [0, 0, 0, 0, 1]
    assert t.stats().corrupt_dropped == 4 and t.stats().errors == 0
    raw.close()
    t.close()


def test_two_processes_share_blocks(redis_server: RedisServer, tmp_path: Path):
    writer = (
        "import sys; from kvhal.tiers import RedisTier; from tests.tiers.conftest import keys, payload\n"
        "t = RedisTier(sys.argv[1]); print(t.put(keys(30), [payload(i, 65536) for i in range(30)]).count(True))"
    )
    reader = (
        "import sys; from kvhal.tiers import RedisTier; from tests.tiers.conftest import keys\n"
        "t = RedisTier(sys.argv[1]); got = t.get(keys(30)); print(t.contains(keys(31)))\n"
        "open(sys.argv[2], 'wb').write(b''.join(got))"
    )
    run = dict(cwd=ROOT, capture_output=True, text=True, check=True)
    assert subprocess.run([sys.executable, "-c", writer, redis_server.url], **run).stdout == "30\n"  # type: ignore[call-overload]
    out = tmp_path / "read.bin"
    assert subprocess.run([sys.executable, "-c", reader, redis_server.url, str(out)], **run).stdout == "30\n"  # type: ignore[call-overload]
    assert out.read_bytes() == b"".join(payload(i, 65536) for i in range(30))


def test_unix_socket(tmp_path: Path):
    require_redis()
    sock = tmp_path / "r.sock"
    with RedisServer(tmp_path, args=("--unixsocket", str(sock), "--unixsocketperm", "700")):
        t = RedisTier(f"unix://{sock}")
        assert not t.cluster
        assert t.put(keys(3), [payload(i) for i in range(3)]) == [True] * 3
        assert t.get(keys(3)) == [payload(i) for i in range(3)] and t.contains(keys(4)) == 3
        t.close()


class TLSRedisServer(RedisServer):
    """redis-server answering only TLS on its port (self-signed certificate made by openssl)."""

    def __init__(self, workdir: Path) -> None:
        cert, key = workdir / "cert.pem", workdir / "key.pem"
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        port = free_port()
        tls = ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
               "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
        super().__init__(workdir, port=port, args=tls)
        self.cert = cert

    def ping(self) -> bool:
        import socket
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.cert))
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def test_tls(tmp_path: Path):
    require_redis()
    if shutil.which("openssl") is None:
        unavailable("openssl not installed: needed to make the test's TLS certificate")
    with TLSRedisServer(tmp_path) as server:
        t = RedisTier(f"rediss://127.0.0.1:{server.port}?ssl_ca_certs={server.cert}")
        assert t.put(keys(2), [payload(0), payload(1)]) == [True, True]
        assert t.get(keys(3)) == [payload(0), payload(1), None] and t.stats().errors == 0
        t.close()
        t = RedisTier(f"rediss://127.0.0.1:{server.port}")  # a server it cannot verify: degraded, not raised
        assert t.get(keys(1)) == [None] and t.stats().state == "degraded" and t.stats().errors == 1
        t.close()


def test_arguments_and_unreachable_server():
    require_redis()
    for bad, match in [
        ("http://127.0.0.1:1", "redis://, rediss:// or unix://"),
        ("127.0.0.1:6379", "redis://, rediss:// or unix://"),
        (b"redis://x", "must be a str"),
        ("redis://127.0.0.1:port", "malformed"),
        ("redis://127.0.0.1:1/abc", "db number"),  # redis-py would drop the db
        ("redis://127.0.0.1:1/3/4", "db number"),  # ... or read it as db 34
        ("unix://", "names no socket"),
        # options redis-py fails on only when it connects: a TypeError out of every call, or a false outage
        ("redis://127.0.0.1:1?sockettimeout=1", "option redis cannot use"),
        ("unix:///tmp/x.sock?foo=1", "option redis cannot use"),
        ("rediss://127.0.0.1:1?ssl_cert_reqs=bogus", "option redis cannot use"),
        ("redis://127.0.0.1:1?protocol=9", "option redis cannot use"),
        ("redis://127.0.0.1:1?decode_responses=True", "blocks are bytes"),  # each get: a UnicodeDecodeError
    ]:
        with pytest.raises(kvhal.TierError, match=match):
            RedisTier(bad)  # type: ignore[arg-type]
    for kw in (
        {"socket_timeout": 0},
        {"socket_timeout": True},
        {"connect_timeout": float("nan")},
        {"connect_timeout": 2**2000},  # beyond float: a TierError, not OverflowError
        {"cluster": 1},
    ):
        with pytest.raises(kvhal.TierError):
            RedisTier("redis://127.0.0.1:1", **kw)  # type: ignore[arg-type]
    with pytest.raises(kvhal.TierError, match="over TCP"):
        RedisTier("unix:///tmp/x.sock", cluster=True)
    # numpy's numbers are numbers; a db path redis-py reads as db 0 is one
    RedisTier("redis://127.0.0.1:1/0/", socket_timeout=np.float32(0.5), connect_timeout=np.int64(1)).close()
    RedisTier("redis://127.0.0.1:1?client_name=kv&socket_timeout=2", cluster=False).close()  # options it takes
    RedisTier("redis://127.0.0.1:1?read_from_replicas=true", cluster=True).close()  # a Cluster's own option
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    for kw in ({"reconnect_s": 0}, {"max_reconnect_s": "1"}):
        with pytest.raises(kvhal.TierError, match="reconnect"):
            RedisTier(url, **kw)  # type: ignore[arg-type]
    for cluster in (None, False, True):  # starts degraded, never fails to start; each call a miss
        t = RedisTier(url, cluster=cluster, connect_timeout=0.5, reconnect_s=60)
        assert t.get(keys(2)) == [None, None] and t.put(keys(1), [b"x"]) == [False] and t.contains(keys(1)) == 0
        assert t.stats().errors == 1 and t.stats().state == "degraded"
        t.close()
    t = RedisTier(url, cluster=False)
    t.close()
    with pytest.raises(kvhal.TierError, match="closed"):
        t.client()  # as every other call on a closed tier


def test_cluster_round_trip_one_slot_per_model(redis_cluster: str):
    t = RedisTier(redis_cluster, socket_timeout=10.0, connect_timeout=10.0)  # CI cores are busy: no spurious timeout
    assert t.cluster  # found out by asking the server
    a, b = keys(8), keys(8, ns=NS_B)
    data_a = [payload(i, 20000) for i in range(8)]
    data_b = [payload(100 + i, 20000) for i in range(8)]
    assert t.put(a + b, data_a + data_b) == [True] * 16, t.stats().last_error
    mixed = [a[0], b[0], a[1], b[1], key(50)]
    got = t.get(mixed)
    assert got == [data_a[0], data_b[0], data_a[1], data_b[1], None], t.stats().last_error
    assert t.contains(a) == 8 and t.contains(b[:3] + [key(60, NS_B)]) == 3
    assert t.delete(a[4:]) == 4 and t.contains(a) == 4
    import redis

    raw = redis.cluster.RedisCluster.from_url(redis_cluster)
    assert len({raw.keyslot(redis_key(k)) for k in a}) == 1
    assert {raw.keyslot(redis_key(k)) for k in a} != {raw.keyslot(redis_key(k)) for k in b}
    raw.close()
    s = t.stats()
    assert (s.errors, s.hits, s.misses, s.puts) == (0, 4, 1, 16)
    t.close()
