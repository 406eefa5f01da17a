"""Which Triton kernels run, and loading them.

The kernels live in their own modules, which import triton at the top (`triton.jit` reads
TRITON_INTERPRET when a kernel is defined): `triton_mla` (MLA decode over the paged latent
cache), `triton_moe` (the routed experts' fused MoE), `triton_norm` (RMSNorm). This module
imports none of them until a kernel is wanted, so a CPU install never imports triton.

They run on CUDA tensors when triton is installed (`pip install -e '.[gpu]'`) and
MOE_TRITON is not "0". On the CPU they run only when asked for: MOE_TRITON=1 with
TRITON_INTERPRET=1 (triton's interpreter, which is how CI tests them; far too slow to serve).
Each kernel has a torch reference it is tested against (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_modules: dict[str, ModuleType | None] = {}

# triton 3.9's interpreter multiplies bf16/fp16 tiles wrongly in tl.dot (it multiplies their raw
# bits); under it the kernels widen their dot operands to fp32 (bf16 products are exact in fp32:
# only the order of the sums differs from the GPU's)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def module(name: str) -> ModuleType | None:
    """The kernel module `triton_<name>` ("mla", "moe", "norm"), or None without triton."""
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(f"{__package__}.triton_{name}")
        except ImportError as e:  # no triton: the torch path
            log.info("Triton kernels unavailable (%s); using torch ops", e)
            _modules[name] = None
    return _modules[name]


def enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take work on t's device (see the module docstring)."""
    flag = os.environ.get("MOE_TRITON", "")
    if t.is_cuda:
        return flag != "0"
    return flag == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def get(name: str, t: torch.Tensor) -> ModuleType | None:
    """`module(name)` when the kernels are enabled for t, else None (the caller's torch path)."""
    return module(name) if enabled(t) else None
