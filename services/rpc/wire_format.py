"""Protobuf wire-format primitives for the tensor-carrying messages of `proto/expert.proto`; the
message codecs built on them are `services/rpc/wire.py` (which re-exports the public names here).

A tensor travels as a `Tensor` submessage: raw little-endian bytes + dtype name + shape.

* tensors and bytes: `tensor_bytes` (a tensor's bytes, no copy), `tensor_from_buffer` (a tensor
  viewing bytes, no copy, after checks), the supported `DTYPES`, `WireError`;
* writing: the layout of a message (its integer fields, its Tensor headers, a fixed-size tail),
  computed once per shape and cached, written into an uninitialised `bytes` object whose
  payloads are handed out as writable tensor views (`_allocate`), or filled from finished
  tensors with one copy each (`_encode`); `copy_into` copies into such a view by memcpy. The
  bytes are exactly what protobuf writes for the same fields (field order, packed shape,
  defaults omitted);
* reading: the general parser (`_fields`, `_decode_tensor`, `_decode_ints_and_tensors`: any
  valid encoding, WireError naming what is wrong otherwise) and the fast path that recognises a
  message laid out exactly as `_layout` lays it out (`_tensor_head`, `_as_written`).

Decoded tensors share memory with an immutable `bytes` object: do not write into them (they may
also be unaligned, which CPU kernels handle; `.to(device)` copies anyway).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import warnings
from collections.abc import Sequence

import torch

if sys.byteorder != "little":
    raise ImportError("the tensor wire format is little-endian; this host is big-endian")

# torch.frombuffer warns once per process about read-only buffers; received tensors are read-only
# by contract, so spend that one warning here, silenced
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0\0\0", dtype=torch.float32)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,  # FP8 experts kept FP8 (peer copy)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
    """A message or tensor that does not decode: wrong dtype name, shape, byte length, framing."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot go on the wire; supported: {sorted(DTYPES)}") from None


# dtypes numpy lacks are exported through a same-width integer view
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview, without copying (a non-contiguous tensor
    is made contiguous first)."""
    if t.device.type != "cpu":
        raise WireError(f"tensor on {t.device}: move it to the CPU before sending")
    dtype_name(t.dtype)
    if t.numel() == 0:
        return memoryview(b"")
    t = t.contiguous()
    view = _NUMPY_VIEW.get(t.dtype)
    return memoryview((t if view is None else t.view(view)).numpy()).cast("B")


def tensor_from_buffer(dtype: str, shape: Sequence[int], data: bytes | memoryview) -> torch.Tensor:
    """A tensor viewing `data` (no copy), after checking dtype name, shape and byte length."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise WireError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return _view(data, torch_dtype, tuple(shape), 0, memoryview(data).nbytes)


def _view(
    data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], offset: int, nbytes: int
) -> torch.Tensor:
    """tensor_from_buffer for `nbytes` bytes of `data` from `offset`, the dtype looked up."""
    if shape and min(shape) < 0:
        raise WireError(f"negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if nbytes != numel * dtype.itemsize:
        raise WireError(
            f"{DTYPE_NAMES[dtype]} tensor of shape {list(shape)} needs {numel * dtype.itemsize} bytes, got {nbytes}"
        )
    try:
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).view(shape)
    except (RuntimeError, OverflowError) as e:  # e.g. [0, 2**62, 2**62]: strides overflow
        raise WireError(f"{DTYPE_NAMES[dtype]} tensor of shape {list(shape)}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Writing: protobuf framing, messages laid out in place
# ---------------------------------------------------------------------------------------------

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf writes negative int64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


_DTYPE_FIELD = {
    dtype: _key(1, _LEN) + _varint(len(name)) + name.encode() for dtype, name in DTYPE_NAMES.items()
}
_SHAPE_KEY, _DATA_KEY = _key(2, _LEN), _key(3, _LEN)

# PyBytes_FromStringAndSize(NULL, n): a new bytes object whose contents are left for the caller
# to fill before anyone else sees it (the C API's way of building bytes in place)
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)

# CPython keeps a bytes object's characters at a fixed offset from the object (its id): the size
# of an empty bytes object less its terminating NUL. Checked once, here.
_BYTES_DATA = sys.getsizeof(b"") - 1
_probe = b"where do the characters start"
if ctypes.cast(ctypes.c_char_p(_probe), ctypes.c_void_p).value != id(_probe) + _BYTES_DATA:
    raise ImportError("the wire codec builds messages in place and needs CPython's bytes layout")


def _address(data: bytes) -> int:
    return id(data) + _BYTES_DATA


# (field number, dtype, shape) of one Tensor submessage whose payload is written in place
TensorSpec = tuple[int, torch.dtype, tuple[int, ...]]


@functools.lru_cache(maxsize=4096)  # the same few shapes come every step
def _tensor_header(field: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """The bytes of a Tensor submessage in `field` up to its payload, and the payload size."""
    nbytes = math.prod(shape) * dtype.itemsize
    head = _DTYPE_FIELD[dtype]
    if len(shape):
        dims = b"".join(map(_varint, shape))
        head += _SHAPE_KEY + _varint(len(dims)) + dims
    if nbytes:
        head += _DATA_KEY + _varint(nbytes)
    return _key(field, _LEN) + _varint(len(head) + nbytes) + head, nbytes


# (payload offset, dtype, numel, shape) of one Tensor field's payload in a message
Payload = tuple[int, torch.dtype, int, tuple[int, ...]]


@functools.lru_cache(maxsize=1024)
def _ints(ints: tuple[tuple[int, int], ...]) -> bytes:
    """Varint fields (field, value), zero omitted as proto3 does: the start of a message."""
    return b"".join(_key(field, _VARINT) + _varint(v) for field, v in ints if v)


@functools.lru_cache(maxsize=4096)  # keyed on shapes only: the same few come every step
def _layout(
    specs: tuple[TensorSpec, ...], tail: int
) -> tuple[int, tuple[tuple[int, bytes], ...], tuple[Payload, ...]]:
    """Where everything goes after a message's integer fields: one Tensor field per spec, then
    `tail` more bytes. (size, ((offset, header bytes), ...) with adjacent headers merged,
    (payload, ...)), offsets counted from the end of the integer fields."""
    for _, dtype, _ in specs:
        dtype_name(dtype)
    chunks, payloads, pos = [], [], 0
    for field, dtype, shape in specs:
        head, nbytes = _tensor_header(field, dtype, shape)
        if chunks and chunks[-1][0] + len(chunks[-1][1]) == pos:
            chunks[-1][1] += head
        else:
            chunks.append([pos, head])
        payloads.append((pos + len(head), dtype, math.prod(shape), shape))
        pos += len(head) + nbytes
    return pos + tail, tuple((offset, head) for offset, head in chunks), tuple(payloads)


def _allocate(
    ints: tuple[tuple[int, int], ...], specs: tuple[TensorSpec, ...], tail: int = 0
) -> tuple[bytes, list[torch.Tensor], int]:
    """Lay out a message: integer fields, one Tensor field per spec, `tail` bytes. Returns (message
    bytes, writable payload views [one per spec, in order], offset of the tail). Everything but
    the payloads and the tail is written; the caller fills those before sending."""
    data, base, payloads = _new_message(ints, specs, tail)
    return data, _views(data, base, payloads), len(data) - tail


def _new_message(
    ints: tuple[tuple[int, int], ...], specs: tuple[TensorSpec, ...], tail: int
) -> tuple[bytes, int, tuple[Payload, ...]]:
    """An uninitialised message with its integer fields and Tensor headers written: (bytes,
    length of the integer fields, the payloads of `_layout`)."""
    prefix = _ints(ints)
    size, chunks, payloads = _layout(specs, tail)
    data = _new_bytes(None, len(prefix) + size)
    address = _address(data)
    ctypes.memmove(address, prefix, len(prefix))
    address += len(prefix)
    for offset, chunk in chunks:
        ctypes.memmove(address + offset, chunk, len(chunk))
    return data, len(prefix), payloads


def _views(data: bytes, base: int, payloads: Sequence[Payload]) -> list[torch.Tensor]:
    """Tensors viewing the payloads of a message (offsets from `base`; no copy)."""
    return [
        torch.frombuffer(data, dtype=dtype, count=numel, offset=base + offset).view(shape)
        if numel
        else torch.empty(shape, dtype=dtype)
        for offset, dtype, numel, shape in payloads
    ]


def _write(data: bytes, offset: int, chunk: bytes) -> None:
    """Write `chunk` into a message `_allocate` made (only before it is sent)."""
    ctypes.memmove(_address(data) + offset, chunk, len(chunk))


def copy_into(view: torch.Tensor, t: torch.Tensor) -> None:
    """view.copy_(t), as a plain memcpy when both are contiguous CPU tensors of one dtype (torch's
    copy into the unaligned payload views of a message is ~1.5x slower than memcpy)."""
    if (
        t.device.type == "cpu"
        and t.dtype == view.dtype
        and t.shape == view.shape
        and t.is_contiguous()
        and view.is_contiguous()
    ):
        if t.numel():
            ctypes.memmove(view.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    else:
        view.copy_(t)


def _encode(
    ints: tuple[tuple[int, int], ...], tensors: Sequence[tuple[int, torch.Tensor | None]], tail: bytes = b""
) -> bytes:
    """A message from finished tensors (None = field absent): each copied once, into the
    message (from any device; a contiguous CPU tensor by memcpy, with no view of the message)."""
    present = [t for _, t in tensors if t is not None]
    data, base, payloads = _new_message(
        ints, tuple((field, t.dtype, tuple(t.shape)) for field, t in tensors if t is not None), len(tail)
    )
    address = _address(data) + base
    for payload, t in zip(payloads, present, strict=True):
        offset, dtype, numel, _ = payload
        if not numel:
            continue
        if t.device.type == "cpu" and t.is_contiguous():
            ctypes.memmove(address + offset, t.data_ptr(), numel * dtype.itemsize)
        else:
            _views(data, base, [payload])[0].copy_(t)
    if tail:
        _write(data, len(data) - len(tail), tail)
    return data


# ---------------------------------------------------------------------------------------------
# Reading: the general parser, and the fast path for messages laid out as we write them
# ---------------------------------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos < end and buf[pos] < 0x80:  # one byte: keys, small ints
        return buf[pos], pos + 1
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & ((1 << 64) - 1), pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) over buf[pos:end]; LEN values are (start, stop) spans."""
    fields = []
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
        elif wire_type == _LEN:
            n, pos = _read_varint(buf, pos, end)
            value, pos = (pos, pos + n), pos + n
        elif wire_type == _I64:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire_type == _I32:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type} (field {field})")
        if pos > end:
            raise WireError(f"field {field} runs past the end of its message")
        fields.append((field, wire_type, value))
    return fields


def _expect(field: int, wire_type: int, expected: int, message: str) -> None:
    if wire_type != expected:
        raise WireError(f"{message} field {field} has wire type {wire_type}, expected {expected}")


def _as_int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_DTYPE_OF_NAME = {name.encode(): dtype for name, dtype in DTYPES.items()}


def _decode_tensor(buf: bytes, spans: list[tuple[int, int]], what: str) -> torch.Tensor:
    """Decode a Tensor submessage (occurrences merged, as protobuf does) viewing `buf`."""
    name, shape, (start, stop) = b"", [], (0, 0)
    for span in spans:
        for field, wire_type, value in _fields(buf, *span):
            if field == 1:
                _expect(field, wire_type, _LEN, "Tensor")
                name = bytes(buf[value[0] : value[1]])
            elif field == 2 and wire_type == _LEN:  # packed
                pos, end = value
                while pos < end:
                    d, pos = _read_varint(buf, pos, end)
                    shape.append(_as_int64(d))
            elif field == 2:
                _expect(field, wire_type, _VARINT, "Tensor")
                shape.append(_as_int64(value))
            elif field == 3:
                _expect(field, wire_type, _LEN, "Tensor")
                start, stop = value
    dtype = _DTYPE_OF_NAME.get(name)
    try:
        if dtype is None:
            raise WireError(
                f"unknown dtype {name.decode('utf-8', errors='replace')!r}; supported: {sorted(DTYPES)}"
            )
        return _view(buf, dtype, tuple(shape), start, stop - start)
    except WireError as e:
        raise WireError(f"{what}: {e}") from None


def _decode_ints_and_tensors(
    buf: bytes, message: str, tensor_names: dict[int, str]
) -> tuple[int, int, list[torch.Tensor | None]]:
    """The shape DispatchRequest and ExpertWeights share: varint fields 1 and 2 (raw uint64, 0 when
    absent) and Tensor fields `tensor_names` (decoded viewing `buf`; None when absent)."""
    ints = {1: 0, 2: 0}
    spans: dict[int, list[tuple[int, int]]] = {f: [] for f in tensor_names}
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field in ints:
            _expect(field, wire_type, _VARINT, message)
            ints[field] = value
        elif field in spans:
            _expect(field, wire_type, _LEN, message)
            spans[field].append(value)
    tensors = [_decode_tensor(buf, spans[f], name) if spans[f] else None for f, name in tensor_names.items()]
    return ints[1], ints[2], tensors


# The fast way in: a message whose bytes are exactly what our encoders write for some values
# (every Dispatch our peers send) is read by reading those values off its first tensor headers
# and comparing the integer fields and headers of that layout (`_ints`, `_layout`: the encoders'
# own, cached) with the bytes, instead of parsing it field by field. The comparison is the
# proof: equal bytes decode to those values whatever parser reads them. Anything else (other
# encoders' field order, unknown fields, malformed input) takes the general parser (each
# message's `_parse_*` in wire.py, on `_fields` above), which also gives the errors. (Why
# bother: a Dispatch arrives after a long wait, when the CPU caches hold the expert weights, and
# every Python function a decode touches first costs tens of microseconds then.)
def _tensor_head(buf: bytes, pos: int) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, end) of the Tensor field at buf[pos] if it starts as our encoder writes one:
    key, length, dtype name, packed shape. A guess that reads lengths as single bytes and skips
    every check: `_as_written` compares the whole layout afterwards. Raises IndexError, KeyError
    or ValueError where it cannot guess."""
    end = len(buf)
    pos = _read_varint(buf, pos, end)[1]  # the field's key
    length, pos = _read_varint(buf, pos, end)
    stop = pos + length
    name_end = pos + 2 + buf[pos + 1]  # 0a <name length> <name>
    dtype = _DTYPE_OF_NAME[buf[pos + 2 : name_end]]
    pos, dims_end, shape = name_end + 2, name_end + 2 + buf[name_end + 1], []  # 12 <length> <dims>
    while pos < dims_end:
        d, pos = _read_varint(buf, pos, dims_end)
        if d >> 63:
            raise ValueError("negative dimension")  # int64 on the wire: the general parser says so
        shape.append(d)
    return dtype, tuple(shape), stop


# what a guess at a message that is not our layout can raise (WireError is a ValueError; torch
# may refuse a view of absurd dimensions): the general parser then says what is wrong
_NOT_AS_WRITTEN = (IndexError, KeyError, ValueError, RuntimeError, OverflowError)


def _as_written(
    buf: bytes, ints: tuple[tuple[int, int], ...], specs: tuple[TensorSpec, ...], tail: int
) -> list[torch.Tensor] | None:
    """The payload views if `buf` is exactly the layout of `ints`, `specs` and `tail` bytes (all
    but the tail compared), else None."""
    prefix = _ints(ints)
    size, chunks, payloads = _layout(specs, tail)
    base = len(prefix)
    if len(buf) != base + size or not buf.startswith(prefix):
        return None
    for offset, head in chunks:
        if not buf.startswith(head, base + offset):
            return None
    return _views(buf, base, payloads)
