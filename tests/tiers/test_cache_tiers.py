"""KVCache with tiers: evicted cached blocks are written down, match_prefix pulls them back; across
process restarts (disk) and between processes (a real redis-server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvhal
from kvhal.tiers import DiskTier, HostTier, RedisTier

ROOT = Path(__file__).resolve().parents[2]
SPEC = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="q8_0", v_format="q4_0", block_size=4)
FP = kvhal.Fingerprint("tier-test")
PROMPT = list(range(300, 326))  # 6 full blocks + 2 tokens


def kv_for(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = [np.random.default_rng([t, i]).standard_normal((2, 2, 32), dtype=np.float32) for i, t in enumerate(tokens)]
    a = np.stack(rows)
    return np.ascontiguousarray(a[:, 0]), np.ascontiguousarray(a[:, 1])


def prefill(c: kvhal.KVCache, tokens: list[int]) -> int:
    s = c.new_seq()
    k, v = kv_for(tokens)
    c.append_tokens(s, tokens)
    for layer in (0, 1):
        c.store(s, layer, k, v)
    return s


def flood(c: kvhal.KVCache) -> None:
    """Store unrelated tokens until every cached block's space has been reused."""
    s = c.new_seq()
    k, v = kv_for(list(range(9000, 9000 + c.n_blocks * 4)))
    for layer in (0, 1):
        c.store(s, layer, k, v)
    c.free_seq(s)


QUERY = np.random.default_rng(3).standard_normal((1, 4, 32), dtype=np.float32)


def test_evicted_blocks_come_back_from_the_host_tier():
    tier = HostTier(max_bytes=1 << 20)
    c = kvhal.KVCache(SPEC, 8 * 4, backend="reference", fingerprint=FP, tiers=[tier])
    a = prefill(c, PROMPT)
    want_k = c.load(a, 1)[0][:24].copy()
    c.free_seq(a)
    flood(c)
    st = c.stats()
    assert st.blocks_cached_free == 0 and st.tier_written_blocks == 6 and tier.stats().blocks == 6
    t, n = c.match_prefix(PROMPT)
    assert n == 24 and c.stats().tier_hit_blocks == 6
    np.testing.assert_array_equal(c.load(t, 1)[0], want_k)
    assert c.match_prefix(PROMPT)[1] == 24 and c.stats().tier_hit_blocks == 6  # now served from the pools


def test_lookup_continues_through_the_tiers_in_order(tmp_path):
    host, disk = HostTier(max_bytes=3 * SPEC.block_nbytes), DiskTier(tmp_path / "disk", max_bytes=1 << 20)
    on_disk = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[disk], write_through=True)
    prefill(on_disk, PROMPT)  # the disk holds blocks 0..5
    in_host = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[host], write_through=True)
    prefill(in_host, PROMPT[:12])  # the host tier holds blocks 0..2
    assert (host.stats().blocks, disk.stats().blocks) == (3, 6)
    c = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[host, disk])
    prefill(c, PROMPT[:8])  # blocks 0, 1 in the pools
    before = (host.stats().hits, disk.stats().hits)
    t, n = c.match_prefix(PROMPT)
    assert n == 24 and c.stats().tier_hit_blocks == 4  # pools: 0, 1; host: 2; disk: 3, 4, 5
    assert (host.stats().hits - before[0], disk.stats().hits - before[1]) == (1, 3)
    np.testing.assert_array_equal(c.load(t, 0)[0], on_disk.load(on_disk.seqs[0], 0)[0][:24])


def test_disk_tier_survives_a_restart_and_drops_corrupt_blocks(tmp_path):
    disk_dir = tmp_path / "kv"
    code = f"""
import sys, numpy as np, kvhal
sys.path.insert(0, {str(ROOT)!r})
from kvhal.tiers import DiskTier
from tests.tiers.test_cache_tiers import SPEC, FP, PROMPT, QUERY, prefill
c = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[DiskTier(sys.argv[1], 1 << 20)],
                  write_through=True)
s = prefill(c, PROMPT)
np.save(sys.argv[2], kvhal.to_numpy(c.attention(1, QUERY, [s], [1])))
"""
    subprocess.run([sys.executable, "-c", code, str(disk_dir), str(tmp_path / "att.npy")], check=True, cwd=ROOT)
    c = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[DiskTier(disk_dir, 1 << 20)])
    t, n = c.match_prefix(PROMPT)
    assert n == 24
    k, v = kv_for(PROMPT)
    for layer in (0, 1):
        c.store(t, layer, k[24:], v[24:])
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(1, QUERY, [t], [1])), np.load(tmp_path / "att.npy"))
    # a segment damaged behind the tier's back (its last block's payload) is a miss, never served
    files = sorted(disk_dir.glob("seg-*.kvs"))
    victim = next(f for f in reversed(files) if f.stat().st_size > 0)
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    c.tiers[0].close()  # one DiskTier per directory at a time
    fresh = DiskTier(disk_dir, 1 << 20)
    c2 = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[fresh])
    t2, n2 = c2.match_prefix(PROMPT)
    assert n2 < 24 and n2 % 4 == 0
    k2 = c2.load(t2, 0)[0]
    np.testing.assert_array_equal(k2, c.load(t, 0)[0][:n2])  # what it did serve is right
    assert fresh.stats().corrupt_dropped >= 1


def test_two_processes_share_a_prefix_through_redis(redis_server):
    code = f"""
import sys, numpy as np, kvhal
sys.path.insert(0, {str(ROOT)!r})
from kvhal.tiers import RedisTier
from tests.tiers.test_cache_tiers import SPEC, FP, PROMPT, QUERY, prefill
c = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[RedisTier(sys.argv[1])], write_through=True)
s = prefill(c, PROMPT)
np.save(sys.argv[2], kvhal.to_numpy(c.attention(0, QUERY, [s], [1])))
"""
    out = Path(redis_server.workdir) / "att.npy"
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    subprocess.run([sys.executable, "-c", code, redis_server.url, str(out)], check=True, cwd=ROOT, env=env)
    c = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=FP, tiers=[RedisTier(redis_server.url)])
    t, n = c.match_prefix(PROMPT)
    assert n == 24 and c.stats().tier_hit_blocks == 6
    k, v = kv_for(PROMPT)
    for layer in (0, 1):
        c.store(t, layer, k[24:], v[24:])
    np.testing.assert_array_equal(kvhal.to_numpy(c.attention(0, QUERY, [t], [1])), np.load(out))
    # another model's cache sees none of it
    other = kvhal.KVCache(SPEC, 64, backend="reference", fingerprint=kvhal.Fingerprint("other"),
                          tiers=[RedisTier(redis_server.url)])
    assert other.match_prefix(PROMPT)[1] == 0
    # the server dies: misses and counted errors, never an exception out of match_prefix or store
    redis_server.stop(kill=True)
    c3 = kvhal.KVCache(SPEC, 8 * 4, backend="reference", fingerprint=FP, tiers=[RedisTier(redis_server.url, cluster=False)])
    t3, n3 = c3.match_prefix(PROMPT)
    assert n3 == 0
    a = prefill(c3, PROMPT)
    c3.free_seq(a)
    flood(c3)  # evictions try to write down to the dead server
    st = c3.stats()
    assert st.tier_unwritten_blocks == 6 and c3.tiers[0].stats().errors >= 1
    redis_server.start()  # it comes back on the same port: the tier works again, after its reconnect backoff
    from .test_redis import wait_connected

    wait_connected(c3.tiers[0])
    c4 = kvhal.KVCache(SPEC, 8 * 4, backend="reference", fingerprint=FP, tiers=[c3.tiers[0]], write_through=True)
    prefill(c4, PROMPT)
    assert c4.stats().tier_written_blocks == 6


def test_tier_arguments_are_checked():
    import pytest

    for bad in ({"tiers": "host"}, {"tiers": [object()]}, {"write_through": True}, {"write_through": 1}):
        with pytest.raises(kvhal.SpecError):
            kvhal.KVCache(SPEC, 16, backend="reference", **bad)


def test_a_closed_tier_is_a_tier_error_that_leaves_the_cache_as_it_was():
    """A tier closed under a live cache: the store that would write a cached block down to it, and a lookup that
    would continue in it, raise TierError before they take a block (they had lost every block taken until then)."""
    tier = HostTier(max_bytes=1 << 20)
    c = kvhal.KVCache(SPEC, 8 * 4, backend="reference", fingerprint=FP, tiers=[tier])
    c.free_seq(prefill(c, PROMPT))  # 6 cached free blocks, 2 never used
    tier.close()
    s = c.new_seq()
    k, v = kv_for(list(range(9000, 9016)))  # 4 blocks: 2 plain, then 2 cached ones to write down
    before = c.stats()
    with pytest.raises(kvhal.TierError, match="closed"):
        c.store(s, 0, k, v)
    with pytest.raises(kvhal.TierError, match="closed"):
        c.match_prefix(PROMPT[:12] + [1, 2, 3, 4, 5])  # 3 blocks in the pools; the rest would be looked up below
    assert c.stats() == before and c.seq_len(s, 0) == 0
    c.tiers = [HostTier(max_bytes=1 << 20)]  # with an open tier, all 8 blocks are there to use
    c.free_seq(s)
    prefill(c, list(range(9000, 9032)))
    assert c.stats().blocks_free == 0 and c.stats().tier_written_blocks == 6


def test_a_closed_write_through_tier_refuses_each_change_before_it_is_made():
    """write_through: a change that would seal a block writes it to the tiers; with one closed, store, store_rows,
    append_tokens, seq_cp and seq_rm raise TierError before they change anything (a store used to write its rows
    and then raise, so a retry stored them twice)."""
    tier = HostTier(max_bytes=1 << 20)
    c = kvhal.KVCache(SPEC, 8 * 4, backend="reference", fingerprint=FP, tiers=[tier], write_through=True)
    s = c.new_seq()
    k, v = kv_for(PROMPT[:6])
    c.append_tokens(s, PROMPT[:8])
    c.store(s, 0, k, v)
    c.store(s, 1, k, v)
    tier.close()
    before, rows = c.stats(), c.load_rows(s, 0)
    calls = [
        lambda: c.store(s, 0, k[:2], v[:2]),
        lambda: c.store_rows(s, 0, *c.load_rows(s, 0, 0, 2)),
        lambda: c.append_tokens(s, [1, 2]),
        lambda: c.seq_cp(s),
        lambda: c.seq_rm(s, 2, 3),
    ]
    for call in calls:
        with pytest.raises(kvhal.TierError, match="closed"):
            call()
    assert c.stats() == before and c.tokens(s) == PROMPT[:8] and [c.seq_len(s, i) for i in (0, 1)] == [6, 6]
    for a, b in zip(c.load_rows(s, 0), rows):
        np.testing.assert_array_equal(a, b)
