"""HostTier and DiskTier against a list-based LRU model: same flags, same hits, same evictions, and the bytes
held (counted in the tier and, for disk, summed over the files on disk) equal the model's, never above budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvhal.tiers import DiskTier, HostTier, Tier, blob_size

from .conftest import key, keys, payload


class LRUModel:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: list[tuple[object, int]] = []  # oldest first
        self.evictions = 0
        self.puts = 0

    def total(self) -> int:
        return sum(s for _, s in self.items)

    def _find(self, k: object) -> int:
        return next((i for i, (kk, _) in enumerate(self.items) if kk == k), -1)

    def put(self, batch: list[tuple[object, int]]) -> list[bool]:
        written = []
        for k, size in batch:
            i = self._find(k)
            if i >= 0:
                self.items.append(self.items.pop(i))
            elif size <= self.max_bytes:
                self.items.append((k, size))
                written.append(k)
                while self.total() > self.max_bytes:
                    old, _ = self.items.pop(0)
                    # a block pushed out by a later block of the same call was never stored
                    self.evictions += old not in written
        self.puts += len({k for k in written if self._find(k) >= 0})
        return [self._find(k) >= 0 for k, _ in batch]

    def get(self, ks: list[object]) -> list[bool]:
        out = []
        for k in ks:
            i = self._find(k)
            out.append(i >= 0)
            if i >= 0:
                self.items.append(self.items.pop(i))
        return out


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("seg-*.kvs"))


# DiskTier evicts by whole segments (a second chance for blocks used since written): its own tests in
# test_disk.py; this exact block-LRU model is the HostTier's
@pytest.mark.parametrize("kind", ["host"])
@pytest.mark.parametrize("seed", range(3))
def test_random_ops_match_the_model(kind: str, seed: int, tmp_path: Path):
    rng = random.Random(seed)
    ks = keys(16)
    data = [payload(i, rng.choice([100, 700, 1500, 3000])) for i in range(16)]
    cost = [len(d) if kind == "host" else blob_size(len(d)) for d in data]
    budget = 6000
    tier: Tier = HostTier(budget) if kind == "host" else DiskTier(tmp_path, budget, workers=4)
    model = LRUModel(budget)
    huge_key, huge = key(99), payload(99, budget + 1)
    for _ in range(250):
        op = rng.random()
        idx = [rng.randrange(16) for _ in range(rng.randint(1, 5))]
        if op < 0.45:
            assert tier.put([ks[i] for i in idx], [data[i] for i in idx]) == model.put([(i, cost[i]) for i in idx])
        elif op < 0.85:
            got = tier.get([ks[i] for i in idx])
            assert [g is not None for g in got] == model.get(idx)
            assert all(g == data[i] for g, i in zip(got, idx) if g is not None)
        elif op < 0.95:
            want = next((n for n, i in enumerate(idx) if model._find(i) < 0), len(idx))
            assert tier.contains([ks[i] for i in idx]) == want
        else:  # larger than the whole budget: refused, nothing evicted
            assert tier.put([huge_key], [huge]) == [False]
        s = tier.stats()
        assert s.bytes_stored == model.total() <= budget
        assert (s.blocks, s.evictions, s.puts) == (len(model.items), model.evictions, model.puts)
        if kind == "disk":
            assert disk_bytes(tmp_path) == model.total()
    tier.close()


@pytest.mark.parametrize("kind", ["host"])
def test_eviction_order_and_exact_budget(kind: str, tmp_path: Path):
    ks = keys(5)
    data = [payload(i, 1000) for i in range(5)]
    one = 1000 if kind == "host" else blob_size(1000)
    tier: Tier = HostTier(3 * one) if kind == "host" else DiskTier(tmp_path, 3 * one)
    assert tier.put(ks[:3], data[:3]) == [True] * 3
    assert tier.stats().bytes_stored == 3 * one  # exactly full
    assert tier.get([ks[0]]) == [data[0]]  # 0 is now the most recent: 1 goes first
    assert tier.put([ks[3]], [data[3]]) == [True]
    assert [tier.contains([k]) for k in ks[:4]] == [1, 0, 1, 1]
    assert tier.put([ks[1]], [data[1]]) == [True]  # evicts 2 (0 was touched before 3 came)
    assert [tier.contains([k]) for k in ks[:4]] == [1, 1, 0, 1]
    assert tier.put([ks[4]], [data[4]]) == [True]  # then 0
    assert [tier.contains([k]) for k in ks] == [0, 1, 0, 1, 1]
    # a call bigger than the budget keeps its last blocks: the first would be pushed out by the fourth
    more = keys(4, start=10)
    assert tier.put(more, [payload(10 + i, 1000) for i in range(4)]) == [False, True, True, True]
    assert tier.contains(more[1:]) == 3 and tier.contains(ks[1:2] + ks[3:5]) == 0
    s = tier.stats()
    assert (s.blocks, s.bytes_stored, s.rejected, s.puts, s.evictions) == (3, 3 * one, 1, 9, 6)
    tier.close()
