"""Tensors on the wire: raw little-endian bytes + dtype name + shape (`proto/expert.proto`).

Two ways in and out:

* `tensor_to_proto` / `tensor_from_proto` work on the generated `expert_pb2.Tensor` message
  (control paths, tests, any caller that already holds protobuf messages). protobuf copies the
  bytes once into the message and once more when `.data` is read.
* The data plane writes and reads the protobuf wire format of `DispatchRequest` /
  `DispatchResponse` directly (the bytes are exactly what protobuf writes for the same message:
  field order, packed shape, defaults omitted; the decoder accepts any valid encoding - any
  field order, unknown fields skipped, unpacked shape - and tests check both directions against
  the generated classes):
  - sending: `DispatchRequestBuffer` / `DispatchResponseBuffer` lay the message out first, in an
    uninitialised `bytes` object, and hand out writable tensor views of its payloads, so the
    producer writes straight into the message (the client's `index_select` of a worker's rows,
    the expert compute's final cast): no copy beyond the protobuf bytes themselves.
    `encode_dispatch_request` / `encode_dispatch_response` do the same from finished tensors,
    copying each once;
  - receiving: decoded tensors are `torch.frombuffer` views of the received bytes (no copy). A
    message exactly as our encoders write it is recognised by its layout (see `_as_written`)
    rather than parsed field by field; anything else takes the general parser.

`encode_expert_weights` / `decode_expert_weights` do the same for the `ExpertWeights` messages
of the FetchExperts stream (peer copy of expert weights, ~88 MB per DeepSeek-V3 expert in bf16).

Decoded tensors share memory with an immutable `bytes` object: do not write into them (they may
also be unaligned, which CPU kernels handle; `.to(device)` copies anyway).
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.rpc import expert_pb2

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
_NUMPY_VIEW = {torch.bfloat16: torch.int16}


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
# Generated-message helpers
# ---------------------------------------------------------------------------------------------
def tensor_to_proto(t: torch.Tensor, out: expert_pb2.Tensor | None = None) -> expert_pb2.Tensor:
    """Fill (or create) an `expert_pb2.Tensor`; protobuf copies the bytes into the message."""
    out = expert_pb2.Tensor() if out is None else out
    out.dtype = dtype_name(t.dtype)
    del out.shape[:]
    out.shape.extend(t.shape)
    out.data = tensor_bytes(t).tobytes()
    return out


def tensor_from_proto(msg: expert_pb2.Tensor) -> torch.Tensor:
    """A tensor over the message's bytes (reading `.data` copies once, inside protobuf)."""
    return tensor_from_buffer(msg.dtype, msg.shape, msg.data)


# ---------------------------------------------------------------------------------------------
# Dispatch messages, encoded and decoded directly (the data plane)
# ---------------------------------------------------------------------------------------------
@dataclass
class DispatchRequest:
    """`moecluster.expert.v1.DispatchRequest`. Missing tensors decode as None."""

    layer: int
    placement_version: int
    hidden: torch.Tensor | None  # [T, H]
    slot: torch.Tensor | None  # [T, K] int32, -1 = none
    weight: torch.Tensor | None  # [T, K] float32

    def nbytes(self) -> int:
        """Tensor payload bytes (what encoding copies)."""
        return sum(
            t.numel() * t.element_size() for t in (self.hidden, self.slot, self.weight) if t is not None
        )


@dataclass
class DispatchResponse:
    """`moecluster.expert.v1.DispatchResponse`."""

    output: torch.Tensor | None  # [T, H]
    compute_seconds: float = 0.0


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


class DispatchRequestBuffer:
    """A DispatchRequest laid out before its tensors exist, for the sender to build them in place.

    `data` is the serialized message; `hidden` [T, H], `slot` [T, K] int32 and `weight` [T, K]
    float32 are writable views of its payload bytes. Fill all three (e.g.
    `torch.index_select(x, 0, rows, out=buf.hidden)`), then send `data` and stop writing: bytes
    are immutable once anyone else holds them.
    """

    def __init__(self, layer: int, placement_version: int, hidden_shape: Sequence[int], dtype: torch.dtype,
                 top_k: int):  # fmt: skip
        T = hidden_shape[0]
        specs = (
            (3, dtype, tuple(hidden_shape)),
            (4, torch.int32, (T, top_k)),
            (5, torch.float32, (T, top_k)),
        )
        self.data, (self.hidden, self.slot, self.weight), _ = _allocate(
            ((1, layer), (2, placement_version)), specs
        )


_SECONDS_KEY = _key(2, _I64)  # DispatchResponse.compute_seconds: key, then 8 bytes (a double)


class DispatchResponseBuffer:
    """A DispatchResponse laid out before its output exists: the expert compute writes `output`
    [T, H] (a view of `data`) in place, then `finish(compute_seconds)` returns `data`.
    compute_seconds is always present (protobuf would omit an exact 0.0; decoders accept both)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype):
        self.data, (self.output,), tail = _allocate((), ((1, dtype, tuple(shape)),), tail=1 + 8)
        _write(self.data, tail, _SECONDS_KEY)
        # made now, so that finishing after the compute is one store of a double
        self._seconds = ctypes.c_double.from_address(_address(self.data) + tail + 1)

    def finish(self, compute_seconds: float) -> bytes:
        self._seconds.value = compute_seconds
        return self.data


def encode_dispatch_request(req: DispatchRequest) -> bytes:
    """Serialized DispatchRequest (byte-identical to protobuf's); copies each tensor once."""
    return _encode(((1, req.layer), (2, req.placement_version)),
                   ((3, req.hidden), (4, req.slot), (5, req.weight)))  # fmt: skip


def encode_dispatch_response(resp: DispatchResponse) -> bytes:
    """Serialized DispatchResponse (byte-identical to protobuf's); copies the output once."""
    seconds = struct.pack("<d", resp.compute_seconds)
    tail = b"" if seconds == bytes(8) else _key(2, _I64) + seconds  # proto3 omits all-zero bits
    return _encode((), ((1, resp.output),), tail)


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


def decode_dispatch_request(buf: bytes) -> DispatchRequest:
    """Parse a serialized DispatchRequest; tensors view `buf` (no copy)."""
    req = _request_as_written(buf) if type(buf) is bytes else None
    return _parse_dispatch_request(buf) if req is None else req


def decode_dispatch_response(buf: bytes) -> DispatchResponse:
    """Parse a serialized DispatchResponse; the output views `buf` (no copy)."""
    resp = _response_as_written(buf) if type(buf) is bytes else None
    return _parse_dispatch_response(buf) if resp is None else resp


def _parse_dispatch_request(buf: bytes) -> DispatchRequest:
    """The general parser: any valid encoding; WireError naming what is wrong otherwise."""
    layer, version, tensors = _decode_ints_and_tensors(
        buf, "DispatchRequest", {3: "hidden", 4: "slot", 5: "weight"}
    )
    return DispatchRequest(layer & 0xFFFFFFFF, version, *tensors)


def _parse_dispatch_response(buf: bytes) -> DispatchResponse:
    spans, seconds = [], 0.0
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == 1:
            _expect(field, wire_type, _LEN, "DispatchResponse")
            spans.append(value)
        elif field == 2:
            _expect(field, wire_type, _I64, "DispatchResponse")
            seconds = struct.unpack("<d", value)[0]
    return DispatchResponse(_decode_tensor(buf, spans, "output") if spans else None, seconds)


# The fast way in: a message whose bytes are exactly what our encoders write for some values
# (every Dispatch our peers send) is read by reading those values off its first tensor headers
# and comparing the integer fields and headers of that layout (`_ints`, `_layout`: the encoders'
# own, cached) with the bytes, instead of parsing it field by field. The comparison is the
# proof: equal bytes decode to those values whatever parser reads them. Anything else (other
# encoders' field order, unknown fields, malformed input) takes the general parser above, which
# also gives the errors. (Why bother: a Dispatch arrives after a long wait, when the CPU caches
# hold the expert weights, and every Python function a decode touches first costs tens of
# microseconds then.)
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


def _request_as_written(buf: bytes) -> DispatchRequest | None:
    """`buf` decoded if it is laid out as `DispatchRequestBuffer` writes a request (hidden, slot
    and weight present), else None. Never raises."""
    try:
        pos, layer, version = 0, 0, 0
        if buf[pos] == 0x08:
            layer, pos = _read_varint(buf, pos + 1, len(buf))
        if buf[pos] == 0x10:
            version, pos = _read_varint(buf, pos + 1, len(buf))
        dtype, (T, H), pos = _tensor_head(buf, pos)
        _, (_, K), _ = _tensor_head(buf, pos)
        specs = ((3, dtype, (T, H)), (4, torch.int32, (T, K)), (5, torch.float32, (T, K)))
        views = _as_written(buf, ((1, layer), (2, version)), specs, 0)
    except _NOT_AS_WRITTEN:
        return None
    return None if views is None else DispatchRequest(layer & 0xFFFFFFFF, version, *views)


def _response_as_written(buf: bytes) -> DispatchResponse | None:
    """`buf` decoded if it is laid out as `DispatchResponseBuffer` writes a response (output, then
    compute_seconds), else None. Never raises."""
    try:
        dtype, (T, H), pos = _tensor_head(buf, 0)
        views = _as_written(buf, (), ((1, dtype, (T, H)),), 1 + 8)
        if views is None or buf[pos] != _SECONDS_KEY[0]:
            return None
    except _NOT_AS_WRITTEN:
        return None
    return DispatchResponse(views[0], struct.unpack_from("<d", buf, pos + 1)[0])


# ---------------------------------------------------------------------------------------------
# ExpertWeights (the FetchExperts stream message: peer copy of one expert), same approach
# ---------------------------------------------------------------------------------------------
@dataclass
class ExpertWeights:
    """`moecluster.expert.v1.ExpertWeights`. Missing tensors decode as None."""

    layer: int
    logical_expert: int
    w13: torch.Tensor | None  # [2I, H]
    w2: torch.Tensor | None  # [H, I]


def encode_expert_weights(msg: ExpertWeights) -> bytes:
    """Serialized ExpertWeights."""
    return _encode(((1, msg.layer), (2, msg.logical_expert)), ((3, msg.w13), (4, msg.w2)))


def decode_expert_weights(buf: bytes) -> ExpertWeights:
    """Parse a serialized ExpertWeights; tensors view `buf` (no copy)."""
    layer, expert, tensors = _decode_ints_and_tensors(buf, "ExpertWeights", {3: "w13", 4: "w2"})
    expert &= 0xFFFFFFFF
    expert = expert - (1 << 32) if expert >= 1 << 31 else expert  # int32
    return ExpertWeights(layer & 0xFFFFFFFF, expert, *tensors)


# ---------------------------------------------------------------------------------------------
# gRPC names and channel options shared by expert workers and their clients
# ---------------------------------------------------------------------------------------------
EXPERT_SERVICE = "moecluster.expert.v1.Expert"
DISPATCH_METHOD = f"/{EXPERT_SERVICE}/Dispatch"
FETCH_EXPERTS_METHOD = f"/{EXPERT_SERVICE}/FetchExperts"
MAX_MESSAGE_BYTES = 256 << 20


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options: message size limits raised for [T, H] tensors."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
