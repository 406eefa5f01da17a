"""The GPU kernels, chosen explicitly: one backend object per kernel family.

`TRITON` runs our Triton kernels (`triton_mla`: MLA decode over the paged latent cache and the
latent's per-token work; `triton_moe`: the routed experts' fused MoE; `triton_norm`: RMSNorm;
`triton_linear`: linears with weights kept FP8). `FLASH_MLA` runs DeepSeek's FlashMLA (built from
source, docs/kernels.md) for decode attention on Hopper (`flashmla`). Each kernel is a method of
its backend that imports its module where the kernel is first wanted (the Triton modules import
triton at the top: `triton.jit` reads TRITON_INTERPRET when a kernel is defined), so a CPU
install never imports triton, and the model's dependency on each kernel is an import a reader or a
type checker can follow. Every method returns None where its kernel does not take the work: the
caller then runs its next path (the C++ CPU kernels, then torch).

The Triton kernels run on CUDA tensors when triton is installed (`pip install -e '.[gpu]'`) and
MOE_TRITON is not "0". On the CPU they run only when asked for: MOE_TRITON=1 with
TRITON_INTERPRET=1 (triton's interpreter, which is how CI tests them; far too slow to serve).
FlashMLA runs on CUDA tensors when `import flash_mla` works and MOE_FLASH_MLA is not "0" (on the
CPU only with MOE_FLASH_MLA=1: tests, with a torch stand-in for the library).
Each kernel has a torch reference it is tested against (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Backend:
    """A family of GPU kernels: whether it takes work on a tensor's device (its library importable,
    its environment flag; read once per process, or again after `reset`), and running one of its
    functions with the fallback rule: a function that fails here is logged once and left to the
    caller's next path from then on (the family's other functions still run)."""

    def __init__(self, name: str, flag: str, cpu_needs_interpreter: bool):
        self.name, self.flag = name, flag
        self.cpu_needs_interpreter = cpu_needs_interpreter
        self._enabled: dict[bool, bool] = {}  # is_cuda -> whether the kernels take work there
        self._library: bool | None = None  # whether `import library` works here
        self.failed: set[str] = set()  # kernels (method names) that failed here: the next path's
        self.ran: set[str] = set()  # kernels that returned a result

    def enabled(self, t: torch.Tensor) -> bool:
        on = self._enabled.get(t.is_cuda)
        if on is None:
            flag = os.environ.get(self.flag, "")
            if t.is_cuda:
                on = flag != "0"
            else:
                interpreted = os.environ.get("TRITON_INTERPRET") == "1"
                on = flag == "1" and (interpreted or not self.cpu_needs_interpreter)
            on = on and self._importable()
            self._enabled[t.is_cuda] = on
        return on

    def _importable(self) -> bool:
        if self._library is None:
            try:
                self._import_library()
                self._library = True
            except ImportError as e:  # no triton / FlashMLA: the next path
                log.info("%s kernels unavailable (%s); using the next path", self.name, e)
                self._library = False
        return self._library

    def _import_library(self) -> None:
        """Import the family's library (ImportError where it is not installed)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the environment's answer, the failed and the ran kernels (tests change them)."""
        self._enabled.clear()
        self._library = None
        self.failed.clear()
        self.ran.clear()

    @contextlib.contextmanager
    def off(self, cuda: bool = True):
        """Inside: the family off on CUDA (cuda=True) or the CPU, whatever the environment says: the
        torch path, as the references of benchmarks and tests."""
        saved = self._enabled.pop(cuda, None)
        self._enabled[cuda] = False
        try:
            yield
        finally:
            self._enabled.pop(cuda, None)
            if saved is not None:
                self._enabled[cuda] = saved

    def run(self, kernel: str, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), the function behind this backend's method `kernel`, with args[0]'s
        GPU as the current device (Triton launches on the current one); None once the kernel has
        failed here, or where it declines the work (inside a CUDA-graph capture an error
        propagates: the engine then stays eager)."""
        t = args[0]
        if kernel in self.failed:
            return None
        try:
            with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
                out = fn(*args, **kwargs)
        except Exception as e:
            if t.is_cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode()):
                raise  # (a capture, or the check before one: decode_graphs; the kernel itself is fine)
            log.error(
                "%s %s failed (%s: %s); the next path from now on", self.name, kernel, type(e).__name__, e
            )
            self.failed.add(kernel)
            return None
        if out is not None:
            self.ran.add(kernel)
        return out


class TritonKernels(Backend):
    """Our Triton kernels (services/model/kernels/triton_*.py). Each method takes its kernel
    function's arguments (first the tensor whose device decides) and returns its result, or None."""

    def __init__(self):
        super().__init__("Triton", "MOE_TRITON", cpu_needs_interpreter=True)

    def _import_library(self) -> None:
        import triton  # noqa: F401

    def mla_decode(self, q, *args, **kwargs):
        """Absorbed MLA decode over the paged latent cache (`triton_mla.mla_decode`)."""
        if self.enabled(q):
            from . import triton_mla

            return self.run("mla_decode", triton_mla.mla_decode, q, *args, **kwargs)
        return None

    def latent_to_cache(self, kv, *args, **kwargs):
        """An MLA layer's latent norm, ropes and cache write in one launch (`triton_mla.latent_to_cache`)."""
        if self.enabled(kv):
            from . import triton_mla

            return self.run("latent_to_cache", triton_mla.latent_to_cache, kv, *args, **kwargs)
        return None

    def rms_norm(self, x, *args):
        """RMSNorm of x's rows (`triton_norm.rms_norm`)."""
        if self.enabled(x):
            from . import triton_norm

            return self.run("rms_norm", triton_norm.rms_norm, x, *args)
        return None

    def add_rms_norm(self, h, *args):
        """(h + delta, RMSNorm of it) in one launch (`triton_norm.add_rms_norm`)."""
        if self.enabled(h):
            from . import triton_norm

            return self.run("add_rms_norm", triton_norm.add_rms_norm, h, *args)
        return None

    def fused_moe(self, x, *args, **kwargs):
        """A layer's routed experts, bf16 or block-FP8 weights (`triton_moe.fused_moe`)."""
        if self.enabled(x):
            from . import triton_moe

            return self.run("fused_moe", triton_moe.fused_moe, x, *args, **kwargs)
        return None

    def fp8_linear(self, x, *args):
        """y = x @ W^T (+ bias) with W kept FP8 (`triton_linear.fp8_linear`)."""
        if self.enabled(x):
            from . import triton_linear

            return self.run("fp8_linear", triton_linear.fp8_linear, x, *args)
        return None


class FlashMLAKernels(Backend):
    """DeepSeek's FlashMLA (services/model/kernels/flashmla.py)."""

    def __init__(self):
        super().__init__("FlashMLA", "MOE_FLASH_MLA", cpu_needs_interpreter=False)

    def _import_library(self) -> None:
        import flash_mla  # noqa: F401

    def mla_decode(self, q, *args):
        """V3's dense decode attention (`flashmla.mla_decode`; None for other layouts and GPUs)."""
        if self.enabled(q):
            from . import flashmla

            return self.run("mla_decode", flashmla.mla_decode, q, *args)
        return None


TRITON = TritonKernels()
FLASH_MLA = FlashMLAKernels()


def reset() -> None:
    """Both backends forget what they read and what failed (tests change the environment)."""
    TRITON.reset()
    FLASH_MLA.reset()
