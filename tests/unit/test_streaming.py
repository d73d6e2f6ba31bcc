"""Block streaming: a sequence far longer than the pools, its host part streamed through a fixed arena."""

from __future__ import annotations

import numpy as np
import pytest

import kvhal
import kvhal.streaming
from tests.oracle import attention_f64

SPEC = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="q8_0", v_format="q4_0", block_size=8)


@pytest.mark.parametrize("through_arena", [False, True], ids=["in_place", "arena"])
def test_a_sequence_longer_than_the_pools_attends_like_a_resident_one(monkeypatch, through_arena):
    """The reference backend's pools are numpy arrays: its host blocks are attended in place; ``arena`` forces
    the copy through the arena that device backends take."""
    if through_arena:
        monkeypatch.setattr(kvhal.streaming, "pools_in_host_memory", lambda pools: False)
    rng = np.random.default_rng(0)
    n = 1000
    k = rng.standard_normal((n, 2, 32), dtype=np.float32)
    v = rng.standard_normal((n, 2, 32), dtype=np.float32)
    small = kvhal.KVCache(SPEC, 64, backend="reference", stream_arena_tokens=48)
    big = kvhal.KVCache(SPEC, 1024, backend="reference")
    nbytes = small.pools.nbytes
    s, r = small.new_seq(), big.new_seq()
    moved = 0
    for start in range(0, n, 40):  # store as it comes, moving the old part to host memory as it grows
        for layer in (0, 1):
            small.store(s, layer, k[start : start + 40], v[start : start + 40])
            big.store(r, layer, k[start : start + 40], v[start : start + 40])
        moved += small.offload(s, keep_tokens=16)
    st = small.stats()
    assert small.seq_len(s) == n and st.offloaded_tokens == moved >= n - 16 - 40 - 8
    host = small.streamer.host_blocks(s)
    assert host is not None and host.in_place is not through_arena and host.n * 8 == moved
    if not through_arena:  # arena-sized host pools, the last one partly filled
        assert len(host.segments) == -(-host.n // 6) and all(p.n_blocks == 6 for p in host.segments)
    assert small.pools.nbytes == nbytes == (64 + 48) * SPEC.bytes_per_token  # device memory never grew
    assert st.capacity_tokens == 64 and st.stream_arena_blocks == 6
    f_k, f_v = SPEC.k_fmt, SPEC.v_fmt
    kd, vd = f_k.dequantize(f_k.quantize(k)), f_v.dequantize(f_v.quantize(v))
    for q_len, causal in ((1, True), (5, True), (3, False)):
        q = rng.standard_normal((q_len, 4, 32), dtype=np.float32)
        got = small.attention(1, q, [s], [q_len], causal=causal, scale=0.2)
        want = big.attention(1, q, [r], [q_len], causal=causal, scale=0.2)
        np.testing.assert_allclose(got, want, atol=1e-6)
        np.testing.assert_allclose(got, attention_f64(q, [kd], [vd], [q_len], causal=causal, scale=0.2), atol=1e-6)


def test_offloaded_sequences_refuse_what_they_cannot_do():
    c = kvhal.KVCache(SPEC, 64, backend="reference", stream_arena_tokens=16)
    s = c.new_seq()
    x = np.ones((40, 2, 32), np.float32)
    for layer in (0, 1):
        c.store(s, layer, x, x)
    assert c.offload(s, keep_tokens=8) == 32 and c.stats().blocks_used == 2 + 1  # arena + the resident block
    q = np.ones((1, 4, 32), np.float32)
    for call in (
        lambda: c.load(s, 0),
        lambda: c.seq_rm(s, 0, 1),
        lambda: c.seq_cp(s, 0, 8),
        lambda: c.evict(s, kvhal.eviction.SinkWindow(), 4),
        lambda: c.save("/tmp/x.kvs", seqs=[s]),
        lambda: c.attention(0, q, [s], window=4),
        lambda: c.attention(0, q, [s], observe=True),
    ):
        with pytest.raises(kvhal.UnsupportedError):
            call()
    plain = kvhal.KVCache(SPEC, 64, backend="reference")
    with pytest.raises(kvhal.SpecError, match="stream_arena_tokens"):
        plain.offload(plain.new_seq())
    for bad in (-1, 1.5, True):
        with pytest.raises(kvhal.SpecError):
            kvhal.KVCache(SPEC, 64, backend="reference", stream_arena_tokens=bad)
    with pytest.raises(kvhal.PositionError):
        c.offload(s, keep_tokens=-1)
    c.free_seq(s)
    assert c.stats().blocks_used == 2 and c.stats().offloaded_tokens == 0


def test_the_streamer_shows_the_arena_and_each_sequences_host_blocks():
    c = kvhal.KVCache(SPEC, 64, backend="reference", stream_arena_tokens=48)
    arena = c.streamer.arena
    assert len(arena) == 6 and len(set(arena)) == 6  # 48 tokens in blocks of 8
    s, t = c.new_seq(), c.new_seq()
    x = np.random.default_rng(0).standard_normal((40, 2, 32), dtype=np.float32)
    for layer in (0, 1):
        c.store(s, layer, x, x)
        c.store(t, layer, x[:8], x[:8])
    assert c.streamer.host_blocks(s) is None  # nothing offloaded yet
    moved = c.offload(s, keep_tokens=8)
    host = c.streamer.host_blocks(s)
    assert host is not None and host.n * 8 == moved == 32
    assert c.streamer.host_blocks(t) is None
    assert not set(arena) & {b for q in c.seqs for b in c.block_ids(q)}  # the arena holds no sequence's page
    with pytest.raises(kvhal.SequenceError):
        c.streamer.host_blocks(99)


def test_an_offload_that_runs_out_of_host_memory_changes_nothing(monkeypatch):
    """The host pools are allocated one arena-full at a time: one that fails after others were written must not
    leave those blocks held (the next offload would append after them, and attention read them twice)."""
    spec = kvhal.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=32, k_format="f16", v_format="f16", block_size=4)
    c = kvhal.KVCache(spec, 64, backend="reference", stream_arena_tokens=8)  # host pools of 2 blocks
    s = c.new_seq()
    x = np.random.default_rng(0).standard_normal((40, 1, 32), dtype=np.float32)
    c.store(s, 0, x, x)
    allocate, calls = c.backend.allocate, []

    def second_fails(spec, n_blocks):
        calls.append(n_blocks)
        if len(calls) == 2:
            raise MemoryError("host memory is full")
        return allocate(spec, n_blocks)

    monkeypatch.setattr(c.backend, "allocate", second_fails)
    with pytest.raises(kvhal.CapacityError, match="no host memory"):
        c.offload(s, keep_tokens=4)
    assert c.streamer.host_blocks(s) is None and c.seq_len(s) == 40 and len(c.block_ids(s)) == 10
    monkeypatch.undo()
    assert c.offload(s, keep_tokens=4) == 36
    q = np.ones((1, 1, 32), np.float32)
    xd = x.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(c.attention(0, q, [s]), attention_f64(q, [xd], [xd], [1]), atol=1e-6)


def test_a_batch_with_an_offloaded_sequence_keeps_the_holes_of_a_per_head_evicted_one():
    """Batched with an offloaded sequence, the whole call takes the streaming path: a resident sequence that AdaKV
    compacted must still not attend the rows its heads dropped."""
    from kvhal.eviction import AdaKV, SnapKV

    c = kvhal.KVCache(SPEC, 256, backend="reference", stream_arena_tokens=16, observe_window=4)
    rng = np.random.default_rng(0)
    a, b = c.new_seq(), c.new_seq()
    x, y = (rng.standard_normal((40, 2, 32), dtype=np.float32) for _ in range(2))
    for layer in (0, 1):
        c.store(a, layer, x, x)
        c.store(b, layer, 3 * y, 3 * y)
        c.attention(layer, rng.standard_normal((8, 4, 32), dtype=np.float32), [b], [8], observe=True)
    c.offload(a, keep_tokens=4)
    c.evict(b, AdaKV(SnapKV(window=4), ceiling=2.0, safeguard=0.1), 16)
    assert any((h[:, 0] < h[:, 1]).any() for h in c.seq_table.get(b).holes.values())
    q = rng.standard_normal((2, 4, 32), dtype=np.float32)
    for layer in (0, 1):
        both = c.attention(layer, q, [a, b], [1, 1])
        np.testing.assert_allclose(both[:1], c.attention(layer, q[:1], [a]), atol=1e-6)
        np.testing.assert_allclose(both[1:], c.attention(layer, q[1:], [b]), atol=1e-6)
