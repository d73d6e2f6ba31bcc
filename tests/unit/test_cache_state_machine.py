"""A stateful property test: random store/seq_rm/seq_cp/seq_keep/free_seq against a dict-of-arrays model.

After every step, every sequence's load at every layer equals the model, and stats() agrees with it.
100 examples x 20 steps = 2,000 steps per run.
"""

from __future__ import annotations

import math

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


class CacheMachine(RuleBasedStateMachine):

    def __init__(self) -> None:
        super().__init__()
        self.cache = kvhal.KVCache(SPEC, CAP, backend="reference")
        self.model: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # seq -> per layer (k, v) as stored
        self.rng = np.random.default_rng(0)

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

    @live
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), n=st.integers(1, 9), all_layers=st.booleans())
    def store(self, data: st.DataObject, layer: int, n: int, all_layers: bool) -> None:
        s = self._pick(data)
        layers = range(LAYERS) if all_layers else [layer]
        for lay in layers:
            k = self.rng.standard_normal((n, HEADS, DIM), dtype=np.float32)
            v = self.rng.standard_normal((n, HEADS, DIM), dtype=np.float32)
            free = self.cache.stats().blocks_free
            L = self.model[s][lay][0].shape[0]
            blocks = len(self.cache._seqs[s].blocks)
            new_blocks = max(0, math.ceil((L + n) / BS) - blocks)
            touched = min(blocks, math.ceil((L + n) / BS)) - L // BS
            try:
                self.cache.store(s, lay, k, v)
            except kvhal.CapacityError:
                assert free < new_blocks + touched  # a refusal only when copies could really not fit
                continue
            assert free >= new_blocks  # it did fit
            kq = SPEC.k_fmt.dequantize(SPEC.k_fmt.quantize(k))
            vq = SPEC.v_fmt.dequantize(SPEC.v_fmt.quantize(v))
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

    @live
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.cache.free_seq(s)
        del self.model[s]
        with pytest.raises(kvhal.SequenceError):
            self.cache.load(s, 0)

    @live
    @rule(data=st.data())
    def seq_keep(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.cache.seq_keep(s)
        self.model = {s: self.model[s]}

    @invariant()
    def loads_match_model(self) -> None:
        for s, layers in self.model.items():
            for lay, (k, v) in enumerate(layers):
                k2, v2 = self.cache.load(s, lay)
                np.testing.assert_array_equal(k2, k)
                np.testing.assert_array_equal(v2, v)

    @invariant()
    def stats_match_model(self) -> None:
        st_ = self.cache.stats()
        assert st_.n_seqs == len(self.model)
        assert st_.tokens == sum(max(k.shape[0] for k, _ in layers) for layers in self.model.values())
        assert st_.blocks_used + st_.blocks_free == st_.n_blocks == CAP // BS
        # every block a sequence needs is held, and none beyond what some sequence references
        refs = [b for seq in self.cache._seqs.values() for b in seq.blocks]
        assert st_.blocks_used == len(set(refs))
        assert st_.blocks_shared == sum(1 for b in set(refs) if refs.count(b) > 1)
        for seq in self.cache._seqs.values():
            assert len(seq.blocks) == math.ceil(max(seq.lens) / BS)


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCache = CacheMachine.TestCase
