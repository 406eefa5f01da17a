"""The data plane's messages on the wire (`proto/expert.proto`), without the generated classes.

Python peers write and read the protobuf wire format of `DispatchRequest` / `DispatchResponse`
directly (the bytes are exactly what protobuf writes for the same message: field order, packed
shape, defaults omitted; the decoder accepts any valid encoding - any field order, unknown
fields skipped, unpacked shape - and tests check both directions against the generated classes):

* sending: `DispatchRequestBuffer` / `DispatchResponseBuffer` lay the message out first, in an
  uninitialised `bytes` object, and hand out writable tensor views of its payloads, so the
  producer writes straight into the message (the client's `index_select` of a worker's rows,
  the expert compute's final cast): no copy beyond the protobuf bytes themselves;
* receiving: decoded tensors are `torch.frombuffer` views of the received bytes (no copy). A
  message exactly as our encoders write it is recognised by its layout (see `_as_written`)
  rather than parsed field by field; anything else takes the general parser.

`encode_expert_weights` / `decode_expert_weights` do the same for the `ExpertWeights` messages
of the FetchExperts stream (peer copy of expert weights, ~88 MB per DeepSeek-V3 expert in bf16),
encoded from finished tensors with one copy each.

The primitives (tensor bytes, field framing, in-place layout, the general parser) are
`services/rpc/wire_format.py`; its public names are re-exported here, so `from services.rpc
import wire` is all a caller needs. (Tests build Dispatch messages from finished tensors, and
convert generated `Tensor` messages, with `tests/wire_encoders.py`.)

Decoded tensors share memory with an immutable `bytes` object: do not write into them (they may
also be unaligned, which CPU kernels handle; `.to(device)` copies anyway).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.rpc.wire_format import (
    _I64,
    _LEN,
    _NOT_AS_WRITTEN,
    _VARINT,
    DTYPE_NAMES,
    DTYPES,
    WireError,
    _address,
    _allocate,
    _as_written,
    _decode_ints_and_tensors,
    _decode_tensor,
    _encode,
    _expect,
    _fields,
    _key,
    _read_varint,
    _tensor_head,
    _varint,
    _write,
    copy_into,
    dtype_name,
    tensor_bytes,
    tensor_from_buffer,
)

__all__ = [
    "DISPATCH_METHOD",
    "DISPATCH_STREAM_METHOD",
    "DTYPES",
    "DTYPE_NAMES",
    "EXPERT_SERVICE",
    "FETCH_EXPERTS_METHOD",
    "MAX_MESSAGE_BYTES",
    "DispatchRequest",
    "DispatchRequestBuffer",
    "DispatchResponse",
    "DispatchResponseBuffer",
    "ExpertWeights",
    "WireError",
    "copy_into",
    "decode_dispatch_request",
    "decode_dispatch_response",
    "decode_expert_weights",
    "dtype_name",
    "encode_dispatch_error",
    "encode_expert_weights",
    "grpc_options",
    "tensor_bytes",
    "tensor_from_buffer",
]


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
    """`moecluster.expert.v1.DispatchResponse`, or a DispatchStreamResponse (the same fields, and
    for a refused request only error_code, a gRPC status code, and error_message)."""

    output: torch.Tensor | None  # [T, H]
    compute_seconds: float = 0.0
    error_code: int = 0
    error_message: str = ""


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
    spans, seconds, code, message = [], 0.0, 0, ""
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == 1:
            _expect(field, wire_type, _LEN, "DispatchResponse")
            spans.append(value)
        elif field == 2:
            _expect(field, wire_type, _I64, "DispatchResponse")
            seconds = struct.unpack("<d", value)[0]
        elif field == 3:  # (DispatchStreamResponse's error)
            _expect(field, wire_type, _VARINT, "DispatchStreamResponse")
            code = value & 0x7FFFFFFF
        elif field == 4:
            _expect(field, wire_type, _LEN, "DispatchStreamResponse")
            message = bytes(buf[value[0] : value[1]]).decode("utf-8", "replace")
    output = _decode_tensor(buf, spans, "output") if spans else None
    return DispatchResponse(output, seconds, code, message)


def encode_dispatch_error(code: int, message: str) -> bytes:
    """A DispatchStreamResponse refusing one request: `code` a gRPC status code (> 0)."""
    text = message.encode()
    return _key(3, _VARINT) + _varint(code) + _key(4, _LEN) + _varint(len(text)) + text


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
    w13_scale: torch.Tensor | None = None  # FP8 kept: [2I / bn, ceil(H / bk)] fp32
    w2_scale: torch.Tensor | None = None  # FP8 kept: [ceil(H / bn), ceil(I / bk)] fp32


def encode_expert_weights(msg: ExpertWeights) -> bytes:
    """Serialized ExpertWeights."""
    tensors = ((3, msg.w13), (4, msg.w2), (5, msg.w13_scale), (6, msg.w2_scale))
    return _encode(((1, msg.layer), (2, msg.logical_expert)), tensors)


def decode_expert_weights(buf: bytes) -> ExpertWeights:
    """Parse a serialized ExpertWeights; tensors view `buf` (no copy)."""
    names = {3: "w13", 4: "w2", 5: "w13_scale", 6: "w2_scale"}
    layer, expert, tensors = _decode_ints_and_tensors(buf, "ExpertWeights", names)
    expert &= 0xFFFFFFFF
    expert = expert - (1 << 32) if expert >= 1 << 31 else expert  # int32
    return ExpertWeights(layer & 0xFFFFFFFF, expert, *tensors)


# ---------------------------------------------------------------------------------------------
# gRPC names and channel options shared by expert workers and their clients
# ---------------------------------------------------------------------------------------------
EXPERT_SERVICE = "moecluster.expert.v1.Expert"
DISPATCH_METHOD = f"/{EXPERT_SERVICE}/Dispatch"
DISPATCH_STREAM_METHOD = f"/{EXPERT_SERVICE}/DispatchStream"
FETCH_EXPERTS_METHOD = f"/{EXPERT_SERVICE}/FetchExperts"
MAX_MESSAGE_BYTES = 256 << 20


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options: message size limits raised for [T, H] tensors."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
