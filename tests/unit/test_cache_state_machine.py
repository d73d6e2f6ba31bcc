"""A stateful property test: random store/seq_rm/seq_cp/seq_keep/free_seq, append_tokens, match_prefix
and save/restore against a dict-of-arrays model.

Stored rows are a pure function of (token id, position, layer), as a model's K/V are of the prefix,
so a sequence ``match_prefix`` builds must load exactly the rows a fresh prefill of its tokens would
store: an independent oracle for every hash, eviction and copy-on-write decision. After every step,
every sequence's load at every layer equals the model, and stats() agrees with it.
250 examples x 24 steps = 6,000 steps per run.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvhal

LAYERS, HEADS, DIM, BS, CAP = 2, 1, 32, 4, 64
SPEC = kvhal.CacheSpec(n_layers=LAYERS, n_kv_heads=HEADS, head_dim=DIM, k_format="q4_0", v_format="f16",
                       block_size=BS)


live = precondition(lambda self: bool(self.model))
TOKENS = st.integers(0, 2)  # a small alphabet: prefixes collide often
SNAPDIR = Path(tempfile.mkdtemp(prefix="kvhal-state-"))


def rows(tokens: list[int], start: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V of positions start.. for these tokens: depends on (token, position, layer) only."""
    out = [np.random.default_rng([t, start + i, layer]).standard_normal((2, HEADS, DIM), dtype=np.float32)
           for i, t in enumerate(tokens)]
    kv = np.stack(out) if out else np.zeros((0, 2, HEADS, DIM), np.float32)
    return np.ascontiguousarray(kv[:, 0]), np.ascontiguousarray(kv[:, 1])


def stored(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return SPEC.k_fmt.dequantize(SPEC.k_fmt.quantize(k)), SPEC.v_fmt.dequantize(SPEC.v_fmt.quantize(v))


class CacheMachine(RuleBasedStateMachine):

    def __init__(self) -> None:
        super().__init__()
        self.cache = kvhal.KVCache(SPEC, CAP, backend="reference", fingerprint=kvhal.Fingerprint("state-machine"))
        self.model: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # seq -> per layer (k, v) as stored
        self.toks: dict[int, list[int]] = {}  # seq -> the token of each position (stored or appended)
        self.appended: dict[int, int] = {}  # seq -> how many of toks were given to append_tokens

    def _empty(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((0, HEADS, DIM), np.float32), np.zeros((0, HEADS, DIM), np.float32)

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model)))

    @initialize()
    def first_seq(self) -> None:
        self.new_seq()

    @rule()
    def new_seq(self) -> None:
        s = self.cache.new_seq()
        self.model[s] = [self._empty() for _ in range(LAYERS)]
        self.toks[s], self.appended[s] = [], 0

    def _tokens_for(self, data: st.DataObject, s: int, upto: int) -> list[int]:
        while len(self.toks[s]) < upto:
            self.toks[s].append(data.draw(TOKENS))
        return self.toks[s]

    @live
    @rule(data=st.data(), n=st.integers(0, 9))
    def append_tokens(self, data: st.DataObject, n: int) -> None:
        s = self._pick(data)
        a = self.appended[s]
        toks = self._tokens_for(data, s, a + n)
        self.cache.append_tokens(s, toks[a : a + n])
        self.appended[s] = a + n

    @rule(data=st.data(), n=st.integers(1, 14))
    def match_prefix(self, data: st.DataObject, n: int) -> None:
        base = self.toks[self._pick(data)] if self.model and data.draw(st.booleans()) else []
        query = (base + data.draw(st.lists(TOKENS, min_size=n, max_size=n)))[: max(n, 1)]
        before = self.cache.stats()
        t, m = self.cache.match_prefix(query)
        assert m % BS == 0 and m <= len(query) - 1 and self.cache.seq_len(t) == m
        assert self.cache.stats().prefix_hit_tokens == before.prefix_hit_tokens + m
        self.model[t] = [stored(*rows(query[:m], 0, lay)) for lay in range(LAYERS)]
        self.toks[t], self.appended[t] = list(query[:m]), m

    @live
    @rule(data=st.data())
    def save_restore(self, data: st.DataObject) -> None:
        picked = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))
        path = SNAPDIR / "state.kvs"
        self.cache.save(path, seqs=picked)
        free = self.cache.stats().blocks_free
        need = len({b for s in picked for b in self.cache.block_ids(s)})
        try:
            new = self.cache.restore(path)
        except kvhal.CapacityError:
            assert need > free
            return
        assert need <= free
        for s, t in zip(picked, new):
            self.model[t] = [(k.copy(), v.copy()) for k, v in self.model[s]]
            self.toks[t], self.appended[t] = list(self.toks[s]), self.appended[s]

    @live
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), n=st.integers(1, 9), all_layers=st.booleans())
    def store(self, data: st.DataObject, layer: int, n: int, all_layers: bool) -> None:
        s = self._pick(data)
        layers = range(LAYERS) if all_layers else [layer]
        for lay in layers:
            L = self.model[s][lay][0].shape[0]
            k, v = rows(self._tokens_for(data, s, L + n)[L : L + n], L, lay)
            free = self.cache.stats().blocks_free
            L = self.model[s][lay][0].shape[0]
            blocks = len(self.cache.block_ids(s))
            new_blocks = max(0, math.ceil((L + n) / BS) - blocks)
            touched = min(blocks, math.ceil((L + n) / BS)) - L // BS
            try:
                self.cache.store(s, lay, k, v)
            except kvhal.CapacityError:
                assert free < new_blocks + touched  # a refusal only when copies could really not fit
                continue
            assert free >= new_blocks  # it did fit
            kq, vq = stored(k, v)
            mk, mv = self.model[s][lay]
            self.model[s][lay] = (np.concatenate([mk, kq]), np.concatenate([mv, vq]))

    @live
    @rule(data=st.data(), p0=st.integers(-1, 14), p1=st.integers(-1, 14))
    def seq_rm(self, data: st.DataObject, p0: int, p1: int) -> None:
        s = self._pick(data)
        if p1 >= 0 and p1 < max(p0, 0):
            with pytest.raises(kvhal.PositionError):
                self.cache.seq_rm(s, p0, p1)
            return
        try:
            self.cache.seq_rm(s, p0, p1)
        except kvhal.CapacityError:
            return
        lo, hi = max(p0, 0), (10**9 if p1 < 0 else p1)
        self.model[s] = [(np.concatenate([k[:lo], k[hi:]]), np.concatenate([v[:lo], v[hi:]])) for k, v in self.model[s]]
        a = self.appended[s]
        self.appended[s] = a - max(0, min(hi, a) - min(lo, a))
        del self.toks[s][lo:hi]

    @live
    @rule(data=st.data(), p0=st.integers(-1, 14), p1=st.integers(-1, 14))
    def seq_cp(self, data: st.DataObject, p0: int, p1: int) -> None:
        s = self._pick(data)
        if p1 >= 0 and p1 < max(p0, 0):
            return
        try:
            t = self.cache.seq_cp(s, p0, p1)
        except kvhal.CapacityError:
            assert max(p0, 0) % BS  # only an unaligned copy allocates
            return
        lo, hi = max(p0, 0), (10**9 if p1 < 0 else p1)
        self.model[t] = [(k[lo:hi].copy(), v[lo:hi].copy()) for k, v in self.model[s]]
        a = self.appended[s]
        self.appended[t] = max(0, min(hi, a) - min(lo, a))
        n_t = max(self.appended[t], max(lay[0].shape[0] for lay in self.model[t]))
        self.toks[t] = self.toks[s][lo:hi][:n_t]

    @live
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.cache.free_seq(s)
        del self.model[s], self.toks[s], self.appended[s]
        with pytest.raises(kvhal.SequenceError):
            self.cache.load(s, 0)

    @live
    @rule(data=st.data())
    def seq_keep(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.cache.seq_keep(s)
        self.model = {s: self.model[s]}
        self.toks, self.appended = {s: self.toks[s]}, {s: self.appended[s]}

    @invariant()
    def loads_match_model(self) -> None:
        for s, layers in self.model.items():
            for lay, (k, v) in enumerate(layers):
                k2, v2 = self.cache.load(s, lay)
                np.testing.assert_array_equal(k2, k)
                np.testing.assert_array_equal(v2, v)

    @invariant()
    def tokens_match_model(self) -> None:
        for s in self.model:
            assert self.cache.tokens(s) == self.toks[s][: self.appended[s]]

    @invariant()
    def hashes_name_their_blocks(self) -> None:
        reg = self.cache.seq_table.allocator
        assert all(b in reg.block_of[h] for b, h in reg.hash_of.items())
        assert sum(map(len, reg.block_of.values())) == len(reg.hash_of)

    @invariant()
    def stats_match_model(self) -> None:
        st_ = self.cache.stats()
        assert st_.n_seqs == len(self.model)
        assert st_.tokens == sum(max(k.shape[0] for k, _ in layers) for layers in self.model.values())
        assert st_.blocks_used + st_.blocks_free == st_.n_blocks == CAP // BS
        # every block a sequence needs is held, and none beyond what some sequence references
        refs = [b for s in self.cache.seqs for b in self.cache.block_ids(s)]
        assert st_.blocks_used == len(set(refs))
        assert st_.blocks_shared == sum(1 for b in set(refs) if refs.count(b) > 1)
        for s in self.cache.seqs:
            assert len(self.cache.block_ids(s)) == math.ceil(self.cache.seq_len(s) / BS)


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVHAL_STATE_EXAMPLES", "250")), stateful_step_count=24, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCache = CacheMachine.TestCase
