"""An expert worker serving several callers at once: computes in turn (`compute_concurrency` 1, the
default) against side by side (2), over shared memory.

One expert worker process (small preset, fp32, every expert held, one torch thread per compute)
answers `--callers` client threads in this process, each with its own shared-memory channel (as
attention workers or micro-batches would), each sending Dispatches of `--tokens` rows routed to
random experts, back to back. Reported per setting: Dispatches per second over all callers, the
median call time, and the worker's queueing and compute time per call (Stats). On this 2-core
VM the callers' side is light (they wait for answers), so a second compute slot has a core.

    python -m benchmarks.bench_expert_concurrency [--callers 2] [--tokens 32] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def serve(model_dir: str, concurrency: int, name: str, ready, stats_queue, stop) -> None:
    """The worker process: a SlotStore holding every expert and its shared-memory listener."""
    torch.set_num_threads(1)
    import grpc

    from services.dataplane import shm
    from services.experts.servicer import ExpertServicer
    from services.experts.store import SlotStore
    from services.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    store = SlotStore(cfg, model_dir, torch.float32)
    store.load(1, {layer: list(range(cfg.n_routed_experts)) for layer in cfg.moe_layers})
    servicer = ExpertServicer(store, compute_concurrency=concurrency)
    server = shm.ShmServer(name, servicer.compute_into, lambda e: grpc.StatusCode.INTERNAL)
    ready.set()
    stop.wait()
    calls = store.stats().dispatch_calls
    stats_queue.put({"calls": calls, "queue_s": servicer.queue_seconds, "busy_s": servicer.compute_seconds})
    server.close()


def measure(model_dir: str, concurrency: int, callers: int, tokens: int, seconds: float) -> dict:
    from services.dataplane import shm
    from services.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    ctx = mp.get_context("spawn")
    ready, stop, stats_queue = ctx.Event(), ctx.Event(), ctx.Queue()
    name = f"bench-concurrency-{os.getpid()}-{concurrency}:0"
    proc = ctx.Process(
        target=serve, args=(model_dir, concurrency, name, ready, stats_queue, stop), daemon=True
    )
    proc.start()
    assert ready.wait(300), "the worker did not start"
    E, K, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    times: list[float] = []
    lock = threading.Lock()
    until = time.monotonic() + seconds

    def caller(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        channel = shm.ShmChannel.connect(name)
        x = torch.randn(tokens, H, generator=g)
        mine = []
        while time.monotonic() < until:
            hidden, slot, weight = channel.request(tokens, H, K, torch.float32)
            hidden.copy_(x)
            slot.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).int())
            weight.fill_(1.0 / K)
            t0 = time.perf_counter()
            channel.send(cfg.moe_layers[0], 1)
            channel.result(60)
            mine.append(time.perf_counter() - t0)
        channel.close()
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    worker = stats_queue.get(timeout=60)
    proc.join(30)
    return {
        "compute_concurrency": concurrency,
        "callers": callers,
        "tokens": tokens,
        "calls": len(times),
        "calls_per_s": round(len(times) / wall, 1),
        "median_call_ms": round(statistics.median(times) * 1e3, 3),
        "worker_queue_ms_per_call": round(worker["queue_s"] / max(1, worker["calls"]) * 1e3, 3),
        "worker_busy_fraction": round(worker["busy_s"] / wall, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--callers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "expert_concurrency.json"))
    args = ap.parse_args()
    from services.presets import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(Path(tmp) / "small", "small", tokenizer=False))
        rows = [measure(model_dir, 1, 1, args.tokens, args.seconds)]
        for concurrency in (1, 2):
            rows.append(measure(model_dir, concurrency, args.callers, args.tokens, args.seconds))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "one expert worker, several callers over shared memory: computes in turn vs side by side",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "rows": rows,
        "calls_per_s_2_over_1": round(rows[2]["calls_per_s"] / rows[1]["calls_per_s"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
