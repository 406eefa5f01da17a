"""`EngineConfig`: what an engine runs (checkpoint, dtypes, kernels, batch and cache sizes,
speculative decoding) and the sizes derived from it (scheduler limits, latent-cache blocks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.model.config import ModelConfig, check_weight_dtype, parse_dtype
from services.model.kernels.select import Kernels, select_kernels, target_of
from services.model.kv_cache import (
    BLOCK_SIZE,
    FP8_GROUP,
    PagedLatentCache,
    V4Cache,
    blocks_needed,
    fp8_row_bytes,
    v4_fp8_fields,
)

from .scheduler import SchedulerConfig

if TYPE_CHECKING:
    from services.model.model import DeepseekV3


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    # storage of the linear and routed-expert weights when narrower than `dtype`: "bfloat16"
    # under a float32 CPU engine (half the memory; the fp32 math on bf16-rounded weights)
    weight_dtype: str | None = None
    # FP8 checkpoints: hold the routed experts in FP8 as shipped, with their block scales (half of
    # bf16's memory; weight_dtype then applies to the linears only), computed by the Triton fused
    # MoE on CUDA and the expert kernel on CPU, both reading them as held
    keep_fp8_experts: bool = False
    # FP8 checkpoints: hold the linears (q_a, q_b / q_proj, kv_a, o, dense MLPs, shared experts) in
    # FP8 as shipped (fp8.Fp8Weight), computed by the Triton FP8 linear on CUDA and the C++
    # kernel on CPU, both reading them as held (kv_b, the router, norms, embeddings, LM head: not)
    keep_fp8_linears: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
    num_kv_blocks: int | None = None  # default: enough for max_num_seqs full-length sequences
    num_state_blocks: int | None = None  # DeepSeek-V4's window-state blocks (default: state_blocks)
    kv_cache_gib: float = 2.0  # upper bound for the default num_kv_blocks
    # "auto": latent rows in `dtype`; "fp8": FlashMLA's FP8 rows (kv_cache.fp8_row_bytes: V3 656 B/token/layer)
    kv_cache_dtype: str = "auto"
    max_waiting: int = 1024
    num_threads: int | None = None  # torch intra-op threads (None: leave torch's default)
    micro_batches: int = 1  # 2 = ping-pong: one micro-batch's expert calls overlap the other's attention
    prefix_caching: bool = True  # reuse the cache blocks of prompt prefixes seen before
    cuda_graphs: bool = True  # on CUDA, replay decode steps from captured graphs (decode_graphs.py)
    # the kernels chosen from, once at startup (kernels/select.py): "auto" (FlashMLA and Triton on
    # CUDA, the C++ kernels on the CPU, torch elsewhere), or a comma list of "flashmla", "triton",
    # "cpp", "torch" (each named must run some family; "triton" under TRITON_INTERPRET=1 on CPU too)
    kernels: str = "auto"
    deterministic: bool = False  # batch-invariant kernels (kernels/deterministic.py): tokens as if run alone
    # speculative decoding with the checkpoint's MTP module as the drafter (speculative.py): draft
    # tokens per step and sequence (0: off; vLLM's --speculative-config, parse_speculative_config)
    speculative_tokens: int = 0
    # running sequences above which a step does not speculate (vLLM's disable_by_batch_size); 0: auto,
    # measured per batch-size bucket (spec_gate.py)
    speculative_disable_by_batch_size: int = 0

    def select_kernels(self, cfg: ModelConfig, device=None, reuse: Kernels | None = None) -> Kernels:
        """The kernels of a model of `cfg` on `device` (default: this config's), chosen once
        (kernels/select.py; `reuse` where they were chosen for the same); ValueError where an
        implementation named in `kernels` runs no family (with why)."""
        device, dtype = device or self.device, parse_dtype(self.dtype)
        options = dict(weight_dtype=check_weight_dtype(self.weight_dtype, dtype, self.device, cfg),
                       fp8_linears=self.keep_fp8_linears and not cfg.is_v4, fp8_experts=self.keep_fp8_experts,
                       fp8_cache=self.fp8_cache(cfg) and not cfg.is_v4, deterministic=self.deterministic)  # fmt: skip
        if reuse is not None and reuse.matches(target_of(device, dtype, cfg, **options), self.kernels):
            return reuse
        return select_kernels(device, dtype, cfg, allow=self.kernels, strict=True, **options)

    def scheduler_config(self, cfg: ModelConfig) -> SchedulerConfig:
        max_model_len = self.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} is beyond the model's own "
                             f"({cfg.max_position_embeddings} positions)")  # fmt: skip
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_waiting=self.max_waiting,
        )

    def kv_blocks(self, cfg: ModelConfig, max_model_len: int) -> int:
        """Cache blocks: num_kv_blocks, else what max_num_seqs full-length sequences want, within
        kv_cache_gib; ValueError where that cannot hold one max_model_len sequence (as vLLM
        refuses to start: a long prompt must get a 400, never run out of cache)."""
        if cfg.is_v4:
            return self._v4_sizes(cfg, max_model_len)[0]
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = self.latent_bytes_per_token(cfg) * BLOCK_SIZE
        wanted = self.max_num_seqs * blocks_needed(max_model_len)
        blocks = max(1, min(wanted, int(self.kv_cache_gib * 2**30) // per_block))
        if blocks < blocks_needed(max_model_len):
            raise ValueError(
                f"max_model_len {max_model_len} needs {blocks_needed(max_model_len) * per_block / 2**30:.2f} GiB of "
                f"latent cache ({per_block // BLOCK_SIZE} B per token); kv_cache_gib {self.kv_cache_gib} holds "
                f"{blocks * BLOCK_SIZE} tokens: raise kv_cache_gib, use kv_cache_dtype fp8, or lower max_model_len"
            )
        return blocks

    def fp8_cache(self, cfg: ModelConfig) -> bool:
        """Whether the cache holds FP8 rows (kv_cache_dtype "fp8"); ValueError for another value,
        or where DeepSeek-V4's rows cannot be FP8 (kv_cache.v4_fp8_fields; V3's: `fp8_dims`)."""
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: 'auto' or 'fp8'")
        if self.kv_cache_dtype == "fp8" and cfg.is_v4:
            for kind in set(cfg.layer_types):
                v4_fp8_fields(cfg, kind, torch.float32)
        return self.kv_cache_dtype == "fp8"

    def fp8_dims(self, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """(C, R, Di) of DeepSeek-V3 / V3.2's FP8 rows when kv_cache_dtype is "fp8" (Di: V3.2's
        indexer key, else 0; ValueError where the model's rows cannot be); None otherwise and for
        DeepSeek-V4 (its FP8 rows: kv_cache.v4_fp8_fields)."""
        if not self.fp8_cache(cfg) or cfg.is_v4:
            return None
        if cfg.kv_lora_rank % FP8_GROUP:
            raise ValueError(
                f"kv_cache_dtype fp8 needs kv_lora_rank % {FP8_GROUP} == 0, got {cfg.kv_lora_rank}"
            )
        Di = cfg.cache_dim - cfg.kv_lora_rank - cfg.qk_rope_head_dim  # (V3.2's indexer key; 0 for V3)
        if Di > FP8_GROUP and Di % FP8_GROUP:
            raise ValueError(
                f"kv_cache_dtype fp8 needs index_head_dim <= {FP8_GROUP} or a multiple of it, got {Di}"
            )
        return cfg.kv_lora_rank, cfg.qk_rope_head_dim, Di

    def latent_bytes_per_token(self, cfg: ModelConfig) -> int:
        """Cache bytes one token takes over all layers."""
        fp8 = self.fp8_dims(cfg)
        row = fp8_row_bytes(*fp8) if fp8 else cfg.cache_dim * parse_dtype(self.dtype).itemsize
        return self.cache_layers(cfg) * row

    def cache_layers(self, cfg: ModelConfig) -> int:
        """Layers with a slot in the latent cache: the decoder layers, and with speculative decoding
        the MTP modules' (their rows in the same blocks, at index num_hidden_layers + j)."""
        return cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if self.speculative_tokens else 0)

    def state_blocks(self, cfg: ModelConfig, max_model_len: int) -> int:
        """DeepSeek-V4's window-state blocks (see `_v4_sizes`)."""
        return self._v4_sizes(cfg, max_model_len)[1]

    def _v4_sizes(self, cfg: ModelConfig, max_model_len: int) -> tuple[int, int]:
        """DeepSeek-V4's (entry blocks, state blocks): `num_kv_blocks` / `num_state_blocks` where
        set; otherwise what max_num_seqs full-length sequences want (their entries; their
        lookback's state blocks plus a max_num_batched_tokens prefill, twice over for prefix
        hits), scaled down together to fit kv_cache_gib. Too little for one sequence: an error."""
        per_block, per_state = V4Cache.bytes_per_block(cfg, parse_dtype(self.dtype), self.fp8_cache(cfg),
                                                       self.cache_layers(cfg))  # fmt: skip
        per_seq = V4Cache.state_blocks_per_seq(cfg, max_model_len)
        want = (
            self.num_kv_blocks or self.max_num_seqs * blocks_needed(max_model_len),
            self.num_state_blocks
            or 2 * (self.max_num_seqs * per_seq + blocks_needed(self.max_num_batched_tokens)),
        )
        fixed = (self.num_kv_blocks or 0) * per_block + (self.num_state_blocks or 0) * per_state
        flexible = want[0] * per_block + want[1] * per_state - fixed
        scale = min(1.0, max(0.0, self.kv_cache_gib * 2**30 - fixed) / flexible) if flexible else 1.0
        blocks = self.num_kv_blocks or int(want[0] * scale)
        states = self.num_state_blocks or int(want[1] * scale)
        if states < per_seq or blocks < blocks_needed(max_model_len):
            raise ValueError(
                f"DeepSeek-V4 cache: {blocks} entry blocks and {states} state blocks; one {max_model_len}-token "
                f"sequence needs {blocks_needed(max_model_len)} and {per_seq} ({per_state / 2**20:.1f} MiB each): "
                "raise kv_cache_gib (or num_state_blocks / num_kv_blocks) or lower max_model_len"
            )
        return blocks, states

    def latent_cache(self, cfg: ModelConfig, model: DeepseekV3) -> PagedLatentCache | V4Cache:
        """The paged latent cache this config gives `model` (every tensor-parallel rank gets the
        same one, a replica). Rows are `cfg.cache_dim` wide: [c_kv | k_pe], plus the indexer key
        for DeepSeek-V3.2; DeepSeek-V4 has its entry blocks and state blocks (V4Cache)."""
        max_model_len = self.scheduler_config(cfg).max_model_len
        if cfg.is_v4:
            sizes = self._v4_sizes(cfg, max_model_len)
            return V4Cache(
                cfg, *sizes, model.dtype, model.device, self.fp8_cache(cfg), self.cache_layers(cfg)
            )
        blocks = self.kv_blocks(cfg, max_model_len)
        return PagedLatentCache(self.cache_layers(cfg), blocks, cfg.cache_dim, model.dtype, model.device,
                                self.fp8_dims(cfg))  # fmt: skip
