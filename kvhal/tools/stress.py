"""``kvhal stress``: drive a cache past its advertised capacity and audit every byte it still holds.

Many sequences at once: prefills that first ask the prefix cache, decode appends of random lengths,
forks (page-aligned and not), middle removals, evictions, frees, all past the point where blocks run
out. Rows are a pure function of (token, position, layer), so the audit knows the exact bytes every
surviving token must have (the numpy quantizer is the oracle) and checks them after every step through
``read_blocks``, together with the accounting (used + free = total, tokens, shared blocks, page lists).
Any mismatch is a lost token: the run stops and reports the step and seed to replay it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..cache import KVCache
from ..errors import CapacityError
from ..eviction import EvictionResult, EvictOnFull, SinkWindow
from ..fingerprint import Fingerprint
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
    """The expected state: per sequence its tokens and, per layer, the quantized bytes of every row."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.spec = cache.spec
        self.k: dict[int, list[np.ndarray]] = {}  # seq -> per layer uint8 [n, H, k_row_bytes]
        self.v: dict[int, list[np.ndarray]] = {}
        self.toks: dict[int, list[int]] = {}

    def add(self, s: int, tokens: list[int]) -> None:
        spec = self.spec
        self.toks[s] = list(tokens)
        self.k[s], self.v[s] = [], []
        for layer in range(spec.n_layers):
            k, v = rows(tokens, 0, layer, spec.n_kv_heads, spec.head_dim)
            self.k[s].append(spec.k_fmt.quantize(k))
            self.v[s].append(spec.v_fmt.quantize(v))

    def extend(self, s: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[s][layer] = np.concatenate([self.k[s][layer], self.spec.k_fmt.quantize(k)])
        self.v[s][layer] = np.concatenate([self.v[s][layer], self.spec.v_fmt.quantize(v)])

    def select(self, s: int, t: int, idx: np.ndarray, tail: bool = True) -> None:
        """Sequence ``t`` now holds ``s``'s positions ``idx`` (ascending; a layer keeps those it has).
        ``tail``: token ids appended past the stored rows stay, after the kept ones (not for a copy)."""
        n = max(len(x) for x in self.k[s])
        toks = self.toks[s]
        self.k[t] = [x[idx[idx < len(x)]] for x in self.k[s]]
        self.v[t] = [x[idx[idx < len(x)]] for x in self.v[s]]
        self.toks[t] = [toks[i] for i in idx.tolist() if i < len(toks)] + (toks[n:] if tail else [])

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
        if not held:
            return ""
        ids = np.unique(held)
        raw = c.backend.read_blocks(c.pools, ids)
        where = {int(b): i for i, b in enumerate(ids.tolist())}
        kb, vb = spec.page_nbytes("k"), spec.page_nbytes("v")
        bs = spec.block_size
        for s in c.seqs:
            blocks = c.block_ids(s)
            if len(blocks) != math.ceil(max(x.shape[0] for x in self.k[s]) / bs):
                return f"sequence {s}: {len(blocks)} pages for {max(x.shape[0] for x in self.k[s])} tokens"
            if c.tokens(s) != self.toks[s]:
                return f"sequence {s}: token ids differ from those appended"
            rows_idx = np.array([where[b] for b in blocks], np.int64)
            for layer in range(spec.n_layers):
                at = layer * (kb + vb)
                for which, off, rb, want in (
                    ("K", at, spec.k_row_bytes, self.k[s][layer]),
                    ("V", at + kb, spec.v_row_bytes, self.v[s][layer]),
                ):
                    width = spec.n_kv_heads * bs * rb
                    pages = raw[rows_idx, off : off + width].reshape(len(blocks), spec.n_kv_heads, bs, rb)
                    got = pages.transpose(0, 2, 1, 3).reshape(len(blocks) * bs, spec.n_kv_heads, rb)[: len(want)]
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
    cache = KVCache(spec, capacity_tokens, backend=backend, fingerprint=Fingerprint("kvhal-stress"), on_full=on_full)
    rng = np.random.default_rng(seed)
    audit = _Audit(cache)
    rep = StressReport(
        cache.backend.name, k_format, v_format, seed, steps, advertised_tokens=cache.stats().capacity_tokens
    )
    ops = {k: 0 for k in ("prefill", "append", "fork", "remove", "evict", "free", "observe")}
    t0 = time.perf_counter()
    for step in progress(range(steps), steps, "kvhal stress", show_progress):
        live = cache.seqs
        op = rng.choice(list(ops), p=[0.18, 0.34, 0.1, 0.1, 0.08, 0.12, 0.08]) if live else "prefill"
        try:
            _step(cache, audit, rng, str(op), live, spec)
            ops[str(op)] += 1
        except CapacityError:
            rep.rejected_calls += 1
        why = audit.check()
        st = cache.stats()
        if st.tokens > rep.peak_tokens:
            rep.peak_tokens = st.tokens
            rep.lost_to_rounding_at_peak = _empty_slots(cache)
        rep.steps_run = step + 1
        if why:
            rep.failure = f"step {step} (replay: kvhal stress --seed {seed} --steps {step + 1}): {why}"
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
    return rep


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
        tokens = tokens if len(tokens) >= 2 else [0, 1]
        t, m = cache.match_prefix(tokens)
        audit.add(t, tokens[:m])
        try:
            _store(cache, audit, t, tokens[m:], m, spec)
        except CapacityError:
            cache.free_seq(t)  # the request is refused as a whole
            audit.drop(t)
            raise
    elif op == "append":
        n = int(rng.integers(1, 2 * spec.block_size))
        _store(cache, audit, s, rng.integers(0, VOCAB, n).tolist(), len(audit.toks[s]), spec)
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
        lo = int(rng.integers(0, n + 1))
        hi = int(rng.integers(lo, n + 1))
        cache.seq_rm(s, lo, hi)
        audit.select(s, s, np.r_[np.arange(lo), np.arange(hi, n)])
    elif op == "evict":
        n = max(x.shape[0] for x in audit.k[s])
        res = cache.evict(s, SinkWindow(sinks=int(rng.integers(0, 8))), int(rng.integers(0, n + 1)))
        audit.select(s, s, res.kept)
    elif op == "free":
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
    if rep.failure:
        lines.append(f"  failure: {rep.failure}")
    return "\n".join(lines)
