"""A private redis-server on a loopback port: for the tests and ``kvhal tiers bench --redis auto``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ..errors import TierError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """``redis-server`` with no persistence (``--save '' --appendonly no``) in ``workdir``, on ``port`` (a free
    one if None; kept across stop/start so clients can reconnect). ``args``: extra server options."""

    def __init__(self, workdir: str | os.PathLike[str], port: int | None = None, args: tuple[str, ...] = ()) -> None:
        exe = redis_server_path()
        if exe is None:
            raise TierError("redis-server is not installed; install it (Debian: apt-get install redis-server)")
        self.exe = exe
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server, or nothing if it runs (``with RedisServer(...).start()`` starts it once: a second
        process would fail to bind the port while the first answered its PING, and the first would be left
        running, no longer this object's)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", *self.args]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the server keeps writing it
        with log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = (self.workdir / "redis.log").read_text(errors="replace").splitlines()
                why = " | ".join(line for line in lines if " # " in line)[-400:]  # its warnings
                raise TierError(f"redis-server on port {self.port} exited at start: {why}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop(kill=True)
        raise TierError(f"redis-server did not answer PING on port {self.port} within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, kill: bool = False) -> None:
        """Shut the server down (SIGTERM), or ``kill=True``: SIGKILL, as a crash."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
