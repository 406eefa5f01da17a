"""Would a persistent bidirectional gRPC stream per (attention worker, expert worker) pair beat a
unary call per MoE layer? Round trips of the same raw bytes through an echo server in another
process, this machine, medians over interleaved iterations:

  unary         a blocking unary call (what the dispatch client's gRPC transport made, on a
                thread of its pool, before it moved to one DispatchStream per worker)
  stream_sync   one long-lived stream_stream call of the sync API: each request is put on a
                queue its request iterator reads (a gRPC thread consumes it), the answer is the
                next item of the response iterator
  stream_aio    the same over grpc.aio (an asyncio event loop in the caller: what a client built
                around a stream would run)
  unary_tls, stream_sync_tls  the first two over TLS keyed by a cluster secret (services/dataplane/tls.py:
                what a cluster's expert port serves)

Payloads: a 1-token Dispatch of the small preset (1.6 KB) and of DeepSeek-V3's width (14.4 KB),
and 32 tokens of V3 width (460 KB).

    python -m benchmarks.bench_grpc_streams [--out benchmarks/results/grpc_streams.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import queue
import random
import statistics
import time
from concurrent import futures
from pathlib import Path

import grpc

from services.dataplane import tls

UNARY, STREAM = "/bench.Echo/Unary", "/bench.Echo/Stream"
SIZES = {"small_1_token": 1_600, "v3_1_token": 14_400, "v3_32_tokens": 460_000}
SECRET = "bench-grpc-streams"
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _serve(port_out) -> None:
    raw = lambda b: b  # noqa: E731
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, raw, raw),
        "Stream": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (r for r in it), raw, raw),
    }
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port_out.put((server.add_insecure_port("127.0.0.1:0"), tls.add_port(server, "127.0.0.1:0", SECRET)))
    server.start()
    server.wait_for_termination()


class SyncStream:
    def __init__(self, channel: grpc.Channel):
        self.requests: queue.Queue = queue.Queue()
        call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        self.responses = call(iter(self.requests.get, None))

    def __call__(self, payload: bytes) -> bytes:
        self.requests.put(payload)
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(None)


async def _aio_round_trips(address: str, payloads: list[bytes]) -> list[float]:
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)()
        out = []
        for p in payloads:
            t0 = time.perf_counter()
            await call.write(p)
            await call.read()
            out.append(time.perf_counter() - t0)
        await call.done_writing()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/grpc_streams.json")
    args = ap.parse_args()
    ports = mp.Queue()
    server = mp.get_context("fork").Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    port, tls_port = ports.get(timeout=30)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address, options=OPTIONS)
    unary = channel.unary_unary(UNARY, request_serializer=None, response_deserializer=None)
    stream = SyncStream(channel)
    tls_channel = tls.channel(f"127.0.0.1:{tls_port}", SECRET, OPTIONS)
    unary_tls = tls_channel.unary_unary(UNARY, request_serializer=None, response_deserializer=None)
    stream_tls = SyncStream(tls_channel)
    results = {}
    try:
        for name, size in SIZES.items():
            payload = random.randbytes(size)
            calls = {
                "unary": unary,
                "stream_sync": stream,
                "unary_tls": unary_tls,
                "stream_sync_tls": stream_tls,
            }
            times = {k: [] for k in calls}
            for _ in range(50):  # warm-up
                for call in calls.values():
                    call(payload)
            rng = random.Random(size)
            for _ in range(args.iterations):
                for kind in rng.sample(list(calls), len(calls)):
                    t0 = time.perf_counter()
                    calls[kind](payload)
                    times[kind].append(time.perf_counter() - t0)
            aio = asyncio.run(_aio_round_trips(address, [payload] * (args.iterations + 50)))[50:]
            row = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            row["stream_aio"] = statistics.median(aio) * 1e3
            row["bytes"] = size
            results[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            print(name, results[name], flush=True)
    finally:
        stream.close()
        stream_tls.close()
        channel.close()
        tls_channel.close()
        server.kill()
    out = {
        "benchmark": "gRPC round trip: unary call vs a persistent bidirectional stream (echo, loopback, another process)",
        "machine": {"platform": platform.platform(), "grpcio": grpc.__version__},
        "unit": "ms, median",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
