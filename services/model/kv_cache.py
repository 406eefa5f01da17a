"""Paged latent KV cache (FlashMLA layout) and its block allocator.

One cache row per token per layer holds [c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe
(qk_rope_head_dim, after RoPE, interleaved pairs)]. Per layer the cache is
`[num_blocks, BLOCK_SIZE, 1, latent_dim]` (one latent "KV head"), addressed through an int32
block table `[batch, max_blocks]` and int32 seqlens, exactly what FlashMLA's
`flash_mla_with_kvcache` takes, so that kernel drops in on Hopper.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 64


class BlockAllocator:
    """Free list of cache blocks. Pure bookkeeping; the scheduler owns one."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV cache: block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)


def blocks_needed(num_tokens: int) -> int:
    return (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


class PagedLatentCache:
    """`kv[layer]` is `[num_blocks, BLOCK_SIZE, 1, latent_dim]`, all layers in one tensor."""

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
