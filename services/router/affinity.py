"""Prefix-affinity routing: send requests that share a prompt prefix to the attention worker
that already holds it in its prefix cache, unless that worker is too much busier than the
least busy one (like Ray Serve LLM's PrefixCacheAffinityRouter). A prefix a router replica has
not seen goes where its first block hashes to, so replicas agree without sharing state. Pure:
no Ray, no HTTP."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from services.engine.block_allocator import block_hash, salt_root
from services.model.kv_cache import BLOCK_SIZE


def _rendezvous(prefix_hash: int, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{prefix_hash}:{worker}".encode(), digest_size=8).digest(), "big")


class PrefixAffinity:
    """Remembers, per chained hash of a prompt's leading full blocks, the worker it went to."""

    def __init__(self, max_blocks: int = 32, capacity: int = 100_000, max_imbalance_tokens: int = 8192):
        self.max_blocks, self.capacity = max_blocks, capacity
        self.max_imbalance_tokens = max_imbalance_tokens  # how much busier than the least busy worker may be
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix hash -> worker, LRU first

    @staticmethod
    def hashes(prompt_ids: Sequence[int], max_blocks: int, cache_salt: str | None = None) -> list[int]:
        """Chained hashes of the prompt's full blocks (the ones a worker can have cached), up to
        the first block holding an id no worker could cache (outside int64: the engine refuses the
        prompt; affinity must not fail on it first)."""
        out, parent = [], salt_root(cache_salt)
        for i in range(min(max_blocks, (len(prompt_ids) - 1) // BLOCK_SIZE)):
            try:
                parent = block_hash(parent, prompt_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            except (OverflowError, TypeError):
                break
            out.append(parent)
        return out

    def choose(
        self, prompt_ids: Sequence[int], outstanding: dict[str, int], cache_salt: str | None = None
    ) -> str | None:
        """The worker holding this prompt's longest cached prefix among `outstanding` (live worker
        -> outstanding tokens), unless it is busier than the least busy by more than
        `max_imbalance_tokens`; None: no preference (the caller takes the least busy)."""
        least = min(outstanding.values())
        hashes = self.hashes(prompt_ids, self.max_blocks, cache_salt)
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner in outstanding and outstanding[owner] - least <= self.max_imbalance_tokens:
                return owner
        if not hashes:
            return None
        # a prefix this router has not seen: the worker its first block hashes to (rendezvous
        # hashing among those not too busy), so every router replica picks the same one without
        # sharing state, and the prefix's later requests find it cached whichever replica serves them
        eligible = sorted(w for w, v in outstanding.items() if v - least <= self.max_imbalance_tokens)
        return max(eligible, key=lambda w: _rendezvous(hashes[0], w))

    def record(self, prompt_ids: Sequence[int], worker: str, cache_salt: str | None = None) -> None:
        """`worker` will hold this prompt's blocks."""
        for h in self.hashes(prompt_ids, self.max_blocks, cache_salt):
            self._owner[h] = worker
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
