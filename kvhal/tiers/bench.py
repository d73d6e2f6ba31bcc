"""``kvhal tiers bench``: put/get GB/s and blocks/s per tier, each next to its raw ceiling measured in the same run.

Ceilings move the same payload bytes in the same batches with nothing of kvhal in the way:
disk: one file written sequentially with an fsync after every batch (``dd conv=fsync`` per put call), then read
back sequentially, both from the device (the page cache is dropped for the file, as for the tier's files, before
every read); redis: pipelined SET / GET of values of the block size through the same client library and server.
Disk rows also show the tier's own file pattern in plain I/O ("files": one file per block, temp + fsync + rename,
the same number of threads, a directory fsync per call; no header, checksum or index): what kvhal adds on top of
the one-file-per-block layout. The host tier has no ceiling. Figures are medians of ``repeats`` runs after one warm-up run; ceiling and tier
runs alternate.
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import KVHalError
from ..progress import progress
from .base import Tier
from .disk import WORKERS, DiskTier, _fsync_dir
from .host import HostTier
from .keys import BlockKey
from .redis_tier import RedisTier
from .server import RedisServer, redis_server_path

TIERS = ("host", "disk", "redis")
Times = tuple[float, float]  # put, get seconds
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
    b.add_argument("--disk-path", help="directory for the disk tier and its ceiling file (default: system temp)")
    b.add_argument("--redis", default="auto", help="redis URL, 'auto' (start a private redis-server) or 'none'")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("-o", "--output", help="also write the JSON result to this file")


def _batches(n: int, batch: int) -> list[range]:
    return [range(i, min(i + batch, n)) for i in range(0, n, batch)]


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _drop_page_cache(paths: list[str]) -> None:
    """Evict these files' clean pages so the next read comes from the device (no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _settle(*dirs: Path) -> None:
    """Commit the deletions just made under ``dirs`` (and, mounted with ``discard``, their trims) now, untimed,
    rather than in the next timed phase's first fsync."""
    for d in dirs:
        _fsync_dir(str(d))


class Workload:
    def __init__(self, block: int, total: int, batch: int) -> None:
        self.block, self.batch = block, batch
        self.n = max(batch, total // block)
        buf = os.urandom(block * self.n)
        self.payloads = [buf[i * block : (i + 1) * block] for i in range(self.n)]
        self.batches = _batches(self.n, batch)

    def keys(self) -> list[BlockKey]:
        ns = os.urandom(32)  # fresh keys every run: nothing is already there
        return [BlockKey(ns, hashlib.sha256(i.to_bytes(8, "little")).digest()) for i in range(self.n)]

    def tier_run(self, tier: Tier, before_get: Callable[[], None] = lambda: None) -> tuple[float, float]:
        ks, ps = self.keys(), self.payloads
        got: list[bytes | None] = []

        def put() -> None:
            for b in self.batches:
                tier.put([ks[i] for i in b], [ps[i] for i in b])

        def get() -> None:
            for b in self.batches:
                got.extend(tier.get([ks[i] for i in b]))

        put_s = _timed(put)
        before_get()
        get_s = _timed(get)
        if got != ps:
            raise KVHalError(f"{type(tier).__name__} returned wrong or missing blocks: {tier.stats()}")
        tier.delete(ks)
        return put_s, get_s


def disk_ceiling(w: Workload, root: Path) -> tuple[float, float]:
    path = str(root / "ceiling.bin")

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for b in w.batches:
                for i in b:
                    os.write(fd, w.payloads[i])
                os.fsync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, w.block):
                pass
        finally:
            os.close(fd)

    put = _timed(write)
    _drop_page_cache([path])
    get = _timed(read)
    os.unlink(path)
    _settle(root)
    return put, get


def disk_files(w: Workload, root: Path) -> tuple[float, float]:
    d = root / "files"
    d.mkdir()
    paths = [str(d / f"{i}.blk") for i in range(w.n)]

    def write(i: int) -> None:
        fd = os.open(paths[i] + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, w.payloads[i])
        os.fsync(fd)
        os.close(fd)
        os.replace(paths[i] + ".tmp", paths[i])

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        os.read(fd, w.block)
        os.close(fd)

    with ThreadPoolExecutor(WORKERS) as pool:

        def put() -> None:
            for b in w.batches:
                list(pool.map(write, b))
                _fsync_dir(str(d))

        def get() -> None:
            for b in w.batches:
                list(pool.map(read, b))

        put_s = _timed(put)
        _drop_page_cache(paths)
        get_s = _timed(get)
    shutil.rmtree(d)
    _settle(root)
    return put_s, get_s


def disk_tier(w: Workload, root: Path) -> tuple[float, float]:
    d = root / "tier"
    with DiskTier(d, 2 * w.n * (w.block + 4096)) as tier:
        out = w.tier_run(tier, lambda: _drop_page_cache([str(p) for p in d.glob("*/*.kvb")]))
    _settle(*d.iterdir())
    return out


def redis_ceiling(w: Workload, client: Any) -> tuple[float, float]:
    keys = [f"kvhal-bench:{{raw}}:{i}" for i in range(w.n)]

    def put() -> None:
        for b in w.batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.set(keys[i], w.payloads[i])
            pipe.execute()

    def get() -> None:
        for b in w.batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.get(keys[i])
            pipe.execute()

    out = _timed(put), _timed(get)
    client.delete(*keys)
    return out


def _rows(tier: str, w: Workload, runs: list[tuple[Times, Times | None, Times | None]]) -> list[dict[str, Any]]:
    """Median GB/s of the tier, its ceiling and (disk) its plain-file pattern, put and get."""
    out = []
    for j, op in enumerate(("put", "get")):
        gbps = []
        for k in range(3):
            times = [t[j] for r in runs if (t := r[k]) is not None]
            gbps.append(w.n * w.block / statistics.median(times) / 1e9 if times else None)
        tier_gbps, ceiling, files = gbps
        assert tier_gbps is not None
        out.append(
            {
                "tier": tier,
                "block_bytes": w.block,
                "op": op,
                "gbps": tier_gbps,
                "blocks_per_s": tier_gbps * 1e9 / w.block,
                "ceiling_gbps": ceiling,
                "ratio": tier_gbps / ceiling if ceiling else None,
                "files_gbps": files,
                "of_files": tier_gbps / files if files else None,
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
    client = redis_tier._connect() if redis_tier else None  # the tier's own client: same library, same pool
    jobs = [(t, bs) for bs in block_sizes for t in tiers if t != "redis" or redis_tier]
    try:
        for name, bs in progress(jobs, len(jobs), "tiers bench", show_progress):
            w = Workload(bs, total, batch)
            runs: list[tuple[Times, Times | None, Times | None]] = []  # tier, ceiling, files
            for _ in range(repeats + 1):  # the first run warms up (pools, page cache, server) and is dropped
                if name == "host":
                    with HostTier(2 * w.n * bs) as host:
                        runs.append((w.tier_run(host), None, None))
                elif name == "disk":
                    ceiling, files = disk_ceiling(w, root), disk_files(w, root)
                    runs.append((disk_tier(w, root), ceiling, files))
                else:
                    assert redis_tier is not None
                    ceiling = redis_ceiling(w, client)
                    runs.append((w.tier_run(redis_tier), ceiling, None))
            rows += _rows(name, w, runs[1:])
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
        f"{'tier':<6} {'block':>6} {'op':<4} {'GB/s':>7} {'blocks/s':>9} {'ceiling':>8} {'ratio':>6} {'files':>7} "
        f"{'of files':>8}",
    ]

    def opt(x: float | None, fmt: str) -> str:
        return format(x, fmt) if x else "-"

    for r in result["rows"]:
        lines.append(
            f"{r['tier']:<6} {str(r['block_bytes'] >> 10) + 'K':>6} {r['op']:<4} {r['gbps']:>7.3f} "
            f"{r['blocks_per_s']:>9.0f} {opt(r['ceiling_gbps'], '.3f'):>8} {opt(r['ratio'], '.2f'):>6} "
            f"{opt(r['files_gbps'], '.3f'):>7} {opt(r['of_files'], '.2f'):>8}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    tiers = list(dict.fromkeys(args.tier or TIERS))
    sizes = [parse_size(s) for s in args.block_sizes.split(",") if s.strip()]
    if args.batch < 1 or args.repeats < 1:
        raise KVHalError("--batch and --repeats must be >= 1")
    disk_path = Path(args.disk_path or tempfile.gettempdir())
    if not disk_path.is_dir():
        raise KVHalError(f"--disk-path {disk_path} is not a directory; create it or pick another")
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
        result = run(tiers, sizes, parse_size(args.total), args.batch, args.repeats, disk_path, url, not args.json)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
