"""Tensor wire format: round trips, byte-compatibility with the generated protobuf classes,
zero-copy decoding, and clear errors for malformed tensors."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rpc import expert_pb2, wire

from .wire_encoders import (
    encode_dispatch_request,
    encode_dispatch_response,
    tensor_from_proto,
    tensor_to_proto,
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _buffer_range(b: bytes) -> tuple[int, int]:
    start = np.frombuffer(b, dtype=np.uint8).ctypes.data
    return start, start + len(b)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(3, 7), (1, 7168), (0, 5), (4,), ()], ids=str)
def test_proto_tensor_round_trip(dtype, shape):
    t = _random(shape, dtype)
    msg = tensor_to_proto(t)
    assert msg.dtype == wire.dtype_name(dtype) and list(msg.shape) == list(shape)
    back = tensor_from_proto(expert_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_dispatch_round_trip_is_zero_copy_on_receive(dtype):
    hidden = _random((9, 384), dtype)
    slot = torch.tensor([[0, -1, 3]] * 9, dtype=torch.int32)
    weight = torch.rand(9, 3)
    req = wire.DispatchRequest(layer=3, placement_version=7, hidden=hidden, slot=slot, weight=weight)
    data = encode_dispatch_request(req)
    back = wire.decode_dispatch_request(data)
    assert (back.layer, back.placement_version) == (3, 7)
    for got, want in ((back.hidden, hidden), (back.slot, slot), (back.weight, weight)):
        assert got.dtype == want.dtype and torch.equal(got, want)
        lo, hi = _buffer_range(data)
        assert lo <= got.data_ptr() and got.data_ptr() + got.numel() * got.element_size() <= hi, (
            "decode copied"
        )
    assert req.nbytes() == hidden.numel() * hidden.element_size() + slot.numel() * 4 + weight.numel() * 4

    resp = wire.decode_dispatch_response(encode_dispatch_response(wire.DispatchResponse(hidden, 0.5)))
    assert resp.compute_seconds == 0.5 and torch.equal(resp.output, hidden)


def _pb_request(layer, version, hidden, slot, weight):
    msg = expert_pb2.DispatchRequest(layer=layer, placement_version=version)
    for name, t in (("hidden", hidden), ("slot", slot), ("weight", weight)):
        if t is not None:
            tensor_to_proto(t, getattr(msg, name))
    return msg


@settings(max_examples=60, deadline=None)
@given(
    layer=st.integers(0, 2**32 - 1),
    version=st.integers(0, 2**64 - 1),
    tokens=st.integers(0, 6),
    hidden_size=st.integers(1, 40),
    top_k=st.integers(0, 4),
    dtype=st.sampled_from(FLOATS),
    seconds=st.floats(allow_nan=False),
    with_weight=st.booleans(),
)
def test_codec_matches_generated_classes(
    layer, version, tokens, hidden_size, top_k, dtype, seconds, with_weight
):
    hidden = _random((tokens, hidden_size), dtype)
    slot = torch.randint(-1, 8, (tokens, top_k), dtype=torch.int32)
    weight = torch.rand(tokens, top_k) if with_weight else None
    ours = encode_dispatch_request(wire.DispatchRequest(layer, version, hidden, slot, weight))
    theirs = _pb_request(layer, version, hidden, slot, weight).SerializeToString()
    assert ours == theirs
    back = wire.decode_dispatch_request(theirs)
    assert (back.layer, back.placement_version) == (layer, version)
    assert torch.equal(back.hidden, hidden) and torch.equal(back.slot, slot)
    assert back.weight is None if weight is None else torch.equal(back.weight, weight)

    resp = expert_pb2.DispatchResponse(output=tensor_to_proto(hidden), compute_seconds=seconds)
    assert encode_dispatch_response(wire.DispatchResponse(hidden, seconds)) == resp.SerializeToString()
    decoded = wire.decode_dispatch_response(resp.SerializeToString())
    assert decoded.compute_seconds == seconds and torch.equal(decoded.output, hidden)


def test_decoder_accepts_any_field_order_unknown_fields_and_unpacked_shape():
    hidden = torch.randn(2, 3)
    pieces = [
        expert_pb2.DispatchRequest(hidden=tensor_to_proto(hidden)).SerializeToString(),
        b"\xf8\x07\x2a",  # unknown field 127 (varint 42)
        expert_pb2.DispatchRequest(placement_version=5).SerializeToString(),
        expert_pb2.DispatchRequest(layer=2).SerializeToString(),
    ]
    back = wire.decode_dispatch_request(b"".join(pieces))
    assert (back.layer, back.placement_version) == (2, 5) and torch.equal(back.hidden, hidden)

    data = hidden.numpy().tobytes()
    unpacked = b"\x0a\x07float32" + b"\x10\x02\x10\x03" + b"\x1a" + bytes([len(data)]) + data
    msg = b"\x1a" + bytes([len(unpacked)]) + unpacked
    assert torch.equal(wire.decode_dispatch_request(msg).hidden, hidden)


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both absent, or the same dtype and shape over the same bytes (both decoders view the message)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype, a.shape) == (b.dtype, b.shape) and (a.numel() == 0 or a.data_ptr() == b.data_ptr())


def _same_request(a: wire.DispatchRequest, b: wire.DispatchRequest) -> bool:
    return (a.layer, a.placement_version) == (b.layer, b.placement_version) and all(
        _same_tensor(x, y)
        for x, y in zip((a.hidden, a.slot, a.weight), (b.hidden, b.slot, b.weight), strict=True)
    )


@settings(max_examples=300, deadline=None)
@given(
    layer=st.integers(0, 2**32 - 1),
    version=st.integers(0, 2**64 - 1),
    tokens=st.integers(0, 200),
    hidden_size=st.integers(1, 300),
    top_k=st.integers(0, 9),
    dtype=st.sampled_from(FLOATS),
    edit=st.sampled_from(["none", "flip", "drop", "append", "truncate"]),
    where=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_fast_decode_agrees_with_the_general_parser(
    layer, version, tokens, hidden_size, top_k, dtype, edit, where, byte
):
    """Messages as our encoders write them are read by matching their layout rather than parsing:
    they must take that path, and after any edit the fast path either reads exactly what the
    general parser reads or declines (and the general parser answers, or raises WireError)."""
    hidden = _random((tokens, hidden_size), dtype)
    slot = torch.randint(-1, 8, (tokens, top_k), dtype=torch.int32)
    req = wire.DispatchRequest(layer, version, hidden, slot, torch.rand(tokens, top_k))
    out = wire.DispatchResponseBuffer((tokens, hidden_size), dtype)
    out.output.copy_(hidden)
    for data, fast, general, same in (
        (
            encode_dispatch_request(req),
            wire._request_as_written,
            wire._parse_dispatch_request,
            _same_request,
        ),
        (
            out.finish(0.125),
            wire._response_as_written,
            wire._parse_dispatch_response,
            lambda a, b: (
                struct.pack("<d", a.compute_seconds) == struct.pack("<d", b.compute_seconds)
                and _same_tensor(a.output, b.output)
            ),
        ),
    ):
        assert fast(data) is not None, "a message as our encoder writes it missed the fast path"
        i = int(where * (len(data) - 1))
        data = {
            "none": data,
            "flip": data[:i] + bytes([data[i] ^ (byte or 1)]) + data[i + 1 :],
            "drop": data[:i] + data[i + 1 :],
            "append": data + bytes([byte]),
            "truncate": data[:i],
        }[edit]
        quick = fast(data)
        try:
            parsed = general(data)
        except wire.WireError:
            assert quick is None
            continue
        assert quick is None or same(quick, parsed)


@pytest.mark.parametrize(
    "dtype, shape, nbytes, message",
    [
        ("float64", [2], 16, "unknown dtype"),
        ("", [2], 8, "unknown dtype"),
        ("float32", [2, 3], 20, "needs 24 bytes, got 20"),
        ("bfloat16", [4], 9, "needs 8 bytes, got 9"),
        ("float32", [-1, 2], 8, "negative dimension"),
        ("float32", [2**40, 2**40], 8, "needs"),
        ("float32", [0, 2**62, 2**62], 0, "overflow"),  # torch refuses the view: still a WireError
    ],
)
def test_tensor_errors_are_clear(dtype, shape, nbytes, message):
    with pytest.raises(wire.WireError, match=message):
        wire.tensor_from_buffer(dtype, shape, b"\0" * nbytes)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x08", "varint"),  # truncated varint
        (b"\x1a\x05ab", "past the end"),  # LEN field longer than the message
        (b"\x0b", "wire type 3"),  # group start: unsupported
        (b"\x1a\x00" + b"\x08\x01", "hidden: unknown dtype ''"),  # empty Tensor message
        (b"\x0a\x01x", "wire type 2, expected 0"),  # layer as bytes
        (b"\x00", "field number 0"),
    ],
)
def test_message_errors_are_clear(data, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_dispatch_request(data)


def test_encoding_copies_any_layout_once():
    """Contiguous CPU tensors are copied into the message by memcpy, others by torch's copy: the
    same bytes either way."""
    hidden = _random((6, 10), torch.bfloat16)
    slot = torch.randint(-1, 8, (3, 6), dtype=torch.int32)
    weight = torch.rand(3, 6)
    strided = wire.DispatchRequest(1, 2, hidden.t().contiguous().t(), slot.t(), weight.t())
    assert not strided.hidden.is_contiguous() and not strided.slot.is_contiguous()
    contiguous = wire.DispatchRequest(1, 2, hidden, slot.t().contiguous(), weight.t().contiguous())
    assert encode_dispatch_request(strided) == encode_dispatch_request(contiguous)


@pytest.mark.parametrize(
    "data",
    [  # empty tensors whose second dimension is 2**64 - 1: -1 as the int64 it is on the wire
        "1a160a07666c6f61743332120b00ffffffffffffffffff01220b0a05696e743332120200022a0d0a07666c6f6174333212020002",
        "0a160a07666c6f61743332120b00ffffffffffffffffff01110000000000000000",
    ],
)
def test_negative_dimensions_are_refused_on_every_path(data):
    decode = wire.decode_dispatch_request if data.startswith("1a") else wire.decode_dispatch_response
    with pytest.raises(wire.WireError, match="negative dimension"):
        decode(bytes.fromhex(data))


def test_unsupported_tensor_dtype_on_send():
    with pytest.raises(wire.WireError, match="cannot go on the wire"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(wire.WireError, match="cannot go on the wire"):
        wire.DispatchResponseBuffer((2, 3), torch.float64)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_messages_built_in_place_are_the_protobuf_bytes(dtype):
    """DispatchRequestBuffer / DispatchResponseBuffer: the sender writes the tensors straight into
    the message; the result is what protobuf writes (and parses) for the same fields."""
    x = _random((10, 48), dtype)
    rows = torch.tensor([1, 4, 5, 9])
    slot = torch.randint(-1, 6, (4, 3), dtype=torch.int32)
    weight = torch.rand(4, 3)
    req = wire.DispatchRequestBuffer(5, 2**40, (4, 48), dtype, 3)
    torch.index_select(x, 0, rows, out=req.hidden)
    req.slot.copy_(slot.long())  # cast on the way in
    req.weight.copy_(weight)
    assert req.data == _pb_request(5, 2**40, x[rows], slot, weight).SerializeToString()
    assert req.data == encode_dispatch_request(wire.DispatchRequest(5, 2**40, x[rows], slot, weight))

    resp = wire.DispatchResponseBuffer((4, 48), dtype)
    resp.output.copy_(x[rows] * 2)
    data = resp.finish(0.25)
    parsed = expert_pb2.DispatchResponse.FromString(data)
    assert parsed.compute_seconds == 0.25 and torch.equal(tensor_from_proto(parsed.output), x[rows] * 2)
    assert data == encode_dispatch_response(wire.DispatchResponse(x[rows] * 2, 0.25))
    empty = wire.DispatchResponseBuffer((0, 48), dtype).finish(0.0)  # always carries the seconds
    assert expert_pb2.DispatchResponse.FromString(empty).output.shape == [0, 48]
