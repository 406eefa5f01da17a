"""Which GPU kernels run, and loading them.

The Triton kernels live in their own modules, which import triton at the top (`triton.jit` reads
TRITON_INTERPRET when a kernel is defined): `triton_mla` (MLA decode over the paged latent
cache), `triton_moe` (the routed experts' fused MoE), `triton_norm` (RMSNorm), `triton_linear`
(linears with weights kept FP8). `flashmla` wraps
DeepSeek's FlashMLA (built from source, docs/kernels.md) for decode attention on Hopper. This
module imports none of them until a kernel is wanted, so a CPU install never imports triton.

The Triton kernels run on CUDA tensors when triton is installed (`pip install -e '.[gpu]'`) and
MOE_TRITON is not "0". On the CPU they run only when asked for: MOE_TRITON=1 with
TRITON_INTERPRET=1 (triton's interpreter, which is how CI tests them; far too slow to serve).
FlashMLA runs on CUDA tensors when `import flash_mla` works and MOE_FLASH_MLA is not "0" (on the
CPU only with MOE_FLASH_MLA=1: tests, with a torch stand-in for the library).
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
# (kernel family, is_cuda) -> whether its kernels run there (read from the environment once)
_enabled: dict[tuple[str, bool], bool] = {}
_failed: set[tuple[str, str]] = set()  # (module name, function) that failed here: the torch path's

# triton 3.9's interpreter multiplies bf16/fp16 tiles wrongly in tl.dot (it multiplies their raw
# bits); under it the kernels widen their dot operands to fp32 (bf16 products are exact in fp32:
# only the order of the sums differs from the GPU's)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def module(name: str) -> ModuleType | None:
    """The kernel module: `triton_<name>` ("mla", "moe", "norm", "linear") or `flashmla`; None without
    triton (or FlashMLA)."""
    if name not in _modules:
        path = "flashmla" if name == "flashmla" else f"triton_{name}"
        try:
            _modules[name] = importlib.import_module(f"{__package__}.{path}")
        except ImportError as e:  # no triton / FlashMLA: the next path
            log.info("%s kernels unavailable (%s); using the next path", name, e)
            _modules[name] = None
    return _modules[name]


def enabled(t: torch.Tensor, name: str = "mla") -> bool:
    """Whether the kernel `name` ("flashmla", or any Triton one) takes work on t's device (see the
    module docstring; the environment is read once per process, or again after `reset`)."""
    family = "flashmla" if name == "flashmla" else "triton"
    key = (family, t.is_cuda)
    on = _enabled.get(key)
    if on is None:
        if family == "flashmla":
            flag = os.environ.get("MOE_FLASH_MLA", "")
            on = flag != "0" if t.is_cuda else flag == "1"
        else:
            flag = os.environ.get("MOE_TRITON", "")
            on = flag != "0" if t.is_cuda else flag == "1" and os.environ.get("TRITON_INTERPRET") == "1"
        _enabled[key] = on
    return on


def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (how many programs run at once: the kernels split
    their work to fill them); 4 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fp8_native(t: torch.Tensor) -> bool:
    """Whether Triton has float8_e4m3fn on t's device: CUDA sm_89 and up (Ada, Hopper, Blackwell),
    and the interpreter on CPU. Below that (A100's sm_80) the FP8 kernels take the weights' bytes
    as uint8 and convert them with integer ops (`triton_linear.e4m3_bits_to_fp16`)."""
    return not t.is_cuda or torch.cuda.get_device_capability(t.device) >= (8, 9)


def reset() -> None:
    """Forget the loaded modules, the environment's answer and the failed kernels (tests change them)."""
    _modules.clear()
    _enabled.clear()
    _failed.clear()


@contextlib.contextmanager
def off(family: str = "triton", cuda: bool = True):
    """Inside: the family's kernels ("triton" or "flashmla") off on CUDA (cuda=True) or the CPU,
    whatever the environment says: the torch path, as the references of benchmarks and tests."""
    key = (family, cuda)
    saved = _enabled.pop(key, None)
    _enabled[key] = False
    try:
        yield
    finally:
        _enabled.pop(key, None)
        if saved is not None:
            _enabled[key] = saved


def get(name: str, t: torch.Tensor) -> ModuleType | None:
    """`module(name)` when the kernels are enabled for t, else None (the caller's torch path)."""
    return module(name) if enabled(t, name) else None


def run(name: str, fn: str, *args, **kwargs):
    """`module(name).fn(*args, **kwargs)` with args[0]'s GPU as the current device (Triton
    launches on the current one); None where the kernels are off, where the function declines,
    or once it has failed: a kernel function that does not compile or launch here is logged and
    left to the caller's torch path from then on, the module's other functions still run (inside a
    CUDA-graph capture the error propagates: the engine then stays eager)."""
    t = args[0]
    kernels = get(name, t)
    if kernels is None or (name, fn) in _failed:
        return None
    try:
        with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
            return getattr(kernels, fn)(*args, **kwargs)
    except Exception as e:
        if t.is_cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode()):
            raise  # (a capture, or the check before one: decode_graphs; the kernel itself is fine)
        kind = "FlashMLA" if name == "flashmla" else "Triton"
        log.error("%s %s.%s failed (%s: %s); the next path from now on", kind, name, fn, type(e).__name__, e)
        _failed.add((name, fn))
        return None
