"""``kvhal stress``: drive a cache past its advertised capacity and audit every byte it still holds.

Many sequences at once: prefills that first ask the prefix cache, decode appends of random lengths,
forks (page-aligned and not), middle removals, evictions, frees, all past the point where blocks run
out. Rows are a pure function of (token, position, layer), so the audit knows the exact bytes every
surviving token must have (the numpy quantizer is the oracle) and checks them after every step through
``read_blocks``, together with the accounting (used + free = total, tokens, shared blocks, page lists).
Any mismatch is a lost token: the run stops and reports the step and seed to replay it.

``tiers`` (host, disk, redis): the cache writes blocks it evicts down to those tiers (the tier written to
rotates each step, so every tier takes blocks) and pulls them back on prefix hits; each tier is wrapped in an
audit that keeps the sha256 of every block it accepted and checks every block it hands back, byte for byte,
and the disk tier's segment files are checked against its budget after every step. ``faults``: the Redis server
the run started is killed (SIGKILL) and restarted on its port, and disk segments are truncated behind the
tier's back, at random steps: tiers must answer misses then, never other bytes.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..cache import KVCache
from ..errors import CapacityError, KVHalError
from ..eviction import EvictionResult, EvictOnFull, SinkWindow
from ..fingerprint import Fingerprint
from ..formats.ggml import round_f16
from ..progress import progress
from ..spec import CacheSpec

VOCAB = 4  # a small vocabulary: prompts share prefixes often


@dataclass
class StressReport:
    backend: str
    k_format: str
    v_format: str
    seed: int
    steps: int
    steps_run: int = 0
    advertised_tokens: int = 0  # capacity_tokens the cache reports
    peak_tokens: int = 0  # most tokens held at once, summed over sequences (shared pages count per sequence)
    lost_to_rounding_at_peak: int = 0  # token slots of used blocks not holding a token, at the peak
    rejected_calls: int = 0  # CapacityError answers
    evictions_called: int = 0  # evict() calls that dropped tokens
    evicted_tokens_called: int = 0
    evicted_tokens_on_full: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_rate: float = 0.0
    prefix_evicted_blocks: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    tokens_lost: int = 0  # must be 0
    tiers: list[str] = field(default_factory=list)
    tier_written_blocks: int = 0  # blocks the cache wrote down to the tiers
    tier_hit_blocks: int = 0  # blocks it pulled back (each checked byte for byte against what was written)
    tier_blocks_checked: int = 0
    tier_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)  # redis_kills, disk_truncations
    failure: str = ""  # what the audit found, with the step and seed
    seconds: float = 0.0
    ops_per_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows(tokens: list[int], start: int, layer: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V rows of positions start.. for these tokens, as a model would compute them."""
    out = np.empty((len(tokens), 2, heads, dim), np.float32)
    for i, t in enumerate(tokens):
        out[i] = np.random.default_rng([t, start + i, layer]).standard_normal((2, heads, dim), dtype=np.float32)
    return out[:, 0], out[:, 1]


class _Audit:
    """The expected state: per sequence its tokens and, per layer, the quantized bytes of every row.

    A cache with an f16 tail (``spec.uses_tail``: a per-channel K format such as kivi4, whose K page is quantized
    once, when its last token arrives) keeps the newest tokens in f16 and only whole blocks in its pages: a
    sequence of ``n`` tokens holds ``paged(n)`` of them in ``paged(n) / block_size`` blocks
    (``TailStore.paged_after``). There the audit keeps each row's f16 value instead (what the cache quantizes a
    page from), derives the pages' bytes from them (per-channel K pages with the format's page codec), checks the
    tail's rows through ``load``, and follows the cache's documented relayout rules when an eviction moves rows
    (``TailStore.keep_rows``)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.spec = cache.spec
        self.tailed = self.spec.uses_tail
        # seq -> per layer uint8 [n, H, k_row_bytes] (with a tail: f32 [n, H, D] holding f16 values)
        self.k: dict[int, list[np.ndarray]] = {}
        self.v: dict[int, list[np.ndarray]] = {}
        self.toks: dict[int, list[int]] = {}
        self.freed: list[list[int]] = []  # token ids of the last sequences freed (prompts that come back)

    def paged(self, n: int) -> int:
        """Tokens of a sequence of ``n`` that the cache holds in its pages (all of them without a tail)."""
        if not self.tailed:
            return n
        return max(0, n - self.spec.tail) // self.spec.block_size * self.spec.block_size

    def _rows(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        if self.tailed:
            return round_f16(k), round_f16(v)
        return spec.k_fmt.quantize(k), spec.v_fmt.quantize(v)

    def add(self, s: int, tokens: list[int]) -> None:
        spec = self.spec
        self.toks[s] = list(tokens)
        self.k[s], self.v[s] = [], []
        for layer in range(spec.n_layers):
            k, v = self._rows(*rows(tokens, 0, layer, spec.n_kv_heads, spec.head_dim))
            self.k[s].append(k)
            self.v[s].append(v)

    def extend(self, s: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        k, v = self._rows(k, v)
        self.k[s][layer] = np.concatenate([self.k[s][layer], k])
        self.v[s][layer] = np.concatenate([self.v[s][layer], v])

    def select(self, s: int, t: int, idx: np.ndarray, tail: bool = True) -> None:
        """Sequence ``t`` now holds ``s``'s positions ``idx`` (ascending; a layer keeps those it has).
        ``tail``: token ids appended past the stored rows stay, after the kept ones (not for a copy)."""
        n = max(len(x) for x in self.k[s])
        toks = self.toks[s]
        if self.tailed:
            kv = [self._relaid(k, v, idx[idx < len(k)]) for k, v in zip(self.k[s], self.v[s])]
            self.k[t], self.v[t] = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.k[t] = [x[idx[idx < len(x)]] for x in self.k[s]]
            self.v[t] = [x[idx[idx < len(x)]] for x in self.v[s]]
        self.toks[t] = [toks[i] for i in idx.tolist() if i < len(toks)] + (toks[n:] if tail else [])

    def _k_pages(self, k: np.ndarray) -> np.ndarray:
        """The per-channel K pages of f16 rows ``k`` [whole pages * bs, H, D]: uint8 [pages, H, page bytes]."""
        spec, bs = self.spec, self.spec.block_size
        assert spec.k_fmt.k_page is not None
        n, H, D = k.shape
        x = np.ascontiguousarray(k.reshape(n // bs, bs, H, D).transpose(0, 2, 1, 3)).reshape(-1, bs, D)
        return spec.k_fmt.k_page.quantize_page(x).reshape(n // bs, H, -1)

    def _relaid(self, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer's f16 rows after the cache keeps old positions ``idx`` at 0.. (``TailStore.keep_rows``): a
        row that stays in the pages keeps its bytes (a per-channel K page: only when it moves whole to a page
        boundary), a page row that leaves them is its dequantized value rounded to f16, a tail row its f16 value."""
        spec, bs = self.spec, self.spec.block_size
        P, new_p = self.paged(len(k)), self.paged(len(idx))
        from_page = idx < P
        deq_v = round_f16(spec.v_fmt.dequantize(spec.v_fmt.quantize(v[:P]))) if P else v[:0]
        nv = v[idx].copy()
        moved = from_page & (np.arange(len(idx)) >= new_p)  # page rows now in the tail
        nv[moved] = deq_v[idx[moved]]
        codec = spec.k_fmt.k_page
        nk = k[idx].copy()
        if codec is None:
            deq_k = round_f16(spec.k_fmt.dequantize(spec.k_fmt.quantize(k[:P]))) if P else k[:0]
            nk[moved] = deq_k[idx[moved]]
            return nk, nv
        H, D = k.shape[1:]
        deq_k = k[:0]
        if P:
            pages = self._k_pages(k[:P]).reshape(P // bs * H, -1)
            x = codec.dequantize_page(pages, bs).reshape(P // bs, H, bs, D)
            deq_k = round_f16(np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(P, H, D))
        keep = ~from_page  # tail rows keep their f16 values
        for first in range(0, new_p, bs):  # pages that move whole to a page boundary keep their bytes
            src = idx[first : first + bs]
            if src[0] % bs == 0 and src[-1] < P and np.array_equal(src, src[0] + np.arange(bs)):
                keep[first : first + bs] = True
        nk[~keep] = deq_k[idx[~keep]]
        return nk, nv

    def drop(self, s: int) -> None:
        del self.k[s], self.v[s], self.toks[s]

    def check(self) -> str:
        """Empty when the cache holds exactly the expected bytes and its accounting adds up."""
        c, spec = self.cache, self.spec
        st = c.stats()
        if st.blocks_used + st.blocks_free != st.n_blocks:
            return f"accounting: {st.blocks_used} used + {st.blocks_free} free != {st.n_blocks} blocks"
        if sorted(c.seqs) != sorted(self.k):
            return f"sequences: cache has {sorted(c.seqs)}, expected {sorted(self.k)}"
        held = [b for s in c.seqs for b in c.block_ids(s)]
        if st.blocks_used != len(set(held)) or st.blocks_shared != sum(1 for b in set(held) if held.count(b) > 1):
            return f"accounting: {st.blocks_used} used / {st.blocks_shared} shared, page lists hold {len(set(held))}"
        expected_tokens = sum(max(x.shape[0] for x in self.k[s]) for s in self.k)
        if st.tokens != expected_tokens:
            return f"accounting: stats says {st.tokens} tokens, the sequences hold {expected_tokens}"
        kb, vb = spec.page_nbytes("k"), spec.page_nbytes("v")
        bs = spec.block_size
        ids = np.unique(held) if held else np.zeros(0, np.int64)
        raw = c.backend.read_blocks(c.pools, ids) if held else None
        where = {int(b): i for i, b in enumerate(ids.tolist())}
        for s in c.seqs:
            blocks = c.block_ids(s)
            n = max(x.shape[0] for x in self.k[s])
            # whole blocks of the tokens in the pages (a tail keeps the rest in f16)
            want_pages = max(math.ceil(self.paged(len(x)) / bs) for x in self.k[s])
            if len(blocks) != want_pages:
                return f"sequence {s}: {len(blocks)} pages for {n} tokens ({want_pages} expected)"
            if c.tokens(s) != self.toks[s]:
                return f"sequence {s}: token ids differ from those appended"
            rows_idx = np.array([where[b] for b in blocks], np.int64)
            for layer in range(spec.n_layers):
                why = self._check_layer(s, layer, raw, rows_idx, layer * (kb + vb), kb)
                if why:
                    return why
        return ""

    def _check_layer(self, s: int, layer: int, raw: Any, rows_idx: np.ndarray, at: int, kb: int) -> str:
        c, spec, bs = self.cache, self.spec, self.spec.block_size
        kx, vx = self.k[s][layer], self.v[s][layer]
        P = self.paged(len(kx))
        if not self.tailed:
            want_k, want_v = kx, vx
        else:
            want_k = kx[:P] if spec.k_paged else spec.k_fmt.quantize(kx[:P])
            want_v = spec.v_fmt.quantize(vx[:P])
            if len(kx) > P:  # the f16 tail: its rows exactly
                k, v = (np.asarray(c.backend.to_numpy(x), np.float32) for x in c.load(s, layer, P, len(kx)))
                for which, got, want in (("K", k, kx[P:]), ("V", v, vx[P:])):
                    bad = np.flatnonzero((got != want).any(axis=(1, 2)))
                    if bad.size:
                        return (
                            f"sequence {s} layer {layer} {which}: {bad.size} token(s) differ, first at position "
                            f"{P + bad[0]} (f16 tail)"
                        )
        H = spec.n_kv_heads
        nb = math.ceil(len(want_k) / bs)
        if not nb:
            return ""
        idx = rows_idx[:nb]
        for which, off, rb, want in (
            ("K", at, spec.k_row_bytes, want_k),
            ("V", at + kb, spec.v_row_bytes, want_v),
        ):
            width = H * bs * rb
            pages = raw[idx, off : off + width].reshape(nb, H, bs, rb)
            if which == "K" and self.tailed and spec.k_paged:  # per-channel pages: compare page by page
                got_p, want_p = pages.reshape(nb, H, bs * rb), self._k_pages(want)
                bad = np.flatnonzero((got_p != want_p).any(axis=(1, 2)))
                if bad.size:
                    return (
                        f"sequence {s} layer {layer} K: {bad.size * bs} token(s) differ, first at position "
                        f"{bad[0] * bs} (a per-channel page)"
                    )
                continue
            got = pages.transpose(0, 2, 1, 3).reshape(nb * bs, H, rb)[: len(want)]
            bad = np.flatnonzero((got != want).any(axis=(1, 2)))
            if bad.size:
                return f"sequence {s} layer {layer} {which}: {bad.size} token(s) differ, first at position {bad[0]}"
        return ""


def run(
    backend: str = "reference",
    k_format: str = "q8_0",
    v_format: str = "q4_0",
    steps: int = 2000,
    seed: int = 0,
    capacity_tokens: int = 512,
    block_size: int = 8,
    n_layers: int = 2,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    show_progress: bool = True,
    tiers: Sequence[str] = (),
    faults: bool = False,
) -> StressReport:
    names = _tier_names(tiers)
    if faults and not names:
        raise KVHalError("--faults injects tier faults: name the tiers too, e.g. --tiers host,disk,redis")
    options: dict[str, Any] = dict(  # the cache's, and what a replay repeats
        backend=backend,
        k_format=k_format,
        v_format=v_format,
        capacity_tokens=capacity_tokens,
        block_size=block_size,
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
    )
    replay = _replay_args(**options, tiers=",".join(names), faults=faults)
    with ExitStack() as stack:
        audited = _make_tiers(names, stack)
        return _run(**options, steps=steps, seed=seed, show_progress=show_progress, audited=audited, faults=faults,
                    replay=replay)  # fmt: skip


# run()'s options and the kvhal stress flag of each (None: run() only); a replay repeats those not at run()'s default
_REPLAY_FLAGS: dict[str, str | None] = {
    "backend": "--backend",
    "k_format": "--k-format",
    "v_format": "--v-format",
    "capacity_tokens": "--capacity",
    "block_size": "--block-size",
    "tiers": "--tiers",
    "faults": "--faults",
    "n_layers": None,
    "n_kv_heads": None,
    "head_dim": None,
}


def _replay_args(**options: Any) -> str:
    """The options of a run that differ from their defaults, as ``kvhal stress`` flags (run()-only ones, which the
    command line does not take, as ``stress.run`` keywords after it)."""
    defaults = inspect.signature(run).parameters
    flags, kwargs = [], []
    for name, value in options.items():
        default = defaults[name].default
        if value == default or (not value and not default):  # tiers: "" and () alike
            continue
        flag = _REPLAY_FLAGS[name]
        if flag is None:
            kwargs.append(f"{name}={value!r}")
        elif isinstance(value, bool):
            flags.append(flag)
        else:
            flags.append(f"{flag} {value}")
    out = "".join(f" {f}" for f in flags)
    return out + (f"; with kvhal.tools.stress.run({', '.join(kwargs)})" if kwargs else "")


def _run(
    backend: str,
    k_format: str,
    v_format: str,
    steps: int,
    seed: int,
    capacity_tokens: int,
    block_size: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    show_progress: bool,
    audited: list[Any],
    faults: bool,
    replay: str = "",
) -> StressReport:
    spec = CacheSpec(
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        k_format=k_format,
        v_format=v_format,
        block_size=block_size,
    )
    # past capacity, the longest sequence is cut to sinks + recent tokens (StreamingLLM), with a record
    on_full = EvictOnFull(SinkWindow(sinks=block_size), keep_tokens=4 * block_size)
    for t in audited:
        t.size(spec.block_nbytes)
    cache = KVCache(
        spec,
        capacity_tokens,
        backend=backend,
        fingerprint=Fingerprint("kvhal-stress"),
        on_full=on_full,
        tiers=list(audited) or None,
    )
    fault_rng = np.random.default_rng([seed, 1])
    rep_faults = {"redis_kills": 0, "disk_truncations": 0}
    rng = np.random.default_rng(seed)
    audit = _Audit(cache)
    rep = StressReport(
        cache.backend.name,
        k_format,
        v_format,
        seed,
        steps,
        advertised_tokens=cache.stats().capacity_tokens,
        tiers=[t.name for t in audited],
    )
    ops = {k: 0 for k in ("prefill", "append", "fork", "remove", "evict", "free", "observe")}
    t0 = time.perf_counter()
    for step in progress(range(steps), steps, "kvhal stress", show_progress):
        live = cache.seqs
        op = rng.choice(list(ops), p=[0.18, 0.34, 0.1, 0.1, 0.08, 0.12, 0.08]) if live else "prefill"
        if audited:
            cache.tiers = audited[step % len(audited) :] + audited[: step % len(audited)]  # each takes blocks in turn
            if faults:
                _inject(audited, fault_rng, rep_faults)
        try:
            _step(cache, audit, rng, str(op), live, spec)
            ops[str(op)] += 1
        except CapacityError:
            rep.rejected_calls += 1
        why = next((p for t in audited if (p := t.problem())), "") or audit.check()
        st = cache.stats()
        if st.tokens > rep.peak_tokens:
            rep.peak_tokens = st.tokens
            rep.lost_to_rounding_at_peak = _empty_slots(cache)
        rep.steps_run = step + 1
        if why:
            rep.failure = f"step {step} (replay: kvhal stress --seed {seed} --steps {step + 1}{replay}): {why}"
            rep.tokens_lost = max(1, _count_lost(why))
            break
    st = cache.stats()
    rep.seconds = time.perf_counter() - t0
    rep.ops = ops
    rep.ops_per_s = rep.steps_run / rep.seconds if rep.seconds else 0.0
    rep.evictions_called = ops["evict"]
    rep.evicted_tokens_called, rep.evicted_tokens_on_full = st.evicted_tokens_called, st.evicted_tokens_on_full
    rep.prefix_query_tokens, rep.prefix_hit_tokens = st.prefix_query_tokens, st.prefix_hit_tokens
    rep.prefix_hit_rate = st.prefix_hit_tokens / st.prefix_query_tokens if st.prefix_query_tokens else 0.0
    rep.prefix_evicted_blocks = st.prefix_evicted_blocks
    rep.tier_written_blocks, rep.tier_hit_blocks = st.tier_written_blocks, st.tier_hit_blocks
    rep.tier_blocks_checked = sum(t.checked for t in audited)
    rep.tier_stats = {t.name: _tier_summary(t) for t in audited}
    rep.faults = rep_faults if faults else {}
    return rep


TIER_NAMES = ("host", "disk", "redis")


def _tier_names(tiers: Sequence[str] | str) -> list[str]:
    if isinstance(tiers, str):
        tiers = [t.strip() for t in tiers.split(",") if t.strip()]
    if not isinstance(tiers, (list, tuple)) or not all(isinstance(t, str) for t in tiers):
        raise KVHalError(f"tiers must be a list of tier names from {TIER_NAMES}, got {tiers!r}")
    bad = [t for t in tiers if t not in TIER_NAMES]
    if bad or len(set(tiers)) != len(tiers):
        raise KVHalError(f"tiers {list(tiers)!r}: each of {', '.join(TIER_NAMES)} at most once, e.g. host,disk,redis")
    return list(tiers)


def _make_tiers(names: list[str], stack: ExitStack) -> list[Any]:
    """The named tiers (a private redis-server for "redis"), each wrapped in an audit; closed by ``stack``."""
    from ..tiers import DiskTier, HostTier, RedisTier, Tier
    from .tiers_server import RedisServer, redis_server_path

    class Audited(Tier):
        def __init__(self, name: str, inner: Any, server: Any = None, root: str | None = None) -> None:
            super().__init__()
            self.name, self.inner, self.server, self.root = name, inner, server, root
            self.sums: dict[Any, bytes] = {}
            self.checked = 0
            self.bad = ""
            self.budget = 0

        def size(self, block_nbytes: int) -> None:
            """Budgets in blocks of the run's spec (disk: segments of 4 blocks, room for 48)."""
            if self.root is not None:
                self.budget = 48 * (block_nbytes + 88)
                self.inner = stack.enter_context(
                    DiskTier(self.root, self.budget, segment_bytes=4 * (block_nbytes + 88), workers=1)
                )
            elif self.name == "host":
                self.inner = stack.enter_context(HostTier(16 * block_nbytes))

        def problem(self) -> str:
            if self.bad:
                return self.bad
            if self.root is not None:
                on_disk = sum(e.stat().st_size for e in os.scandir(self.root) if e.name.startswith("seg-"))
                if on_disk > self.budget:
                    return f"disk tier: {on_disk} bytes of segments, over its budget of {self.budget}"
            return ""

        def _contains(self, keys: list[Any]) -> int:
            return int(self.inner.contains(keys))

        def _get(self, keys: list[Any]) -> list[Any]:
            out = self.inner.get(keys)
            for k, p in zip(keys, out):
                if p is not None:
                    self.checked += 1
                    if hashlib.sha256(p).digest() != self.sums.get(k):
                        self.bad = (
                            f"{self.name} tier: block {k.block_hash.hex()[:16]} read back other bytes than written"
                        )
            return list(out)

        def _put(self, keys: list[Any], payloads: list[Any]) -> list[bool]:
            flags = list(self.inner.put(keys, payloads))
            for k, p, ok in zip(keys, payloads, flags):
                if ok:
                    self.sums.setdefault(k, hashlib.sha256(p).digest())
            return flags

        def _delete(self, keys: list[Any]) -> int:
            return int(self.inner.delete(keys))

        def _usage(self) -> tuple[int | None, int | None]:
            s = self.inner.stats()
            return s.blocks, s.bytes_stored

    out = []
    work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvhal-stress-"))
    for name in names:
        if name == "host":
            out.append(Audited("host", None))
        elif name == "disk":
            out.append(Audited("disk", None, root=os.path.join(work, "disk")))
        else:
            if redis_server_path() is None:
                raise KVHalError(
                    "--tiers redis starts a private redis-server: install it (apt-get install redis-server)"
                )
            server = stack.enter_context(RedisServer(os.path.join(work, "redis")))
            tier = stack.enter_context(
                RedisTier(
                    server.url,
                    cluster=False,
                    socket_timeout=0.5,
                    connect_timeout=0.5,
                    reconnect_s=0.01,
                    max_reconnect_s=0.05,
                )
            )
            out.append(Audited("redis", tier, server=server))
    return out


def _inject(tiers: list[Any], rng: np.random.Generator, counts: dict[str, int]) -> None:
    """Faults at random steps: the Redis server killed (SIGKILL) and, some steps later, restarted on its port
    (empty: it keeps nothing); a disk segment cut to a random length behind the tier's back."""
    for t in tiers:
        if t.server is not None:
            alive = t.server.proc is not None and t.server.proc.poll() is None
            if alive and rng.random() < 0.01:
                t.server.stop(kill=True)
                counts["redis_kills"] += 1
            elif not alive and rng.random() < 0.2:
                try:
                    t.server.start()
                except KVHalError:  # its port briefly taken (a client's reconnect can self-connect to it): later
                    pass
        if t.root is not None and rng.random() < 0.005:
            segs = sorted(e.path for e in os.scandir(t.root) if e.name.startswith("seg-"))
            if segs:
                victim = segs[int(rng.integers(len(segs)))]
                os.truncate(victim, int(rng.integers(0, os.path.getsize(victim) + 1)))
                counts["disk_truncations"] += 1


def _tier_summary(t: Any) -> dict[str, Any]:
    s = t.inner.stats()
    keep = ("hits", "misses", "puts", "evictions", "corrupt_dropped", "errors", "state", "down_misses")
    return {k: getattr(s, k) for k in keep}


def _empty_slots(cache: KVCache) -> int:
    """Token slots of held blocks that hold no token of any sequence (page rounding, fragmentation)."""
    bs = cache.spec.block_size
    filled: dict[int, int] = {}
    for s in cache.seqs:
        n = cache.seq_len(s)
        for i, b in enumerate(cache.block_ids(s)):
            filled[b] = max(filled.get(b, 0), min(bs, n - i * bs))
    return sum(bs - f for f in filled.values())


def _count_lost(why: str) -> int:
    words = why.split(":")[-1].split()
    return int(words[0]) if words and words[0].isdigit() else 1


def _step(cache: KVCache, audit: _Audit, rng: np.random.Generator, op: str, live: list[int], spec: CacheSpec) -> None:
    s = int(rng.choice(live)) if live else -1
    if op == "prefill":  # a new request: reuse what the prefix cache has, store the rest
        n = int(rng.integers(2, 6 * spec.block_size))
        tokens = rng.integers(0, VOCAB, n).tolist() if rng.random() < 0.5 or not live else audit.toks[s][:n]
        if cache.tiers and audit.freed and rng.random() < 0.5:  # a prompt seen before: its blocks may be in a tier
            tokens = audit.freed[int(rng.integers(len(audit.freed)))][:n]
        tokens = tokens if len(tokens) >= 2 else [0, 1]
        t, m = cache.match_prefix(tokens)
        audit.add(t, tokens[:m])
        try:
            _store(cache, audit, t, tokens[m:], m, spec)
        except CapacityError:
            if t in audit.toks:  # the request is refused as a whole
                cache.free_seq(t)
                audit.drop(t)
            raise
    elif op == "append":
        n = int(rng.integers(1, 2 * spec.block_size))
        _store(cache, audit, s, rng.integers(0, VOCAB, n).tolist(), len(audit.toks[s]), spec)
    elif op == "fork" and audit.tailed:  # the cache copies only a whole sequence with an f16 tail
        n = max(x.shape[0] for x in audit.k[s])
        t = cache.seq_cp(s, 0, -1)
        audit.select(s, t, np.arange(n), tail=False)
    elif op == "fork":
        n = max(x.shape[0] for x in audit.k[s])
        lo = (
            int(rng.integers(0, n + 1))
            if rng.random() < 0.5
            else int(rng.integers(0, n // spec.block_size + 1)) * spec.block_size
        )
        hi = int(rng.integers(lo, n + 1))
        t = cache.seq_cp(s, lo, hi)
        audit.select(s, t, np.arange(lo, hi), tail=False)
    elif op == "remove":
        n = max(x.shape[0] for x in audit.k[s])
        if audit.tailed:  # with an f16 tail the cache removes only a suffix within the tail
            lo, hi = int(rng.integers(max(audit.paged(len(x)) for x in audit.k[s]), n + 1)), n
        else:
            lo = int(rng.integers(0, n + 1))
            hi = int(rng.integers(lo, n + 1))
        cache.seq_rm(s, lo, hi)
        audit.select(s, s, np.r_[np.arange(lo), np.arange(hi, n)])
    elif op == "evict":
        n = max(x.shape[0] for x in audit.k[s])
        res = cache.evict(s, SinkWindow(sinks=int(rng.integers(0, 8))), int(rng.integers(0, n + 1)))
        audit.select(s, s, res.kept)
    elif op == "free":
        audit.freed = [*audit.freed[-63:], audit.toks[s]]
        cache.free_seq(s)
        audit.drop(s)
    elif op == "observe":
        n = cache.seq_len(s, 0)
        if n:
            q = rng.standard_normal((1, 2 * spec.n_kv_heads, spec.head_dim), dtype=np.float32)
            cache.attention(0, q, [s], [1], observe=True)


def _store(cache: KVCache, audit: _Audit, s: int, tokens: list[int], start: int, spec: CacheSpec) -> None:
    """Store the rows of ``tokens`` at positions start.. on every layer (an eviction on full may shift them)."""
    if not tokens:
        return
    results: list[EvictionResult] = []
    prev = cache.on_evict
    cache.on_evict = results.append
    try:
        cache.append_tokens(s, tokens)
        audit.toks[s].extend(tokens)
        for layer in range(spec.n_layers):
            k, v = rows(tokens, start, layer, spec.n_kv_heads, spec.head_dim)
            before = len(results)
            try:
                cache.store(s, layer, k, v)
            finally:
                for r in results[before:]:  # evictions the store made: the audit follows them
                    audit.select(r.seq, r.seq, r.kept)
            audit.extend(s, layer, k, v)
    except CapacityError:
        # as an engine would: roll the step back to the positions every layer holds, token ids included
        keep = min(cache.seq_len(s, layer) for layer in range(spec.n_layers))
        if audit.tailed and keep < max(audit.paged(len(x)) for x in audit.k[s]):
            # with an f16 tail, quantized pages cannot be removed back: the engine drops the request instead
            cache.free_seq(s)
            audit.drop(s)
            raise
        cache.seq_rm(s, keep, -1)
        audit.select(s, s, np.arange(keep), tail=False)
        raise
    finally:
        cache.on_evict = prev


def text(rep: StressReport) -> str:
    ok = "ok" if not rep.failure else "FAILED"
    lines = [
        f"kvhal stress: {rep.backend} {rep.k_format}/{rep.v_format}, seed {rep.seed}, {rep.steps_run}/{rep.steps} steps: {ok}",
        f"  advertised capacity     {rep.advertised_tokens} tokens",
        f"  peak tokens held        {rep.peak_tokens} ({rep.peak_tokens / max(rep.advertised_tokens, 1):.1%} of advertised)",
        f"  lost to page rounding   {rep.lost_to_rounding_at_peak} token slots at the peak",
        f"  rejected calls          {rep.rejected_calls} (CapacityError)",
        f"  evicted tokens          {rep.evicted_tokens_called} by evict() in {rep.evictions_called} calls, "
        f"{rep.evicted_tokens_on_full} on full",
        f"  prefix hit rate         {rep.prefix_hit_rate:.1%} ({rep.prefix_hit_tokens}/{rep.prefix_query_tokens} tokens), "
        f"{rep.prefix_evicted_blocks} cached blocks reused",
        f"  tokens lost             {rep.tokens_lost}",
        f"  throughput              {rep.ops_per_s:.0f} ops/s (audit included)",
        "  ops                     " + ", ".join(f"{k} {v}" for k, v in rep.ops.items()),
    ]
    if rep.tiers:
        lines.append(
            f"  tiers                   {','.join(rep.tiers)}: {rep.tier_written_blocks} blocks written down, "
            f"{rep.tier_hit_blocks} pulled back, {rep.tier_blocks_checked} checked byte for byte"
        )
        for name, st in rep.tier_stats.items():
            lines.append(f"    {name:<6} " + ", ".join(f"{k} {v}" for k, v in st.items()))
    if rep.faults:
        lines.append("  faults                  " + ", ".join(f"{k} {v}" for k, v in rep.faults.items()))
    if rep.failure:
        lines.append(f"  failure: {rep.failure}")
    return "\n".join(lines)
