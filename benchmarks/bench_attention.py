"""Decode throughput and per-step time breakdown of the disaggregated path vs LocalEngine.

`small` preset; the cluster path is one attention engine (this process, like an attention
worker's engine thread) + 2 expert workers (Ray actors) over each data plane of `--transports`
(gRPC streams, gRPC unary calls, shared memory, TCP: services/dataplane/transport.py); batch 1/8/32/64; ping-pong
(2 micro-batches) off vs on; with `--device cuda` every engine on the GPU and the cluster once
more without CUDA graphs (remote experts: the step captured in pieces, decode_graphs.py); attention tensor parallelism over `--tp` ranks (this process is
rank 0, the others are spawned processes, gloo; ping-pong off); LocalEngine (all experts in
process) in the same run. They take turns (`--rounds` per batch size) and each row is the median
round. Each TP rank holds the whole latent cache (`kv_cache_bytes_per_rank`).

Breakdown per decode step (seconds, mean): attention = MLA (projections + paged attention),
gate = router, dispatch = choosing replicas + encoding + starting RPCs, expert_wait = blocked in
combine waiting for expert workers, other = the rest (norms, shared experts, dense MLP, LM head,
sampling, scheduling).

    python -m benchmarks.bench_attention [--out benchmarks/results/attention.json]
    python -m benchmarks.bench_attention --device cuda --dtype bfloat16 --tp 1 --out benchmarks/results/attention_h100.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import services.model.model as model_mod
from services.attention.tensor_parallel import TPGroup, lead, run_follower
from services.balancer.policy import Pool, initial_placement, slots_per_worker
from services.dataplane.remote_experts import DispatchConfig, RemoteExperts
from services.engine.engine import Engine, EngineConfig, LocalEngine, load_engine
from services.engine.sampling import SamplingParams
from services.experts.client import load_placement
from services.model.kernels import cpu_kernels
from services.net import free_port
from services.presets import init_model

PROMPT_LEN = 16
DECODE_STEPS = 16


class Timers:
    """Accumulates time spent in the model's MLA and router, and in the expert backend."""

    def __init__(self):
        self.t = dict.fromkeys(("attention", "gate", "dispatch", "expert_wait"), 0.0)

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[name] += time.perf_counter() - t0

        return timed

    def reset(self):
        for k in self.t:
            self.t[k] = 0.0


@contextmanager
def instrumented(timers: Timers, experts):
    mla, route = model_mod.mla_forward, model_mod.route
    dispatch, combine = experts.dispatch, experts.combine
    model_mod.mla_forward, model_mod.route = timers.wrap("attention", mla), timers.wrap("gate", route)
    experts.dispatch, experts.combine = timers.wrap("dispatch", dispatch), timers.wrap("expert_wait", combine)
    try:
        yield
    finally:
        model_mod.mla_forward, model_mod.route = mla, route
        experts.dispatch, experts.combine = dispatch, combine


def measure(engine: Engine, batch: int, vocab: int, timers: Timers) -> dict:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([0] + torch.randint(4, vocab, (PROMPT_LEN - 1,), generator=g).tolist(), params)
    engine.step()  # prefill (and warm-up)
    engine.step()
    timers.reset()
    with instrumented(timers, engine.experts):
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    step = elapsed / DECODE_STEPS
    parts = {k: v / DECODE_STEPS for k, v in timers.t.items()}
    parts["other"] = step - sum(parts.values())
    return {"batch": batch, "step_s": step, "tok_s": batch / step, "breakdown_s": parts}


def start_expert_workers(model_dir: str, n: int, no_ray: bool, device: str, dtype: str, threads: int = 1,
                         spin_us: float = 0.0):  # fmt: skip
    """n expert workers (Ray actors, or plain processes with --no-ray) computing on `device` in
    `dtype`, as the attention side does, with `threads` torch threads each, their shared-memory
    channels polling `spin_us` before they block; (addresses, stop)."""
    if no_ray:
        cmd = [sys.executable, "-m", "services.experts.server", "--model", model_dir]
        cmd += ["--device", device, "--dtype", dtype, "--threads", str(threads), "--spin-us", str(spin_us)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        addresses = {f"expert-{i}": p.stdout.readline().strip() for i, p in enumerate(procs)}
        return addresses, lambda: [p.kill() for p in procs]
    import ray

    from services.experts.server import ExpertWorkerConfig
    from services.experts.worker import ExpertWorker

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    gpus = 1 / n if device.startswith("cuda") else 0  # (Ray sets each actor's CUDA_VISIBLE_DEVICES)
    workers = [ExpertWorker.options(num_cpus=0, num_gpus=gpus).remote(ExpertWorkerConfig(model=model_dir, num_threads=threads, device=device, dtype=dtype,
                                                                                spin_us=spin_us))
               for _ in range(n)]  # fmt: skip
    addresses = {f"expert-{i}": a for i, a in enumerate(ray.get([w.start.remote() for w in workers]))}

    def stop():
        for w in workers:
            ray.kill(w)
        ray.shutdown()

    return addresses, stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint dir (default: generate the small preset)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--expert-workers", type=int, default=2)
    ap.add_argument(
        "--expert-threads",
        type=int,
        default=1,
        help="torch threads per expert worker (a bigger host: local/2)",
    )
    ap.add_argument("--attention-threads", type=int, default=1)
    ap.add_argument("--local-threads", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true", help="expert workers as plain processes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurements per batch and engine")
    ap.add_argument(
        "--tp", type=int, default=2, help="attention tensor-parallel ranks of the TP row (1: no TP row)"
    )
    ap.add_argument(
        "--device", default="cpu", help="cuda: every engine on the GPU, and a cluster row without graphs"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--transports",
        default="grpc,grpc-unary,shm,tcp",
        help="the cluster rows' data planes (DispatchConfig.transport)",
    )
    ap.add_argument(
        "--spin-us", type=float, default=0.0, help="shared memory: both sides poll this long before blocking"
    )
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    args = ap.parse_args()
    on = {"device": args.device, "dtype": args.dtype}  # every engine's
    model_dir = args.model or str(init_model(Path(tempfile.mkdtemp()) / "small", "small"))
    batches = [int(b) for b in args.batches.split(",")]
    timers = Timers()

    addresses, stop_workers = start_expert_workers(
        model_dir,
        args.expert_workers,
        args.no_ray,
        args.device,
        args.dtype,
        args.expert_threads,
        args.spin_us,
    )
    transports = args.transports.split(",")
    rows = {"local": []}
    engines = {}
    tp_group = tp_pool = None
    try:
        torch.set_num_threads(args.local_threads)
        engines["local"] = (
            LocalEngine(EngineConfig(model=model_dir, max_num_seqs=max(batches), **on)),
            args.local_threads,
        )
        placement = None
        cluster = [(f"cluster_{t}_pingpong_{pp}", micro, True, t) for t in transports
                   for pp, micro in (("off", 1), ("on", 2))]  # fmt: skip
        if args.device == "cuda":  # the same without CUDA graphs (remote experts: captured in pieces)
            cluster.append((f"cluster_{transports[0]}_pingpong_off_eager", 1, False, transports[0]))
        for name, micro, graphs, transport in cluster:
            rows[name] = []
            ecfg = EngineConfig(
                model=model_dir, max_num_seqs=max(batches), micro_batches=micro, cuda_graphs=graphs, **on
            )

            def make_experts(cfg, reader, dtype, transport=transport):
                nonlocal placement
                if placement is None:
                    pool = Pool(tuple(addresses), ("node",) * len(addresses))
                    placement = initial_placement(cfg, pool, slots_per_worker(cfg, len(addresses), 0))
                    load_placement(placement, addresses, cfg.moe_layers)
                return RemoteExperts(
                    cfg, placement, addresses, DispatchConfig(transport=transport, spin_us=args.spin_us)
                )

            cfg, model, experts, tok = load_engine(ecfg, make_experts)
            engines[name] = (Engine(cfg, model, experts, ecfg, tok), args.attention_threads)
        if args.tp > 1:
            name = f"cluster_tp{args.tp}"
            ecfg = EngineConfig(
                model=model_dir, max_num_seqs=max(batches), num_threads=args.attention_threads, **on
            )
            init_method = f"tcp://127.0.0.1:{free_port()}"
            tp_pool = multiprocessing.get_context("spawn").Pool(args.tp - 1)
            followers = [
                tp_pool.apply_async(run_follower, (ecfg, r, args.tp, init_method)) for r in range(1, args.tp)
            ]
            cfg, model, experts, tok = load_engine(ecfg, make_experts)
            tp_group = TPGroup(0, args.tp, init_method)
            experts, on_batches = lead(tp_group, model, experts)
            engines[name] = (Engine(cfg, model, experts, ecfg, tok, on_batches), args.attention_threads)
            rows[name] = []
            kv_cache_bytes_per_rank = engines[name][0].cache.nbytes
        # the three engines take turns, `--rounds` times per batch size, so slow drifts of this
        # shared machine hit all of them alike; each row is the round with the median step time
        for b in batches:
            runs = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, (engine, threads) in engines.items():
                    torch.set_num_threads(threads)
                    runs[name].append(measure(engine, b, engine.cfg.vocab_size, timers))
            for name, measured in runs.items():
                row = sorted(measured, key=lambda r: r["step_s"])[len(measured) // 2]
                rows[name].append({**row, "rounds_step_s": [r["step_s"] for r in measured]})
                print(name, rows[name][-1], flush=True)
    finally:
        for name, (engine, _) in engines.items():
            if name != "local":
                getattr(engine.experts, "inner", engine.experts).close()
        if tp_group is not None:
            tp_group.stop()
            [f.get(timeout=60) for f in followers]
            tp_group.close()
            tp_pool.close()
        stop_workers()

    def at(name, b):
        return next(r for r in rows[name] if r["batch"] == b)

    summary = {}
    for t in transports:  # decode tok/s of the cluster over LocalEngine's, per transport and batch
        for b in batches:
            off, on_, loc = (
                at(f"cluster_{t}_pingpong_off", b),
                at(f"cluster_{t}_pingpong_on", b),
                at("local", b),
            )
            summary[f"{t}_batch{b}_tok_s_over_local"] = off["tok_s"] / loc["tok_s"]
            summary[f"{t}_batch{b}_pingpong_speedup"] = off["step_s"] / on_["step_s"]
            summary[f"{t}_batch{b}_best_tok_s_over_local"] = max(off["tok_s"], on_["tok_s"]) / loc["tok_s"]
        if 1 in batches and 32 in batches:
            summary[f"{t}_target_batch1>=0.7x_batch32>=0.9x"] = (
                summary[f"{t}_batch1_tok_s_over_local"] >= 0.7
                and summary[f"{t}_batch32_tok_s_over_local"] >= 0.9
            )
    first = transports[0]
    if 32 in batches and args.device == "cuda":
        summary["batch32_cluster_graphs_speedup"] = (
            at(f"cluster_{first}_pingpong_off_eager", 32)["step_s"]
            / at(f"cluster_{first}_pingpong_off", 32)["step_s"]
        )
    if 32 in batches and args.tp > 1:
        summary[f"batch32_tp{args.tp}_step_over_tp1"] = (
            at(f"cluster_tp{args.tp}", 32)["step_s"] / at(f"cluster_{first}_pingpong_off", 32)["step_s"]
        )
    result = {
        "benchmark": "attention_worker_decode",
        "model": "small preset" if not args.model else model_dir,
        "expert_workers": args.expert_workers,
        "expert_threads": args.expert_threads,
        "attention_threads": args.attention_threads,
        "local_threads": args.local_threads,
        "decode_steps": DECODE_STEPS,
        "rounds": args.rounds,
        "spin_us": args.spin_us,
        "prompt_len": PROMPT_LEN,
        "machine_cores": os.cpu_count(),
        "cpu_kernels": cpu_kernels.available(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "tp": args.tp,
        "kv_cache_bytes_per_rank": kv_cache_bytes_per_rank if args.tp > 1 else None,
        "rows": rows,
        "summary": summary,
    }
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
