"""The prefix index: content hashes of full blocks, ``match_prefix``'s lookup, and the tiers below the pools.

A full block whose token ids are known and whose every layer is stored is *sealed*: it gets the hash of
its tokens chained from its predecessor's (the chain's root names the model and the spec's bytes) and
becomes matchable. A cached block whose space is reused is written down to the first tier that takes it
(on the allocator's ``on_evict``; with ``write_through`` as soon as it is sealed), and a lookup that runs
out of cached blocks continues in each tier, pulling hits back into free blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import Backend, Pools
from .blocks import BlockAllocator
from .fingerprint import block_hash, hash_chain
from .seqs import Seq
from .spec import CacheSpec


class PrefixIndex:
    def __init__(
        self,
        spec: CacheSpec,
        backend: Backend,
        pools: Pools,
        allocator: BlockAllocator,
        root_hash: bytes,
        tiers: list[Any],
        write_through: bool,
    ) -> None:
        self.spec, self.backend, self.pools, self.allocator = spec, backend, pools, allocator
        self.root_hash = root_hash  # parent of every chain's first block; changes when scales are calibrated
        self.write_through = write_through
        self.tier_counts = {"hit": 0, "written": 0, "unwritten": 0}
        self.set_tiers(tiers)

    def set_tiers(self, tiers: list[Any]) -> None:
        """The tiers below the pools, in order; a cached block's space is reused only after they were offered it."""
        self.tiers = tiers
        self.allocator.on_evict = self._write_down if tiers else None

    def check_tiers(self, writing: bool = False) -> None:
        """The TierError a closed tier (or one opened by another process) gives, raised before a call changes
        anything; ``writing``: only where a change would write through to the tiers."""
        if writing and not self.write_through:
            return
        for tier in self.tiers:
            tier.contains([])  # checks the tier is usable here, reads nothing

    def seal(self, s: Seq) -> None:
        """Hash every newly complete block of ``s`` (token ids known, every layer stored)."""
        bs = self.spec.block_size
        n_full = min(len(s.tokens), min(s.pages())) // bs
        if s.sealable is not None:
            n_full = min(n_full, s.sealable)
        sealed: list[tuple[int, bytes]] = []
        for i in range(len(s.hashes), n_full):
            parent = s.hashes[-1] if s.hashes else self.root_hash
            h = block_hash(parent, s.tokens[i * bs : (i + 1) * bs], s.extra)
            s.hashes.append(h)
            if i < s.base // bs:  # offloaded before its tokens were known: in host memory, not matchable
                continue
            b = s.blocks[i - s.base // bs]
            self.allocator.register(b, h)
            sealed.append((b, h))
        if self.write_through and sealed:
            self._put_down([b for b, _ in sealed], [h for _, h in sealed])

    def publish(self, named: dict[int, bytes]) -> None:
        """Name blocks whose bytes came from elsewhere (a snapshot's) by their hashes, as ``seal`` names stored ones:
        with ``write_through`` they are put down too, since eviction writes down only blocks not written through."""
        for b, h in named.items():
            self.allocator.register(b, h)
        if self.write_through and named:
            self._put_down(list(named), list(named.values()))

    def match(self, ids: list[int], extra: bytes) -> tuple[list[int], list[bytes]]:
        """The blocks (each acquired once for the caller) of the longest cached prefix of ``ids``, whole
        blocks only and at most ``len(ids) - 1`` tokens (the caller computes the last token's logits), and
        their hashes; counted in the allocator's prefix counters."""
        bs = self.spec.block_size
        usable = max(len(ids) - 1, 0) // bs
        if self.spec.uses_tail:  # as a prefill of all of ids would: its last `tail` tokens stay f16
            usable = min(usable, max(len(ids) - self.spec.tail, 0) // bs)
        if self.spec.sinks:  # a matched block would come without the f16 sink rows its sequence held
            usable = 0
        chain = hash_chain(self.root_hash, ids[: usable * bs], bs, extra)
        blocks = self.allocator.lookup(chain)
        if len(blocks) < len(chain):
            self.check_tiers()  # before any block is taken
        for b in blocks:
            self.allocator.acquire(b)
        if self.tiers and len(blocks) < len(chain):
            blocks += self._pull(chain[len(blocks) :])
        n = len(blocks) * bs
        c = self.allocator.counters
        c.queries += 1
        c.query_tokens += len(ids)
        c.hit_tokens += n
        c.hit_blocks += len(blocks)
        c.miss_blocks += len(ids) // bs - len(blocks)
        c.recomputed_tokens += len(ids) - n
        return blocks, chain[: len(blocks)]

    # -- tiers ---------------------------------------------------------------------------------------

    def _keys(self, hashes: list[bytes]) -> list[Any]:
        from .tiers import BlockKey

        return [BlockKey(self.root_hash, h) for h in hashes]

    def _put_down(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Write blocks to the first tier that takes each (tiers never raise for a store's failure)."""
        data = self.backend.read_blocks(self.pools, np.asarray(blocks, np.int64))
        keys = self._keys(hashes)
        todo = list(range(len(blocks)))
        for tier in self.tiers:
            flags = tier.put([keys[i] for i in todo], [memoryview(data[i]) for i in todo])
            todo = [i for i, ok in zip(todo, flags) if not ok]
            if not todo:
                break
        self.tier_counts["written"] += len(blocks) - len(todo)
        self.tier_counts["unwritten"] += len(todo)

    def _write_down(self, b: int, h: bytes) -> None:
        """A cached block's space is about to be reused: keep its bytes in a tier."""
        if not self.write_through:
            self._put_down([b], [h])

    def _pull(self, hashes: list[bytes]) -> list[int]:
        """Blocks for the leading ``hashes`` found in the tiers, written into free blocks (refcount 1,
        hashed). Stops at the first miss, a bad blob, or when no block is free."""
        out: list[int] = []
        for tier in self.tiers:
            if not hashes:
                break
            keys = self._keys(hashes)
            n = min(tier.contains(keys), self.allocator.n_usable)
            if n == 0:
                continue
            payloads = tier.get(keys[:n])
            good = 0
            while good < n and payloads[good] is not None and len(payloads[good]) == self.spec.block_nbytes:
                good += 1
            if good < n and payloads[good] is not None:  # a blob of the wrong size: never served, dropped
                tier.delete([keys[good]])
            if good == 0:
                continue
            n = min(good, self.allocator.n_usable)
            data = np.stack([np.frombuffer(p, np.uint8) for p in payloads[:n]])  # type: ignore[arg-type]
            ids = self.allocator.alloc(n)
            self.backend.write_blocks(self.pools, np.asarray(ids, np.int64), data)
            for b, h in zip(ids, hashes):
                self.allocator.register(b, h)
            out += ids
            hashes = hashes[n:]
            self.tier_counts["hit"] += n
        return out
