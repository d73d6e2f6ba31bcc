"""``kvhal tiers bench``: put/get GB/s and blocks/s per tier, each next to its raw ceiling measured in the same run.

Ceilings move the same payload bytes in the same batches with nothing of kvhal in the way:
disk put ("append+fsync"): one file appended sequentially with an fsync per ``COMMIT_BYTES`` (the tier's default
group-commit batch) and one at the end of the writes. The tier at its defaults ("disk") and with ``durable=False``
("disk-nosync") are held to it, 0.5 and 0.8. disk-nosync's put is also shown next to the same append without any
fsync ("append", no target): that ceiling only copies into the page cache, which the tier's checksum pass cannot
keep up with on one core. Disk get ("read"): the tier's own segment files read sequentially from the device, one
read of a record (header and block) at a time into a new bytes object kept until the run ends, as the tier's
caller keeps what ``get`` returns. It reads the very blocks the tier reads, where they lie: how this VM's disk laid
out and cached a file decided more than the reader did (in one run the tier read its fsynced segments at 1.3-1.8x a
separate file written the same way, and its no-fsync ones at 0.55-0.75x theirs). The page cache is dropped for the
files before each read pass. redis ("SET"/"GET"): pipelined SET / GET of values of the block size through the same
client library and server, the values read kept likewise. The host tier has no ceiling.
Each row shows its ceiling, the ratio to it and the target it is held to (disk 0.5, disk-nosync 0.8, redis 0.5).
Figures are medians of ``repeats`` runs after one warm-up run. Within a run the tier and its references take turns
batch by batch, so other work on the machine slows them alike and the ratios stay comparable; a disk get and its
ceiling read the same pages, so they take turns pass by pass instead, in alternating order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import KVHalError
from ..progress import progress
from ..tiers.base import Tier
from ..tiers.disk import COMMIT_BYTES, DiskTier
from ..tiers.host import HostTier
from ..tiers.keys import BlockKey
from ..tiers.redis_tier import RedisTier
from ..tiers.segments import RECORD_HEADER
from .output import output_path, write_json
from .tiers_server import RedisServer, redis_server_path

TIERS = ("host", "disk", "redis")
TARGETS = {"disk": 0.5, "disk-nosync": 0.8, "redis": 0.5}  # of the ceiling, put and get
Times = tuple[float, float]  # put, get seconds
# a figure: tier label, op (0 put, 1 get), the tier's arm, the ceiling's arm (None: none) and name, held to a target
Figure = tuple[str, int, int, int | None, str, bool]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        n = int(t[:-1]) * UNITS[t[-1]] if t and t[-1] in UNITS else int(t)
    except ValueError:
        n = 0
    if n <= 0:
        raise KVHalError(f"size {text!r} is not a positive byte count such as 65536, 64K or 64M")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tiers_cmd", required=True)
    b = sub.add_parser("bench", help="put/get GB/s per tier next to the raw disk / Redis ceiling")
    b.add_argument("--tier", action="append", choices=TIERS, help="tier to run (repeatable; default: all)")
    b.add_argument("--block-sizes", default="16K,64K,256K", help="comma list of block sizes")
    b.add_argument("--total", default="64M", help="bytes moved per figure (default 64M)")
    b.add_argument("--batch", type=int, default=32, help="blocks per put/get call (default 32)")
    b.add_argument("--repeats", type=int, default=3, help="runs per figure, median reported (default 3)")
    b.add_argument(
        "--disk-path",
        help="directory for the disk tier and its references (default: system temp); holds 3 x total per run "
        "until the bench ends",
    )
    b.add_argument("--redis", default="auto", help="redis URL, 'auto' (start a private redis-server) or 'none'")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("-o", "--output", help="also write the JSON result to this file")


def _drop_page_cache(paths: list[str]) -> None:
    """Evict these files' clean pages so the next read comes from the device (no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Workload:
    """``n`` random blocks of ``block`` bytes, moved in calls of ``batch`` blocks."""

    def __init__(self, block: int, total: int, batch: int) -> None:
        self.block = block
        self.n = max(batch, total // block)
        buf = os.urandom(block * self.n)
        self.payloads = [buf[i * block : (i + 1) * block] for i in range(self.n)]
        self.batches = [range(i, min(i + batch, self.n)) for i in range(0, self.n, batch)]


class Arm(ABC):
    """One way of moving the workload: ``put``/``get`` one batch (timed), the rest untimed."""

    def __init__(self, w: Workload) -> None:
        self.w = w

    @abstractmethod
    def put(self, b: range) -> None: ...

    @abstractmethod
    def get(self, b: range) -> None: ...

    def before_get(self) -> None:
        pass

    def finish(self) -> None:
        pass


class TierArm(Arm):
    """``files``: the disk tier's directory; its files stay until the bench ends (see ``run``)."""

    def __init__(self, w: Workload, tier: Tier, files: Path | None = None) -> None:
        super().__init__(w)
        self.tier, self.files = tier, files
        self.got: list[bytes | memoryview | None] = []
        ns = os.urandom(32)  # fresh keys every run: nothing is already there
        self.keys = [BlockKey(ns, hashlib.sha256(i.to_bytes(8, "little")).digest()) for i in range(w.n)]

    def put(self, b: range) -> None:
        self.tier.put([self.keys[i] for i in b], [self.w.payloads[i] for i in b])
        if b.stop == self.w.n and isinstance(self.tier, DiskTier) and self.tier.durable is not False:
            self.tier.flush()  # the last writes durable too, as the ceiling's

    def before_get(self) -> None:
        if self.files and isinstance(self.tier, DiskTier):
            self.tier.flush()  # (durable=False: dirty pages cannot be dropped)
            _drop_page_cache([str(p) for p in self.files.glob("seg-*.kvs")])

    def get(self, b: range) -> None:
        self.got += self.tier.get([self.keys[i] for i in b])

    def finish(self) -> None:
        if self.got != self.w.payloads:
            raise KVHalError(f"{type(self.tier).__name__} returned wrong or missing blocks: {self.tier.stats()}")
        self.got = []
        if not self.files:
            self.tier.delete(self.keys)


class DiskCeiling(Arm):
    """One file appended sequentially with an fsync per ``sync_bytes`` and after the last write (None: no fsync);
    its get is ``SegmentsCeiling``'s."""

    def __init__(self, w: Workload, root: Path, name: str, sync_bytes: int | None) -> None:
        super().__init__(w)
        self.path, self.sync_bytes = str(root / name), sync_bytes
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.unsynced = 0

    def put(self, b: range) -> None:
        for i in b:
            self.unsynced += os.write(self.fd, self.w.payloads[i])
        if self.sync_bytes is not None and (self.unsynced >= self.sync_bytes or b.stop == self.w.n):
            os.fsync(self.fd)
            self.unsynced = 0

    def get(self, b: range) -> None:
        pass

    def finish(self) -> None:
        os.close(self.fd)


class SegmentsCeiling(Arm):
    """The tier's segment files (once its puts are flushed) read in file order from the device, one read of a
    record (header and block) per block into a new bytes object, kept until the pass ends."""

    def __init__(self, w: Workload, tier: DiskTier) -> None:
        super().__init__(w)
        self.tier = tier
        self.fds: list[int] = []
        self.got: list[bytes] = []

    def put(self, b: range) -> None:
        pass

    def before_get(self) -> None:
        self.tier.flush()  # (dirty pages cannot be dropped)
        paths = sorted(str(p) for p in self.tier.path.glob("seg-*.kvs"))
        _drop_page_cache(paths)
        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        for fd in self.fds:  # the tier's own read hint
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def get(self, b: range) -> None:
        for _ in b:
            rec = b""
            while self.fds and not (rec := os.read(self.fds[0], RECORD_HEADER + self.w.block)):
                os.close(self.fds.pop(0))
            self.got.append(rec)  # (past the last segment: b"", which finish() reports)

    def finish(self) -> None:
        for fd in self.fds:
            os.close(fd)
        if [g[RECORD_HEADER:] for g in self.got] != self.w.payloads:
            raise KVHalError("the disk ceiling read back other bytes than the tier's segments hold")
        self.got = []


class RedisCeiling(Arm):
    """Pipelined SET / GET of values of the block size, through the tier's own client (library, pool, server);
    the values read are kept until the run ends, as the tier's caller keeps what ``get`` returns."""

    def __init__(self, w: Workload, client: Any) -> None:
        super().__init__(w)
        self.client = client
        self.keys = [f"kvhal-bench:{{raw}}:{i}" for i in range(w.n)]
        self.got: list[bytes] = []

    def put(self, b: range) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in b:
            pipe.set(self.keys[i], self.w.payloads[i])
        pipe.execute()

    def get(self, b: range) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in b:
            pipe.get(self.keys[i])
        self.got += pipe.execute()

    def finish(self) -> None:
        self.client.delete(*self.keys)
        if self.got != self.w.payloads:
            raise KVHalError("the redis ceiling read back other bytes than it wrote")


def _interleaved(arms: list[Arm], get_passes: bool = False, flip: bool = False) -> list[Times]:
    """(put, get) seconds per arm; batch by batch the arms take turns, in rotating order, so a machine busy with
    other work slows each of them alike. ``get_passes``: each arm gets every block in one pass, the arms one after
    the other (reversed with ``flip``), each pass after its own ``before_get`` (arms that read the same pages)."""
    put, get = [0.0] * len(arms), [0.0] * len(arms)
    batches = arms[0].w.batches

    def turns(phase: str, acc: list[float], order: list[int]) -> None:
        for j, b in enumerate(batches):
            for k in [order[(j + r) % len(order)] for r in range(len(order))]:
                step = getattr(arms[k], phase)
                t = time.perf_counter()
                step(b)
                acc[k] += time.perf_counter() - t

    turns("put", put, list(range(len(arms))))
    if get_passes:  # each pass's blocks let go after it: every pass reads into memory the one before freed
        for k in reversed(range(len(arms))) if flip else range(len(arms)):
            arms[k].before_get()
            turns("get", get, [k])
            arms[k].finish()
    else:
        for arm in arms:
            arm.before_get()
        turns("get", get, list(range(len(arms))))
        for arm in arms:
            arm.finish()
    return list(zip(put, get))


def _rows(w: Workload, runs: list[list[Times]], figures: list[Figure]) -> list[dict[str, Any]]:
    """Median GB/s of each figure's tier arm and ceiling arm, with the ratio and, where held to one, its target."""
    out = []
    for label, op, t, c, ceiling_name, held in figures:
        gbps, ceiling = (
            w.n * w.block / statistics.median(r[k][op] for r in runs) / 1e9 if k is not None else None for k in (t, c)
        )
        assert gbps is not None
        ratio = gbps / ceiling if ceiling else None
        target = TARGETS.get(label) if held else None
        out.append(
            {
                "tier": label,
                "block_bytes": w.block,
                "op": ("put", "get")[op],
                "gbps": gbps,
                "blocks_per_s": gbps * 1e9 / w.block,
                "ceiling": ceiling_name if c is not None else None,
                "ceiling_gbps": ceiling,
                "ratio": ratio,
                "target": target,
                "meets_target": None if ratio is None or target is None else ratio >= target,
            }
        )
    return out


@contextmanager
def redis_url(choice: str, workdir: Path) -> Iterator[str | None]:
    if choice == "none":
        yield None
    elif choice == "auto":
        with RedisServer(workdir / "redis") as server:
            yield server.url
    else:
        yield choice


def run(
    tiers: list[str],
    block_sizes: list[int],
    total: int,
    batch: int,
    repeats: int,
    disk_path: Path,
    redis: str | None,
    show_progress: bool = True,
) -> dict[str, Any]:
    rows = []
    root = Path(tempfile.mkdtemp(prefix="kvhal-tiers-bench-", dir=disk_path))
    redis_tier = RedisTier(redis, cluster=False) if "redis" in tiers and redis else None
    client = redis_tier.client() if redis_tier else None  # the tier's own client: same library, same pool
    jobs = [(t, bs) for bs in block_sizes for t in tiers if t != "redis" or redis_tier]
    try:
        for name, bs in progress(jobs, len(jobs), "tiers bench", show_progress):
            w = Workload(bs, total, batch)
            layout: dict[str, list[Figure]] = {  # arms: as listed in the loop below
                "host": [("host", 0, 0, None, "", False), ("host", 1, 0, None, "", False)],
                "disk": [
                    ("disk", 0, 0, 1, "append+fsync", True),
                    ("disk", 1, 0, 2, "read", True),
                    ("disk-nosync", 0, 3, 1, "append+fsync", True),
                    ("disk-nosync", 0, 3, 4, "append", False),
                    ("disk-nosync", 1, 3, 5, "read", True),
                ],
                "redis": [("redis", 0, 0, 1, "SET", True), ("redis", 1, 0, 1, "GET", True)],
            }
            runs = []
            for r in range(repeats + 1):  # the first run warms up (threads, page cache, server) and is dropped
                if name == "host":
                    with HostTier(2 * w.n * bs) as host:
                        runs.append(_interleaved([TierArm(w, host)]))
                elif name == "disk":
                    run_dir = root / f"{name}-{bs}-{r}"
                    run_dir.mkdir()
                    budget = 2 * w.n * (bs + 4096)
                    with (
                        DiskTier(run_dir / "tier", budget) as disk,
                        DiskTier(run_dir / "nosync", budget, durable=False) as nosync,
                    ):
                        arms = [
                            TierArm(w, disk, run_dir / "tier"),
                            DiskCeiling(w, run_dir, "ceiling.bin", COMMIT_BYTES),
                            SegmentsCeiling(w, disk),
                            TierArm(w, nosync, run_dir / "nosync"),
                            DiskCeiling(w, run_dir, "nosync.bin", None),
                            SegmentsCeiling(w, nosync),
                        ]
                        runs.append(_interleaved(arms, get_passes=True, flip=r % 2 == 1))
                else:
                    assert redis_tier is not None
                    runs.append(_interleaved([TierArm(w, redis_tier), RedisCeiling(w, client)]))
            rows += _rows(w, runs[1:], layout[name])
    finally:
        if redis_tier:
            redis_tier.close()
        shutil.rmtree(root, ignore_errors=True)
    machine = {"machine": platform.machine(), "cores": os.cpu_count(), "disk_path": str(disk_path)}
    machine["redis"] = redis or "none"
    params = {"total_bytes": total, "batch": batch, "repeats": repeats}
    return {"machine": machine, "params": params, "rows": rows}


def table(result: dict[str, Any]) -> str:
    m, p = result["machine"], result["params"]
    lines = [
        f"machine: {m['machine']}, {m['cores']} cores; disk: {m['disk_path']}; redis: {m['redis']}; "
        f"{p['total_bytes'] >> 20} MiB per figure in calls of {p['batch']} blocks, median of {p['repeats']}",
        f"{'tier':<11} {'block':>6} {'op':<4} {'GB/s':>7} {'blocks/s':>9} {'ceiling':>12} {'GB/s':>7} {'ratio':>6} "
        f"{'target':>6}",
    ]

    def opt(x: float | None, fmt: str) -> str:
        return format(x, fmt) if x else "-"

    for r in result["rows"]:
        lines.append(
            f"{r['tier']:<11} {str(r['block_bytes'] >> 10) + 'K':>6} {r['op']:<4} {r['gbps']:>7.3f} "
            f"{r['blocks_per_s']:>9.0f} {r['ceiling'] or '-':>12} {opt(r['ceiling_gbps'], '.3f'):>7} "
            f"{opt(r['ratio'], '.2f'):>6} "
            f"{opt(r['target'], '.1f'):>6}" + ("" if r["meets_target"] is not False else "  BELOW TARGET")
        )
    return "\n".join(lines)


def _check_reachable(url: str) -> None:
    """The bench measures a server: one that does not answer is an error here, not a tier of misses."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except (redis.RedisError, OSError, ValueError) as e:
        raise KVHalError(f"--redis {url}: no Redis answers there ({e}); start one or pass --redis auto") from None
    finally:
        client.close()


def main(args: argparse.Namespace) -> int:
    tiers = list(dict.fromkeys(args.tier or TIERS))
    sizes = [parse_size(s) for s in args.block_sizes.split(",") if s.strip()]
    total = parse_size(args.total)
    if not sizes:
        raise KVHalError("--block-sizes needs at least one size, such as 64K")
    if total < max(sizes):
        raise KVHalError(f"--total {args.total} is less than one block of {max(sizes)} bytes; move at least one")
    if args.batch < 1 or args.repeats < 1:
        raise KVHalError("--batch and --repeats must be >= 1")
    output_path(args.output)
    disk_path = Path(args.disk_path or tempfile.gettempdir())
    try:
        tempfile.TemporaryDirectory(dir=disk_path).cleanup()  # what run() makes there (access() passes root)
    except OSError:
        raise KVHalError(f"--disk-path {disk_path} is not a writable directory; create it or pick another") from None
    if "redis" in tiers and (args.redis == "none" or (args.redis == "auto" and redis_server_path() is None)):
        why = (
            "--redis none" if args.redis == "none" else "--redis auto needs redis-server (apt-get install redis-server)"
        )
        if args.tier:
            raise KVHalError(f"cannot bench the redis tier: {why}; pass --redis URL")
        tiers.remove("redis")
        print(f"kvhal: redis tier skipped: {why}", file=sys.stderr)
    with (
        tempfile.TemporaryDirectory(prefix="kvhal-redis-") as work,
        redis_url(args.redis if "redis" in tiers else "none", Path(work)) as url,
    ):
        if url is not None and args.redis != "auto":
            _check_reachable(url)
        result = run(tiers, sizes, total, args.batch, args.repeats, disk_path, url, not args.json)
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
