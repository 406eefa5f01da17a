"""Dispatch round trip per transport, and vs a raw gRPC echo of the same bytes, over loopback to
another process.

    .venv/bin/python benchmarks/bench_dispatch.py [--quick] [--label NAME]
        -> benchmarks/results/dispatch.json {"runs": {NAME: ...}} (other runs kept)

Two cases: DeepSeek-V3 width (hidden 7168, bf16, top-8 of 16 experts with a tiny expert
intermediate size so the FFN does not dominate) and the `small` preset's experts (hidden 384,
fp32, top-6 of 64, intermediate 128). For T = 1, 8, 32, 64, 256 tokens it measures, interleaved:

  grpc_stream_ms   the same Dispatch on a long-lived DispatchStream (services/dataplane/grpc_stream.py,
                   what the "grpc" transport sends on): the request's bytes queued on the stream,
                   its answer read off it; grpc_stream_minus_compute_ms is it beyond the worker's
                   compute; remote_experts_grpc_stream_ms the full client path over it:
                   RemoteExperts.dispatch + combine (replica choice, grouping, scatter-add) with
                   DispatchConfig(transport="grpc")
  compute_ms       the expert FFN time the worker reports in DispatchResponse.compute_seconds
  unary_*          raw unary gRPC calls (no transport of RemoteExperts makes one per dispatch; the
                   issue's overhead target is defined on them, like with like):
    unary_echo_ms    raw bytes echo (identity serializers) of the hidden states' bytes
    unary_matched_echo_ms  a raw echo of the Dispatch request's bytes whose handler first runs the
                   same expert compute (on tensors decoded once, up front) - the transport under
                   the same load, without any of our per-call code; unary_matched_transport_ms is
                   it minus that compute
    unary_dispatch_ms  encode + a unary Dispatch RPC + decode (wire.py codec, one worker holds
                   every expert; the request built as RemoteExperts builds one: laid out by
                   DispatchRequestBuffer, the tensors copied in)
  overhead         (unary_dispatch - compute - unary_echo) / unary_echo, medians of per-call values
                   (the issue's definition: a unary Dispatch against a unary echo)
  overhead_vs_matched  (unary_dispatch - compute - unary_matched_transport) /
                   unary_matched_transport: what our code adds over the transport of the same
                   bytes after the same compute (a reply after a long compute wakes a client that
                   has gone idle, and finds the caches full of expert weights: that transport
                   costs more than the plain echo)
  no_compute_overhead  the same for a unary request of the same bytes whose slots are all -1 (the
                   worker validates and answers zeros): our fixed cost without the expert
                   compute and the idle wake-ups a long compute causes on both sides
  shm_ms           the same Dispatch through shared memory (services/dataplane/shm.py): rows copied
                   into the pair's buffer, doorbell, compute from and into the buffer, answer;
                   shm_minus_compute_ms is it beyond the worker's compute (the AFD budget's
                   measure: ~0.3 ms per MoE layer for both directions); shm_spin_* the same with
                   both sides polling --spin-us before they block (`--expert-spin-us`); shm_no_compute_* the
                   same with every slot -1; remote_experts_shm_ms the full client path over it
  tcp_ms           the same Dispatch over a TCP connection (services/dataplane/tcp.py, plaintext: the
                   benchmark's worker has no secret): the same frames, the rows sent from the
                   buffer they were written into; tcp_minus_compute_ms beyond the compute;
                   remote_experts_tcp_ms the full client path over it
  memcpy_payloads_ms  one copy of the request's and the answer's payloads in this process (this
                   machine's copy bandwidth over the bytes a call moves)

The calls of one iteration go in a shuffled order (seeded), so every kind follows every other
kind equally often on average: a call that follows an expert compute pays more (the caches hold expert
weights, not the code the call runs), and a fixed cyclic order, which rotating a list keeps,
made Dispatch follow the matched echo's compute four times in five while the matched echo
followed the plain echo.

Bytes copied per call, by construction of the codec (tests check the decode side shares memory):
client encode = request payload once (the gather of the worker's rows writes into the message),
worker decode 0, worker encode 0 (the expert output is computed into the response's bytes),
client decode 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `proto` must resolve to this repo's package (proto-plus has one too)

import grpc  # noqa: E402
import torch  # noqa: E402

from services.dataplane import tcp  # noqa: E402
from services.experts.client import ExpertClient  # noqa: E402
from services.model.kernels import cpu_kernels  # noqa: E402
from services.rpc import wire  # noqa: E402

ECHO_METHOD = "/bench.Echo/Echo"
MATCHED_METHOD = "/bench.Echo/Matched"
MATCHED_TIMES_METHOD = "/bench.Echo/MatchedTimes"
TOKENS = [1, 8, 32, 64, 256]

CASES = {
    # name: (preset overrides, compute dtype, iterations per T). bf16 GEMMs are slow on CPUs
    # without native bf16 (~0.6 s per T=256 call here), hence fewer iterations at large T.
    "v3-hidden-7168-bf16": (
        dict(
            hidden_size=7168,
            moe_intermediate_size=16,
            n_routed_experts=16,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            intermediate_size=16,
            vocab_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_shared_experts=0,
        ),
        "bfloat16",
        {1: 200, 8: 100, 32: 30, 64: 30, 256: 15},
    ),
    "small-hidden-384-fp32": (
        dict(vocab_size=16, num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=16),
        "float32",
        {1: 300, 8: 300, 32: 200, 64: 200, 256: 150},
    ),
}


def serve(model_dir: str, dtype: str, port_queue, spin_us: float) -> None:
    """Server process: the Expert service and a raw echo on one grpc server, set up as
    `ExpertServer` sets up an expert worker's (sync server, a pool of threads), and the
    shared-memory Dispatch beside it (as ExpertServer starts it)."""
    torch.set_num_threads(1)
    from services.dataplane import shm
    from services.experts.server import ExpertWorkerConfig
    from services.experts.servicer import ExpertServicer, add_expert_service, status_of
    from services.experts.store import SlotStore
    from services.model.config import ModelConfig, parse_dtype

    cfg = ModelConfig.from_dir(model_dir)
    store = SlotStore(cfg, model_dir, parse_dtype(dtype))
    store.load(1, {layer: list(range(cfg.n_routed_experts)) for layer in cfg.moe_layers})
    worker = ExpertWorkerConfig(model=model_dir)
    server = grpc.server(
        ThreadPoolExecutor(worker.rpc_threads + worker.dispatch_streams), options=wire.grpc_options()
    )
    servicer = ExpertServicer(store)
    add_expert_service(server, servicer)
    raw = lambda b: b  # noqa: E731
    decoded, compute_seconds = {}, []

    def matched(request: bytes, context) -> bytes:
        """Echo `request` (a Dispatch request) after running its expert compute on tensors
        decoded the first time these bytes' size came (no per-call decode or response build)."""
        if len(request) not in decoded:
            req = wire.decode_dispatch_request(bytes(request))
            decoded[len(request)] = (req, torch.empty_like(req.hidden))
        req, out = decoded[len(request)]
        start = time.perf_counter()
        store.forward(req.placement_version, req.layer, req.hidden, req.slot, req.weight, out)
        compute_seconds.append(time.perf_counter() - start)
        return request

    def matched_times(request: bytes, context) -> bytes:
        """The compute seconds of the Matched calls so far (float64 little-endian), then forget them."""
        times = struct.pack(f"<{len(compute_seconds)}d", *compute_seconds)
        compute_seconds.clear()
        return times

    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Echo": unary(lambda request, context: request, raw, raw),
        "Matched": unary(matched, raw, raw),
        "MatchedTimes": unary(matched_times, raw, raw),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    shm_server = shm.ShmServer(f"127.0.0.1:{port}", servicer.compute_into, status_of)  # noqa: F841 (serves)
    spin_address = f"127.0.0.1:{port}/spin"  # the same compute, both sides polling before they block
    spinning = shm.ShmServer(spin_address, servicer.compute_into, status_of, spin_s=spin_us * 1e-6)  # noqa: F841
    tcp_server = tcp.TcpServer("127.0.0.1", servicer.compute_into, status_of)
    servicer.socket_port = tcp_server.port
    port_queue.put(port)
    server.start()
    server.wait_for_termination()


def encode_request(req: wire.DispatchRequest) -> bytes:
    """`req` serialized as the client serializes a request: laid out by `DispatchRequestBuffer`,
    each tensor copied into its payload once (memcpy for contiguous CPU tensors)."""
    buf = wire.DispatchRequestBuffer(
        req.layer, req.placement_version, req.hidden.shape, req.hidden.dtype, req.slot.shape[1]
    )
    wire.copy_into(buf.hidden, req.hidden)
    wire.copy_into(buf.slot, req.slot)
    wire.copy_into(buf.weight, req.weight)
    return buf.data


class Client:
    """The ways of sending T tokens to the server process, timed."""

    def __init__(self, address: str, cfg, remote, remote_shm, remote_tcp, spin_us: float):
        from services.dataplane import shm
        from services.dataplane.grpc_stream import DeadlineWatch, GrpcStream

        self.shm = shm.ShmChannel.connect(address)
        self.shm_spin = shm.ShmChannel.connect(address + "/spin", spin_s=spin_us * 1e-6)  # both sides poll
        self.remote_shm = remote_shm
        self.remote_tcp = remote_tcp
        port = ExpertClient(address).stats().socket_port
        self.tcp = tcp.TcpChannel.connect(tcp.socket_host(address), port)
        self.channel = grpc.insecure_channel(address, options=wire.grpc_options())
        self.echo = self.channel.unary_unary(ECHO_METHOD)
        self.matched = self.channel.unary_unary(MATCHED_METHOD)
        self.matched_times = self.channel.unary_unary(MATCHED_TIMES_METHOD)
        self.dispatch = self.channel.unary_unary(wire.DISPATCH_METHOD)
        self.watch = DeadlineWatch()  # (the stream's deadlines, as the grpc transport keeps them)
        call = self.channel.stream_stream(
            wire.DISPATCH_STREAM_METHOD, request_serializer=None, response_deserializer=None
        )
        self.stream = GrpcStream(call, self.watch)
        self.cfg, self.remote = cfg, remote

    def run_dispatch(self, req: wire.DispatchRequest) -> float:
        """encode + a unary RPC + decode; returns the worker's compute_seconds."""
        data = self.dispatch(encode_request(req), timeout=60)
        return wire.decode_dispatch_response(data).compute_seconds

    def run_stream(self, req: wire.DispatchRequest) -> float:
        """encode + the request on the DispatchStream + its answer read off it + decode;
        returns the worker's compute_seconds."""
        data = self.stream.wait(self.stream.send(encode_request(req), 60.0))
        return wire.decode_dispatch_response(data).compute_seconds

    def close(self) -> None:
        self.stream.close()
        self.watch.close()
        self.shm.close()
        self.shm_spin.close()
        self.tcp.close()
        self.channel.close()

    def run_remote(self, msg, remote=None) -> None:
        from services.model.messages import ExpertCombine

        remote = remote or self.remote
        remote.combine(ExpertCombine(remote.dispatch(msg)))

    def run_shm(self, req: wire.DispatchRequest, channel=None) -> float:
        """The rows written into the shared buffer, the doorbell, the answer; compute_seconds."""
        channel = channel or self.shm
        hidden, slot, weight = channel.request(*req.hidden.shape, req.slot.shape[1], req.hidden.dtype)
        hidden.copy_(req.hidden)
        slot.copy_(req.slot)
        weight.copy_(req.weight)
        channel.send(req.layer, req.placement_version)
        return channel.result(60)[1]

    def run_tcp(self, req: wire.DispatchRequest) -> float:
        """The rows written into the connection's buffer and sent, the answer read; compute_seconds."""
        hidden, slot, weight = self.tcp.request(*req.hidden.shape, req.slot.shape[1], req.hidden.dtype)
        hidden.copy_(req.hidden)
        slot.copy_(req.slot)
        weight.copy_(req.weight)
        self.tcp.send(req.layer, req.placement_version, 60.0)
        return self.tcp.result(60)[1]

    def measure(self, T: int, dtype: torch.dtype, iterations: int) -> dict:
        from services.model.messages import ExpertDispatch

        cfg = self.cfg
        layer, E, K, H = cfg.moe_layers[0], cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).to(dtype)
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        weight = torch.rand(T, K, generator=g)
        req = wire.DispatchRequest(layer, 1, x, topk.to(torch.int32), weight)  # one worker: slot = expert
        # the same bytes with every slot -1: the worker validates and answers zeros, so the
        # round trip is our fixed cost without expert compute (or the idle wake-ups it causes)
        idle_req = wire.DispatchRequest(layer, 1, x, torch.full((T, K), -1, dtype=torch.int32), weight)
        msg = ExpertDispatch.routed(layer, 0, x, topk, weight, E)
        echo_payload = bytes(wire.tensor_bytes(x))
        encoded_request = encode_request(req)

        for _ in range(5):  # warm up connections, allocator, kernels
            self.echo(echo_payload), self.matched(encoded_request), self.run_dispatch(req)
            self.run_dispatch(idle_req), self.run_stream(req), self.run_remote(msg), self.run_shm(req)
            self.run_shm(idle_req), self.run_remote(msg, self.remote_shm)
            self.run_tcp(req), self.run_remote(msg, self.remote_tcp), self.run_shm(req, self.shm_spin)
        self.matched_times(b"")
        kinds = (
            "echo",
            "matched",
            "dispatch",
            "idle",
            "stream",
            "remote",
            "shm",
            "shm_idle",
            "shm_spin",
            "remote_shm",
            "tcp",
            "remote_tcp",
        )
        times: dict[str, list[float]] = {k: [] for k in kinds}
        returned: dict[str, list] = {
            k: [] for k in kinds
        }  # dispatch / idle / stream / shm / tcp: compute_seconds
        calls = [
            ("echo", lambda: self.echo(echo_payload)),
            ("matched", lambda: self.matched(encoded_request)),
            ("dispatch", lambda: self.run_dispatch(req)),
            ("idle", lambda: self.run_dispatch(idle_req)),
            ("stream", lambda: self.run_stream(req)),
            ("remote", lambda: self.run_remote(msg)),
            ("shm", lambda: self.run_shm(req)),
            ("shm_idle", lambda: self.run_shm(idle_req)),
            ("shm_spin", lambda: self.run_shm(req, self.shm_spin)),
            ("remote_shm", lambda: self.run_remote(msg, self.remote_shm)),
            ("tcp", lambda: self.run_tcp(req)),
            ("remote_tcp", lambda: self.run_remote(msg, self.remote_tcp)),
        ]
        rng = random.Random(T)
        for _ in range(iterations):  # interleaved, shuffled: all kinds see the same conditions
            for kind, call in rng.sample(calls, len(calls)):
                t0 = time.perf_counter()
                returned[kind].append(call())
                times[kind].append(time.perf_counter() - t0)
        compute_s, idle_compute_s = returned["dispatch"], returned["idle"]
        matched_compute_s = [t for (t,) in struct.iter_unpack("<d", self.matched_times(b""))]
        echo_s, dispatch_s, remote_s = times["echo"], times["dispatch"], times["remote"]
        idle_s = [t - c for t, c in zip(times["idle"], idle_compute_s, strict=True)]
        matched_s = [t - c for t, c in zip(times["matched"], matched_compute_s, strict=True)]

        med = lambda v: statistics.median(v) * 1e3  # noqa: E731
        echo_ms, idle_ms = med(echo_s), med(idle_s)
        net_ms = med([d - c for d, c in zip(dispatch_s, compute_s, strict=True)])
        matched_ms = med(matched_s)
        request_bytes = len(encoded_request)
        output_bytes = T * H * dtype.itemsize
        shm_net_ms = med([t - c for t, c in zip(times["shm"], returned["shm"], strict=True)])
        shm_idle_ms = med([t - c for t, c in zip(times["shm_idle"], returned["shm_idle"], strict=True)])
        shm_spin_ms = med([t - c for t, c in zip(times["shm_spin"], returned["shm_spin"], strict=True)])
        # this machine's copy bandwidth over the same bytes: a request's and an answer's payloads
        src, dst = torch.empty(req.nbytes() + output_bytes, dtype=torch.uint8), None
        dst = torch.empty_like(src)
        copies = []
        for _ in range(50):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        memcpy_ms = med(copies)
        return {
            "tokens": T,
            "hidden": H,
            "top_k": K,
            "expert_intermediate": cfg.moe_intermediate_size,
            "iterations": iterations,
            "request_bytes": request_bytes,
            "response_bytes": output_bytes + 20,
            "compute_ms": round(med(compute_s), 4),
            "grpc_stream_ms": round(med(times["stream"]), 4),
            "grpc_stream_compute_ms": round(med(returned["stream"]), 4),
            "grpc_stream_minus_compute_ms": round(
                med([t - c for t, c in zip(times["stream"], returned["stream"], strict=True)]), 4
            ),
            "remote_experts_grpc_stream_ms": round(med(remote_s), 4),
            "unary_echo_bytes_each_way": len(echo_payload),
            "unary_echo_ms": round(echo_ms, 4),
            "unary_dispatch_ms": round(med(dispatch_s), 4),
            "unary_dispatch_minus_compute_ms": round(net_ms, 4),
            "unary_matched_echo_ms": round(med(times["matched"]), 4),
            "unary_matched_compute_ms": round(med(matched_compute_s), 4),
            "unary_matched_transport_ms": round(matched_ms, 4),
            "overhead": round((net_ms - echo_ms) / echo_ms, 4),
            "overhead_vs_matched": round((net_ms - matched_ms) / matched_ms, 4),
            "unary_no_compute_dispatch_minus_compute_ms": round(idle_ms, 4),
            "no_compute_overhead": round((idle_ms - echo_ms) / echo_ms, 4),
            "shm_ms": round(med(times["shm"]), 4),
            "shm_compute_ms": round(med(returned["shm"]), 4),
            "shm_minus_compute_ms": round(shm_net_ms, 4),
            "shm_no_compute_minus_compute_ms": round(shm_idle_ms, 4),
            "shm_spin_minus_compute_ms": round(shm_spin_ms, 4),
            "remote_experts_shm_ms": round(med(times["remote_shm"]), 4),
            "tcp_ms": round(med(times["tcp"]), 4),
            "tcp_minus_compute_ms": round(
                med([t - c for t, c in zip(times["tcp"], returned["tcp"], strict=True)]), 4
            ),
            "remote_experts_tcp_ms": round(med(times["remote_tcp"]), 4),
            "memcpy_payloads_ms": round(memcpy_ms, 4),
            "memcpy_GB_per_s": round((req.nbytes() + output_bytes) / statistics.median(copies) / 1e9, 2),
            "unary_dispatch_tokens_per_s": round(T / statistics.median(dispatch_s), 1),
            "unary_dispatch_MB_per_s": round(
                (request_bytes + output_bytes) / statistics.median(dispatch_s) / 1e6, 1
            ),
            "bytes_copied_client": req.nbytes(),  # encode; decoding the response is zero-copy
            "bytes_copied_worker": 0,  # output computed into the response; decoding is zero-copy
        }


def bench_case(
    name: str, overrides: dict, dtype_name: str, workdir: Path, iters: dict[int, int], spin_us: float
) -> list[dict]:
    from services.dataplane.placement import Placement
    from services.dataplane.remote_experts import DispatchConfig, RemoteExperts
    from services.model.config import ModelConfig, parse_dtype
    from services.presets import init_model

    preset = "tiny" if name.startswith("v3") else "small"
    model_dir = init_model(workdir / name, preset, seed=0, overrides=overrides, tokenizer=False)
    cfg = ModelConfig.from_dir(model_dir)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=serve, args=(str(model_dir), dtype_name, ports, spin_us), daemon=True)
    proc.start()
    address = f"127.0.0.1:{ports.get(timeout=120)}"
    placement = Placement.round_robin(
        cfg.num_moe_layers, cfg.n_routed_experts, (address,), cfg.n_routed_experts
    )
    remote = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="grpc"))
    remote_shm = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="shm"))
    remote_tcp = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="tcp"))
    client = Client(address, cfg, remote, remote_shm, remote_tcp, spin_us)
    rows = []
    try:
        for T in TOKENS:
            row = {"case": name, "dtype": dtype_name, **client.measure(T, parse_dtype(dtype_name), iters[T])}
            rows.append(row)
            print(
                f"{name:24s} T={T:4d}  compute {row['compute_ms']:6.3f} ms  grpc stream {row['grpc_stream_ms']:7.3f} ms "
                f"(beyond compute {row['grpc_stream_minus_compute_ms']:.3f})  remote grpc stream "
                f"{row['remote_experts_grpc_stream_ms']:7.3f} ms  unary: echo {row['unary_echo_ms']:7.3f} ms "
                f"dispatch {row['unary_dispatch_ms']:7.3f} ms overhead {row['overhead']:+.1%} (no compute "
                f"{row['no_compute_overhead']:+.1%}, vs matched transport {row['unary_matched_transport_ms']:.3f} ms "
                f"{row['overhead_vs_matched']:+.1%})  "
                f"shm {row['shm_ms']:7.3f} ms (beyond compute {row['shm_minus_compute_ms']:.3f}, "
                f"spinning {row['shm_spin_minus_compute_ms']:.3f})  "
                f"remote shm {row['remote_experts_shm_ms']:7.3f} ms  tcp {row['tcp_ms']:7.3f} ms "
                f"(beyond compute {row['tcp_minus_compute_ms']:.3f})  remote tcp {row['remote_experts_tcp_ms']:7.3f} ms",
                flush=True,
            )
    finally:
        remote.close()
        remote_shm.close()
        remote_tcp.close()
        client.close()
        proc.terminate()
        proc.join(10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dispatch.json"))
    parser.add_argument("--label", default="local", help="run name; other runs in --out are kept")
    parser.add_argument(
        "--spin-us", type=float, default=100.0, help="the shm_spin rows' polling before blocking"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, dtype, iters) in CASES.items():
            if args.quick:
                iters = dict.fromkeys(TOKENS, 10)
            rows += bench_case(name, overrides, dtype, Path(tmp), iters, args.spin_us)
    big = [r for r in rows if r["tokens"] >= 64]
    result = {
        "benchmark": "dispatch round trip per transport, and a unary Dispatch vs a raw unary gRPC echo "
        "(loopback, server in another process)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "torch_threads_per_process": 1,
            "cpu_kernels": cpu_kernels.available(),
        },
        "statistic": "median over interleaved iterations (calls in a seeded shuffled order)",
        "overhead_definition": "(unary_dispatch_ms - compute_ms - unary_echo_ms) / unary_echo_ms",
        "target": "overhead <= 0.25 for tokens >= 64",
        "target_met": all(r["overhead"] <= 0.25 for r in big),
        "max_overhead_tokens_ge_64": max(r["overhead"] for r in big),
        "target_met_vs_matched": all(r["overhead_vs_matched"] <= 0.25 for r in big),
        "max_overhead_vs_matched_tokens_ge_64": max(r["overhead_vs_matched"] for r in big),
        "shm_target": "shm_minus_compute_ms <= 0.3 at 1 token (the AFD budget per MoE layer, both ways)",
        "shm_target_met": all(r["shm_minus_compute_ms"] <= 0.3 for r in rows if r["tokens"] == 1),
        "spin_us": args.spin_us,
        "shm_spin_minus_compute_ms_at_1_token": {
            r["case"]: r["shm_spin_minus_compute_ms"] for r in rows if r["tokens"] == 1
        },
        "shm_minus_compute_ms_at_1_token": {
            r["case"]: r["shm_minus_compute_ms"] for r in rows if r["tokens"] == 1
        },
        "tcp_minus_compute_ms_at_1_token": {
            r["case"]: r["tcp_minus_compute_ms"] for r in rows if r["tokens"] == 1
        },
        "grpc_stream_minus_compute_ms_at_1_token": {
            r["case"]: r["grpc_stream_minus_compute_ms"] for r in rows if r["tokens"] == 1
        },
        "grpc_unary_minus_compute_ms_at_1_token": {
            r["case"]: r["unary_dispatch_minus_compute_ms"] for r in rows if r["tokens"] == 1
        },
        "seconds": round(time.perf_counter() - start, 1),
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(out.read_text()).get("runs", {}) if out.is_file() else {}
    runs[args.label] = result
    out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(
        f"wrote run {args.label!r} to {out} in {result['seconds']} s; target met: {result['target_met']} "
        f"(vs matched transport: {result['target_met_vs_matched']}); shared memory within 0.3 ms at 1 token: "
        f"{result['shm_target_met']}"
    )


if __name__ == "__main__":
    main()
