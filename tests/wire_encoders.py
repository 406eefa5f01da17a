"""Encoders the tests use and no service does (services build their messages in place with
`wire.DispatchRequestBuffer` / `wire.DispatchResponseBuffer`):

* `encode_dispatch_request` / `encode_dispatch_response`: Dispatch messages from finished
  tensors (any device or layout, absent tensors allowed), each copied once, by the codec's own
  `_encode` (as `wire.encode_expert_weights` is): the bytes are exactly what protobuf writes;
* `routed_dispatch`: a routed ExpertDispatch of random tokens, for the dispatch client's tests;
* `tensor_to_proto` / `tensor_from_proto`: the generated `expert_pb2.Tensor` message from and to
  a tensor (protobuf copies the bytes into the message, and again when `.data` is read).
"""

import struct

import torch

from services.model.messages import ExpertDispatch
from services.rpc import expert_pb2
from services.rpc.wire import _SECONDS_KEY, DispatchRequest, DispatchResponse
from services.rpc.wire_format import _encode, dtype_name, tensor_bytes, tensor_from_buffer


def encode_dispatch_request(req: DispatchRequest) -> bytes:
    """Serialized DispatchRequest (byte-identical to protobuf's); copies each tensor once."""
    return _encode(((1, req.layer), (2, req.placement_version)),
                   ((3, req.hidden), (4, req.slot), (5, req.weight)))  # fmt: skip


def encode_dispatch_response(resp: DispatchResponse) -> bytes:
    """Serialized DispatchResponse (byte-identical to protobuf's); copies the output once.
    Unlike `wire.DispatchResponseBuffer`, omits compute_seconds when it is 0.0, as protobuf does."""
    seconds = struct.pack("<d", resp.compute_seconds)
    tail = b"" if seconds == bytes(8) else _SECONDS_KEY + seconds  # proto3 omits all-zero bits
    return _encode((), ((1, resp.output),), tail)


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


def routed_dispatch(cfg, T: int = 16, seed: int = 0) -> ExpertDispatch:
    """An ExpertDispatch of T random tokens (hidden states, distinct top-k experts, weights) for the
    first MoE layer of `cfg`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    topk = torch.stack(
        [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok] for _ in range(T)]
    )
    weight = torch.rand(T, cfg.num_experts_per_tok, generator=g)
    return ExpertDispatch.routed(cfg.moe_layers[0], 0, x, topk, weight, cfg.n_routed_experts)
