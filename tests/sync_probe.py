"""Torch calls that would make a CUDA stream wait for the device, caught on a CPU.

A CUDA graph cannot capture a step that reads a device value on the host (`.item()`, `.tolist()`,
`bool(t)`, `.cpu()`), sizes an output by the data (`nonzero`, boolean-mask indexing, `bincount`,
`unique`, `masked_select`, `repeat_interleave` without `output_size`) or copies host data in
(`torch.tensor(...)`): on a GPU each of these synchronises, inside a capture each is an error (and
the engine stays eager). On a CPU nothing synchronises, so `HostSyncs` (a TorchFunctionMode)
lists such calls as our code makes them, leaving out those of triton's interpreter (which copies
kernel arguments to numpy), for tests to check that a decode step makes none.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

SYNCHRONISING = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
    "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "equal", "allclose",
    "tensor", "as_tensor", "histc",
}  # fmt: skip


def _synchronises(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNCHRONISING:
        return True
    if name == "repeat_interleave":
        return "output_size" not in kwargs
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "to":
        return any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
    if name in ("__getitem__", "__setitem__", "index_put", "index_put_") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple | list) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostSyncs(TorchFunctionMode):
    """`calls`: "name at file:line" of each synchronising torch call made under this mode by code
    outside triton (the innermost frame in services/ where there is one)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if _synchronises(name, args, kwargs):
            stack = traceback.extract_stack()[:-1]
            if not any("/triton/" in f.filename for f in stack):
                ours = [f for f in stack if "/services/" in f.filename] or stack
                self.calls.append(f"{name} at {ours[-1].filename.split('/services/')[-1]}:{ours[-1].lineno}")
        return func(*args, **kwargs)
