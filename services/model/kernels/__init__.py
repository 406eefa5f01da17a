"""The kernels the model computes with, behind the torch reference each is tested against.

- `select`: which implementation runs each kernel family (norms, linears, rope, router, MLPs,
  routed experts, MLA attention, the indexer's scores), chosen once per (device, dtype, model):
  `select_kernels(...)` -> a `Kernels` whose attributes are the chosen functions, with what it
  chose and why (docs/kernels.md).
- `torch_ops`: the torch implementation of every family (the references).
- `cpu_kernels`: C++ kernels for decode-sized work on the CPU (sources in csrc/, compiled on first
  use).
- `gpu`: the GPU kernels as implementations: our Triton kernels (`triton_mla`, `triton_moe`,
  `triton_norm`, `triton_linear`) and DeepSeek's FlashMLA (`flashmla`); `hardware` holds what the
  Triton kernels ask of the device.

The model calls the chosen function its `Kernels` holds (`kernels.mla_decode(...)`); nothing here
is chosen per call or named by a module-name string.
"""
