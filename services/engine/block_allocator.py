"""The paged cache's block allocator, with automatic prefix caching.

Blocks are shared between requests with a common prompt prefix: a full block's identity is the
chained hash of its tokens and everything before them, as in vLLM. DeepSeek-V4's state blocks
(`kv_cache.V4Cache`) are attached to blocks while some sequence still reads their recent tokens
(`BlockAllocator.hold_state`). The cache tensors themselves are the model's (services/model/kv_cache.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


class BlockAllocator:
    """Cache blocks and their reuse across requests (automatic prefix caching). Pure bookkeeping;
    the scheduler owns one.

    A block is free, in use (reference counted: sequences sharing a cached prefix share its
    blocks), or cached: unreferenced but still holding the latent rows of a known token prefix,
    found by the chained hash of that prefix's blocks (`block_hash`) and reused until the space is
    needed (least recently freed first). Only full blocks whose rows are all computed are ever
    registered, and a registered block is never written again: shared blocks are immutable.
    With `caching` off, freed blocks go straight back to the free list.

    DeepSeek-V4's state blocks (`num_state_blocks` > 0) are attached to blocks: a block holds one
    while sequences hold it (`hold_state`, reference counted), keeps it after they let go while
    the block is cached (least recently released first, taken back when the pool runs out) so a
    prefix hit can resume from it, and loses it when the block itself is freed or evicted.
    """

    def __init__(self, num_blocks: int, caching: bool = True, num_state_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.caching = num_blocks, caching
        self._free_states = list(range(num_state_blocks - 1, -1, -1))
        self._state_of: dict[int, int] = {}  # block -> its state block
        self.block_states = torch.full(
            (num_blocks if num_state_blocks else 0,), -1, dtype=torch.int32
        )  # the same
        self._state_refs: dict[int, int] = {}  # block -> sequences holding its state
        self._idle_states: OrderedDict[int, None] = OrderedDict()  # cached blocks' unheld states, LRU first
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # block in use -> sequences holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._by_hash: dict[int, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody references."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (referenced or not)."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n fresh (private, writable) blocks; evicts the least recently freed cached ones when
        the free list runs out."""
        if n > self.num_free:
            raise MemoryError(f"KV cache: asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self._drop_state(b)
                self.evictions += 1
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def reserve(self) -> int:
        """Take a block out of circulation for good (a scratch block); the capacity shrinks by one."""
        (b,) = self.allocate(1)
        del self._refs[b]
        self.num_blocks -= 1
        return b

    def unreserve(self, block: int) -> None:
        """Give a `reserve`d block back."""
        self.num_blocks += 1
        self._free.append(block)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones become cached (if registered) or free."""
        for b in blocks:
            if not _last_ref(self._refs, b, "KV cache: block {} freed twice or never allocated"):
                continue
            if b in self._hash_of:
                self._cached[b] = None
            else:
                self._drop_state(b)
                self._free.append(b)

    # ---- prefix caching -----------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (a sequence's chained block
        hashes, in order); takes a reference to each."""
        hit = []
        if self.caching:
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                hit.append(b)
        for b in hit:
            if b in self._cached:
                del self._cached[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1
        return hit

    def register(self, block: int, block_hash: int) -> None:
        """Record that in-use `block` now holds the full, computed prefix `block_hash` (a prefix
        already cached elsewhere keeps its first block; this one stays private). DeepSeek-V4: a
        cached copy whose state block was taken back gives way to this one, which has its state,
        so that prefix hits can resume there again."""
        if not self.caching or block in self._hash_of:
            return
        old = self._by_hash.get(block_hash)
        if old is not None and old not in self._state_of and block in self._state_of:
            del self._hash_of[old]  # the old copy: private to its holders, or free
            if old in self._cached:
                del self._cached[old]
                self._free.append(old)
            old = None
        if old is None:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    # ---- DeepSeek-V4 state blocks ----------------------------------------------------------
    @property
    def num_free_states(self) -> int:
        """State blocks `hold_state` can attach: free ones and cached blocks' unheld ones."""
        return len(self._free_states) + len(self._idle_states)

    def state(self, block: int) -> int:
        """The state block attached to `block` (-1: none; `block_states[block]` as a tensor)."""
        return self._state_of.get(block, -1)

    def hold_state(self, blocks: list[int]) -> None:
        """Take a reference to each block's state block, attaching a fresh one (taken from the
        least recently released cached block when none is free) where it has none. The caller
        checks `num_free_states` first for the blocks that have none."""
        for b in blocks:  # first the blocks that have one: taking back states spares these
            if b in self._state_of:
                self._idle_states.pop(b, None)
                self._state_refs[b] = self._state_refs.get(b, 0) + 1
        for b in blocks:
            if b in self._state_of:
                continue
            if not self._free_states:
                if not self._idle_states:
                    raise MemoryError("KV cache: no state block free")
                self._drop_state(next(iter(self._idle_states)))
            self._state_of[b] = self._free_states.pop()
            self.block_states[b] = self._state_of[b]
            self._state_refs[b] = 1

    def release_state(self, blocks: list[int]) -> None:
        """Drop one reference to each block's state block; an unheld one stays attached (idle) if
        its block is registered, for prefix hits, and goes back to the pool otherwise."""
        for b in blocks:
            if not _last_ref(self._state_refs, b, "KV cache: state of block {} released twice or never held"):
                continue
            if b in self._hash_of:
                self._idle_states[b] = None
            else:
                self._drop_state(b)

    def _drop_state(self, block: int) -> None:
        """Detach an unheld state block from `block` (freed, evicted, or its state taken back)."""
        if block in self._state_of:
            assert block not in self._state_refs, f"block {block} dropped while its state is held"
            self._idle_states.pop(block, None)
            self._free_states.append(self._state_of.pop(block))
            self.block_states[block] = -1

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of


def _last_ref(refs: dict[int, int], block: int, error: str) -> bool:
    """Drop one of `block`'s references in `refs`; whether it was the last (ValueError `error`
    when it holds none)."""
    n = refs.get(block)
    if n is None:
        raise ValueError(error.format(block))
    if n > 1:
        refs[block] = n - 1
        return False
    del refs[block]
    return True


def salt_root(cache_salt: str | None) -> int | None:
    """The parent of a salted prompt's first block (None: unsalted). Requests with different salts
    never share a cached block, so a prefix hit reveals nothing across salts (vLLM's `cache_salt`)."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(b"salt\0" + cache_salt.encode(), digest_size=16).digest(), "little")


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of a full block: its tokens and everything before them (128-bit BLAKE2b,
    so that nobody can make two different prefixes share a block, as vLLM hashes with SHA-256)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")
