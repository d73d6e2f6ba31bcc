"""The prefix cache: hash chains, matching, LRU eviction of cached free blocks, tenant separation."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import kvhal
from kvhal.fingerprint import extra_digest

BS = 4
SPEC = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="q8_0", v_format="q4_0", block_size=BS)


def make(cap: int = 64, model: str = "test-model", **kw) -> kvhal.KVCache:
    return kvhal.KVCache(SPEC, cap, backend="reference", fingerprint=kvhal.Fingerprint(model, **kw))


def kv_for(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """K/V that depend only on the token id and position, as a model's would on the prefix."""
    rows = [np.random.default_rng([t, i]).standard_normal((2, 2, 32), dtype=np.float32) for i, t in enumerate(tokens)]
    arr = np.stack(rows)  # [n, 2 (k/v), heads, dim]
    return np.ascontiguousarray(arr[:, 0]), np.ascontiguousarray(arr[:, 1])


def prefill(c: kvhal.KVCache, tokens: list[int], seq: int | None = None, start: int = 0) -> int:
    s = c.new_seq() if seq is None else seq
    k, v = kv_for(tokens)
    c.append_tokens(s, tokens[start:])
    for layer in range(SPEC.n_layers):
        c.store(s, layer, k[start:], v[start:])
    return s


def independent_chain(fp_digest: bytes, tokens: list[int], extra: bytes = bytes(32)) -> list[bytes]:
    """The documented hash, written out again: sha256(domain, parent, extra, int64 LE ids)."""
    out, parent = [], fp_digest
    for i in range(len(tokens) // BS):
        ids = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[i * BS : (i + 1) * BS])
        parent = hashlib.sha256(b"kvhal-block-v1\0" + parent + extra + ids).digest()
        out.append(parent)
    return out


def test_fingerprint_digest_is_canonical_and_covers_the_spec():
    fp = kvhal.Fingerprint("org/m@abc", extra={"rope_theta": 1e6, "b": [1, 2]})
    want = hashlib.sha256(
        b"kvhal-fingerprint\0"
        + json.dumps(
            {"extra": {"b": [1, 2], "rope_theta": 1000000.0}, "format_version": 1, "model": "org/m@abc"},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
    ).digest()
    assert fp.digest() == want
    assert kvhal.Fingerprint("org/m@abc", extra={"b": [1, 2], "rope_theta": 1e6}).digest() == want  # key order
    other = kvhal.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=32, k_format="q8_0", v_format="q8_0", block_size=BS)
    assert fp.digest(SPEC) != fp.digest(other) != fp.digest()
    for bad in ({"x": float("nan")}, {"x": object()}, {1: "a"}):
        with pytest.raises(kvhal.SpecError):
            kvhal.Fingerprint("m", extra=bad)
    with pytest.raises(kvhal.SpecError):
        kvhal.Fingerprint(3)  # type: ignore[arg-type]
    # any Mapping, nested too, names what the dict of it names (json writes dicts only); a later change to the
    # caller's dict does not reach the fingerprint
    inner = {"b": 1}
    proxied = kvhal.Fingerprint("m", extra={"a": types.MappingProxyType(inner), "t": (1, 2)})
    assert proxied.digest() == kvhal.Fingerprint("m", extra={"a": {"b": 1}, "t": [1, 2]}).digest()
    assert extra_digest({"a": types.MappingProxyType(inner)}) == extra_digest({"a": {"b": 1}})
    inner["b"] = 2
    assert proxied.digest() == kvhal.Fingerprint("m", extra={"a": {"b": 1}, "t": [1, 2]}).digest()
    with pytest.raises(kvhal.SpecError, match="CacheSpec or None"):
        fp.digest(1)  # type: ignore[arg-type]
    with pytest.raises(kvhal.SpecError, match="CacheSpec or None"):
        fp.as_dict("x")  # type: ignore[arg-type]


def test_hash_chain_equals_an_independent_computation():
    c = make()
    tokens = [5, 9, 2, 7, 1, 1, 3, 8, 4, 6]
    s = prefill(c, tokens)
    assert c.seq_table.get(s).hashes == independent_chain(c.root_hash, tokens)
    assert len(c.seq_table.get(s).hashes) == 2 and c.stats().blocks_cached == 2


def test_hashes_equal_across_processes_with_different_hash_seeds():
    code = (
        "import kvhal, numpy as np, sys;"
        "sys.path.insert(0, '.');"
        "from tests.unit.test_prefix_cache import make, prefill;"
        "c = make(); s = prefill(c, [3, 1, 4, 1, 5, 9, 2, 6, 5]);"
        "print(','.join(h.hex() for h in c.seq_table.get(s).hashes))"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
            ).stdout.strip()
        )
    assert len(outs) == 1 and outs.pop().count(",") == 1


def test_block_is_hashed_only_when_every_layer_and_token_is_known():
    c = make()
    s = c.new_seq()
    k, v = kv_for(list(range(8)))
    c.store(s, 0, k, v)  # layer 1 missing
    c.append_tokens(s, list(range(8)))
    assert c.stats().blocks_cached == 0
    c.store(s, 1, k[:5], v[:5])
    assert c.stats().blocks_cached == 1  # block 0 complete; block 1 lacks layer 1
    c.store(s, 1, k[5:], v[5:])
    assert c.stats().blocks_cached == 2
    # tokens after the stores: same result
    t = c.new_seq()
    for layer in (0, 1):
        c.store(t, layer, k, v)
    assert len(c.seq_table.get(t).hashes) == 0
    c.append_tokens(t, np.arange(8))
    assert c.seq_table.get(t).hashes == c.seq_table.get(s).hashes


def test_match_prefix_shares_full_blocks_and_caps_at_len_minus_one():
    c = make()
    tokens = list(range(100, 112))  # 3 full blocks
    a = prefill(c, tokens)
    t, n = c.match_prefix(tokens)  # all 12 cached, but the last token must be recomputed: 2 blocks
    assert n == 8 and c.seq_len(t) == 8 and c.seq_table.get(t).blocks == c.seq_table.get(a).blocks[:2]
    assert c.tokens(t) == tokens[:8]
    u, m = c.match_prefix(tokens + [1, 2, 3])
    assert m == 12
    w, z = c.match_prefix(tokens[:3])  # shorter than one block: a query, no hit, all recomputed
    assert z == 0 and c.seq_len(w) == 0
    st = c.stats()
    assert (st.prefix_queries, st.prefix_hit_blocks, st.prefix_hit_tokens) == (3, 5, 20)
    assert st.prefix_query_tokens == 12 + 15 + 3 and st.prefix_recomputed_tokens == 4 + 3 + 3
    assert st.prefix_miss_blocks == 1  # the 12-token query's third block, withheld by the cap
    # the matched sequence attends exactly like the original over the shared pages
    q = np.random.default_rng(0).standard_normal((1, 4, 32), dtype=np.float32)
    np.testing.assert_array_equal(c.load(u, 1)[0], c.load(a, 1)[0])
    out_u = kvhal.to_numpy(c.attention(0, q, [u]))
    out_a = kvhal.to_numpy(c.attention(0, q, [a]))
    np.testing.assert_array_equal(out_u, out_a)
    # storing after the match leaves the shared prefix as it was
    a_k = c.load(a, 0)[0].copy()
    prefill(c, tokens + [7, 7], seq=t, start=8)  # t stores positions 8.. into its own blocks
    np.testing.assert_array_equal(c.load(a, 0)[0], a_k)
    assert (
        c.seq_table.get(t).hashes[:2] == c.seq_table.get(a).hashes[:2]
        and c.seq_table.get(t).blocks[2] != c.seq_table.get(a).blocks[2]
    )


def test_extra_keys_keep_tenants_apart():
    c = make()
    tokens = list(range(9))
    prefill(c, tokens)
    s = c.new_seq(extra={"lora": "A"})
    k, v = kv_for(tokens)
    c.append_tokens(s, tokens)
    for layer in (0, 1):
        c.store(s, layer, k, v)
    assert c.match_prefix(tokens, extra={"lora": "B"})[1] == 0
    assert c.match_prefix(tokens, extra={"salt": "x"})[1] == 0
    ta, na = c.match_prefix(tokens, extra={"lora": "A"})
    t0, n0 = c.match_prefix(tokens)
    assert na == n0 == 8 and set(c.seq_table.get(ta).blocks).isdisjoint(c.seq_table.get(t0).blocks)
    with pytest.raises(kvhal.SpecError):
        c.new_seq(extra={"lora": object()})


def test_freed_blocks_stay_matchable_and_evict_lru_tail_first():
    c = make(cap=6 * BS)  # 6 blocks
    a_tokens, b_tokens = list(range(0, 12)), list(range(50, 62))
    a = prefill(c, a_tokens)  # blocks 0,1,2
    b = prefill(c, b_tokens)  # blocks 3,4,5
    a_blocks, b_blocks = list(c.seq_table.get(a).blocks), list(c.seq_table.get(b).blocks)
    c.free_seq(a)
    c.free_seq(b)
    st = c.stats()
    assert st.blocks_free == 6 and st.blocks_cached_free == 6 and st.blocks_cached == 6
    # release order: a's tail first, then b's: a2, a1, a0, b2, b1, b0
    assert c.seq_table.allocator.cached_free_lru() == a_blocks[::-1] + b_blocks[::-1]
    t, n = c.match_prefix(b_tokens + [0])
    assert n == 12 and c.stats().blocks_cached_free == 3  # b's blocks are held again
    c.free_seq(t)
    assert c.seq_table.allocator.cached_free_lru() == a_blocks[::-1] + b_blocks[::-1]
    s = c.new_seq()
    k, v = kv_for(list(range(900, 904)))
    c.store(s, 0, k, v)  # one new block: evicts a's tail (a2), not its head
    assert c.stats().prefix_evicted_blocks == 1
    _, n = c.match_prefix(a_tokens + [0])
    assert n == 8  # a0, a1 still match; a2 gone
    assert c.seq_table.allocator.cached_free_lru()[:1] == [b_blocks[2]]


def test_writing_into_a_hashed_block_drops_or_copies_its_hash():
    c = make()
    tokens = list(range(8))
    a = prefill(c, tokens)
    t, n = c.match_prefix(tokens + [99])  # shares both blocks
    assert n == 8
    c.seq_rm(t, 6, -1)  # t now ends inside shared block 1
    k, v = kv_for([1, 2])
    for layer in (0, 1):
        c.store(t, layer, k, v)  # copy-on-write: a's block keeps its bytes and its hash
    assert c.seq_table.get(t).blocks[1] != c.seq_table.get(a).blocks[1]
    m, n = c.match_prefix(tokens + [5])
    assert n == 8
    c.free_seq(m)
    c.free_seq(t)
    c.seq_rm(a, 6, -1)  # a alone holds block 1 now; rewriting it in place must drop its hash
    for layer in (0, 1):
        c.store(a, layer, k, v)
    assert c.stats().prefix_invalidated_blocks == 1
    assert c.match_prefix(tokens + [5])[1] == 4


def test_token_id_validation():
    c = make()
    s = c.new_seq()
    for bad in ("abc", [1.0], [True], [-1], [2**31], np.zeros((2, 2), np.int64), np.zeros(3, np.float32), 5):
        with pytest.raises(kvhal.ShapeError):
            c.append_tokens(s, bad)
        with pytest.raises(kvhal.ShapeError):
            c.match_prefix(bad)
    assert c.tokens(s) == []
    c.append_tokens(s, np.array([1, 2], np.int32))
    c.append_tokens(s, (3,))
    assert c.tokens(s) == [1, 2, 3]


def test_fingerprint_must_be_a_fingerprint():
    with pytest.raises(kvhal.SpecError):
        kvhal.KVCache(SPEC, 16, backend="reference", fingerprint="model")  # type: ignore[arg-type]


def test_a_prefix_filled_twice_survives_evicting_either_copy():
    c = make(cap=8 * BS)
    tokens = list(range(8))
    a = prefill(c, tokens)
    b = prefill(c, tokens)  # the same prefix stored apart: both copies carry the hashes
    assert c.seq_table.get(a).hashes == c.seq_table.get(b).hashes and c.stats().blocks_cached == 4
    c.free_seq(a)  # a's blocks are cached-free, next to be evicted
    filler = c.new_seq()
    k, v = kv_for(list(range(100, 124)))
    for layer in (0, 1):
        c.store(filler, layer, k, v)  # 6 blocks: 4 plain + both of a's cached ones
    assert c.stats().prefix_evicted_blocks == 2
    t, n = c.match_prefix(tokens + [1])
    assert n == 8 and c.seq_table.get(t).blocks == c.seq_table.get(b).blocks
