"""What the device offers the Triton kernels: the interpreter or a GPU, its multiprocessors, FP8."""

from __future__ import annotations

import os

import torch

# triton 3.9's interpreter multiplies bf16/fp16 tiles wrongly in tl.dot (it multiplies their raw
# bits); under it the kernels widen their dot operands to fp32 (bf16 products are exact in fp32:
# only the order of the sums differs from the GPU's)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (how many programs run at once: the kernels split
    their work to fill them); 4 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fp8_native(t: torch.Tensor) -> bool:
    """Whether Triton has float8_e4m3fn on t's device: CUDA sm_89 and up (Ada, Hopper, Blackwell),
    and the interpreter on CPU. Below that (A100's sm_80) the FP8 kernels take the weights' bytes
    as uint8 and convert them with integer ops (`triton_linear.e4m3_bits_to_fp16`)."""
    return not t.is_cuda or torch.cuda.get_device_capability(t.device) >= (8, 9)


def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or above (227 KB of shared memory per block)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
