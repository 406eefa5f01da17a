"""Torch calls that would make a CUDA stream wait for the device, caught on a CPU.

A CUDA graph cannot capture a step that reads a device value on the host (`.item()`, `.tolist()`,
`bool(t)`, `.cpu()`), sizes an output by the data (`nonzero`, boolean-mask indexing, `bincount`,
`unique`, `masked_select`, `repeat_interleave` without `output_size`) or copies host data in
(`torch.tensor(...)`): on a GPU each of these synchronises, inside a capture each is an error (and
the engine stays eager). On a CPU nothing synchronises, so `HostSyncs` (a TorchFunctionMode and a
TorchDispatchMode) lists such calls as our code makes them, leaving out those of triton's
interpreter (which copies kernel arguments to numpy), for tests to check that a decode step makes
none. Not seen: host-to-device copies and tensors made without `device=` (on a CPU every tensor is
on the host) and `torch.cuda.synchronize`.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


# aten ops that wait for the device: a value read on the host (item, bool, int: the scalar
# read), outputs sized by the data, host data copied in (torch.tensor's lift_fresh)
ATEN_SYNCHRONISING = {
    "_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "bincount", "_unique",
    "_unique2", "unique_dim", "unique_consecutive", "lift_fresh", "histc",
}  # fmt: skip


def _where() -> str:
    """file:line of the innermost frame in services/ (else the caller's); None inside triton."""
    stack = traceback.extract_stack()[:-2]
    if any("/triton/" in f.filename for f in stack):
        return None
    frame = ([f for f in stack if "/services/" in f.filename] or stack)[-1]
    return f"{frame.filename.split('/services/')[-1]}:{frame.lineno}"


class _PythonCalls(TorchFunctionMode):
    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if _synchronises(name, args, kwargs) and (where := _where()):
            self.calls.append(f"{name} at {where}")
        return func(*args, **kwargs)


class _AtenCalls(TorchDispatchMode):
    """The same at the aten level: also inside torch functions written in Python (a function
    mode does not see the calls they make)."""

    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        syncs = name in ATEN_SYNCHRONISING or (
            name == "repeat_interleave"
            and kwargs.get("output_size", args[2] if len(args) > 2 else None) is None
        )
        if syncs and (where := _where()):
            self.calls.append(f"aten.{name} at {where}")
        return func(*args, **kwargs)


class HostSyncs:
    """Context manager: `calls` lists "name at file:line" for each synchronising call made under
    it by code outside triton, at the Python level (`item`, `tolist`, `cpu`, ...) and at the aten
    level (`aten._local_scalar_dense`, `aten.nonzero`, ...); one call may be listed at both."""

    def __init__(self):
        self.calls: list[str] = []
        self._modes = (_PythonCalls(self.calls), _AtenCalls(self.calls))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
