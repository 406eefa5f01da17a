"""The kernels the model computes with, behind the torch reference each is tested against.

- `cpu_kernels`: C++ kernels for decode-sized work on the CPU (sources in csrc/, compiled on first
  use), each returning None where it does not apply (the caller's torch path).
- `gpu`: the GPU kernels, one backend object per family: `gpu.TRITON` (our Triton kernels in
  `triton_mla`, `triton_moe`, `triton_norm`, `triton_linear`) and `gpu.FLASH_MLA` (DeepSeek's
  FlashMLA, `flashmla`); `hardware` holds what the Triton kernels ask of the device.

The model imports the kernel it calls (`from .kernels.gpu import TRITON` then `TRITON.mla_decode(...)`);
nothing here is chosen by a module-name string.
"""
