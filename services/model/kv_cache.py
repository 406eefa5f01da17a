"""Paged latent KV cache (FlashMLA layout) and its block allocator.

One cache row per token per layer holds [c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe
(qk_rope_head_dim, after RoPE, interleaved pairs)], and for DeepSeek-V3.2 then the lightning
indexer's key (index_head_dim, see indexer.py), so one block table addresses both. Per layer the
cache is `[num_blocks, BLOCK_SIZE, 1, row_dim]` (one latent "KV head"; row_dim is
`ModelConfig.cache_dim`), addressed through an int32 block table `[batch, max_blocks]` and int32
seqlens, exactly what FlashMLA's `flash_mla_with_kvcache` takes for V3 (576-wide rows), so that
kernel drops in on Hopper. DeepSeek-V4 keeps its own rows here (window K=V, compressor state,
compressed entries: see v4_attention.py).

Blocks are shared between requests with a common prompt prefix (automatic prefix caching,
`BlockAllocator`): a full block's identity is the chained hash of its tokens and everything
before them, as in vLLM.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

BLOCK_SIZE = 64


class BlockAllocator:
    """Cache blocks and their reuse across requests (automatic prefix caching). Pure bookkeeping;
    the scheduler owns one.

    A block is free, in use (reference counted: sequences sharing a cached prefix share its
    blocks), or cached: unreferenced but still holding the latent rows of a known token prefix,
    found by the chained hash of that prefix's blocks (`block_hash`) and reused until the space is
    needed (least recently freed first). Only full blocks whose rows are all computed are ever
    registered, and a registered block is never written again: shared blocks are immutable.
    With `caching` off, freed blocks go straight back to the free list.
    """

    def __init__(self, num_blocks: int, caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.caching = num_blocks, caching
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
            refs = self._refs.get(b)
            if refs is None:
                raise ValueError(f"KV cache: block {b} freed twice or never allocated")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._cached[b] = None
            else:
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
        already cached elsewhere keeps its first block; this one stays private)."""
        if self.caching and block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of


def blocks_needed(num_tokens: int) -> int:
    return (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of a full block: its tokens and everything before them (128-bit BLAKE2b,
    so that nobody can make two different prefixes share a block, as vLLM hashes with SHA-256)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PagedLatentCache:
    """`kv[layer]` is `[num_blocks, BLOCK_SIZE, 1, latent_dim]`, all layers in one tensor
    (`latent_dim` here is the whole row: `ModelConfig.cache_dim`)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        latent_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.kv = torch.zeros(num_layers, num_blocks, BLOCK_SIZE, 1, latent_dim, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    def layer(self, i: int) -> torch.Tensor:
        return self.kv[i]

    @staticmethod
    def bytes_per_block(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * BLOCK_SIZE * latent_dim * torch.empty((), dtype=dtype).element_size()
