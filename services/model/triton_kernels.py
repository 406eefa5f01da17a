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

import contextlib
import importlib
import logging
import os
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_modules: dict[str, ModuleType | None] = {}
_enabled: dict[bool, bool] = {}  # is_cuda -> whether the kernels run there (read from the env once)

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
    """Whether the Triton kernels take work on t's device (see the module docstring; the
    environment is read once per process, or again after `reset`)."""
    cuda = t.is_cuda
    on = _enabled.get(cuda)
    if on is None:
        flag = os.environ.get("MOE_TRITON", "")
        on = _enabled[cuda] = (
            flag != "0" if cuda else flag == "1" and os.environ.get("TRITON_INTERPRET") == "1"
        )
    return on


def reset() -> None:
    """Forget the loaded modules and the environment's answer (tests change them)."""
    _modules.clear()
    _enabled.clear()


def get(name: str, t: torch.Tensor) -> ModuleType | None:
    """`module(name)` when the kernels are enabled for t, else None (the caller's torch path)."""
    return module(name) if enabled(t) else None


def run(name: str, fn: str, *args, **kwargs):
    """`module(name).fn(*args, **kwargs)` with args[0]'s GPU as the current device (Triton
    launches on the current one); None where the kernels are off, where the function declines,
    or once it has failed: a kernel that does not compile or launch here is logged and left to
    the caller's torch path from then on (inside a CUDA-graph capture the error propagates: the
    engine then stays eager)."""
    t = args[0]
    kernels = get(name, t)
    if kernels is None:
        return None
    try:
        with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
            return getattr(kernels, fn)(*args, **kwargs)
    except Exception as e:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        log.error("Triton %s.%s failed (%s: %s); torch ops from now on", name, fn, type(e).__name__, e)
        _modules[name] = None
        return None
