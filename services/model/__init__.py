"""The network: DeepSeek-V3 / V3.2 / V4 as plain torch, and reading its checkpoints.

`config` (V3 / V3.2, `config_v4` for V4), `layers` (RMSNorm, rope, the gate, SwiGLU, grouped
expert FFN), `model` (MLA over the paged latent cache, `DeepseekV3`), `indexer` (V3.2's lightning
indexer), `v4_attention` and `deepseek_v4` (V4), `moe` (packed routed experts), `weights` (a
layer's weights and their loading), `checkpoint` (mmap'd safetensors), `fp8` (the block-FP8
format), `kv_cache` (the cache tensors' layout), `batch` (one step's token layout), `messages`
(dispatch / combine between a forward pass and an expert backend), `kernels` (CPU and GPU
kernels). No gRPC, Ray, Redis or sockets here, and nothing of
the engine that drives it (services/engine).
"""
