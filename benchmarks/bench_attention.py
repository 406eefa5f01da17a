"""Decode throughput and per-step time breakdown of the disaggregated path vs LocalEngine.

`small` preset; the cluster path is one attention engine (this process, like an attention
worker's engine thread) + 2 expert workers (Ray actors) over each data plane of `--transports`
(gRPC streams, shared memory, TCP: services/dataplane/transport.py); batch 1/8/32/64; ping-pong
(2 micro-batches) off vs on; with `--device cuda` every engine on the GPU and the cluster once
more without CUDA graphs (remote experts: the step captured in pieces, decode_graphs.py);
attention tensor parallelism over `--tp` ranks over `--tp-transport` (this process is rank 0, the
others are spawned processes, gloo; ping-pong off), compared with the TP-1 row of that same
transport; LocalEngine (all experts in process) in the same run. They take turns (`--rounds` per
batch size); each row is the median round, with the best round beside it. Each TP rank holds the
whole latent cache (`kv_cache_bytes_per_rank`).

Like with like: LocalEngine gets as many torch threads as the cluster has in total (the attention
engine's `--attention-threads` + `--expert-workers` x `--expert-threads`; the JSON's `threads`
says both), on any host. Every cluster setting (transport, ping-pong on / off) is compared with
LocalEngine on its own, as the median round (typical) and the best round (best) apart; no
figure is the best of several settings.

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
def instrumented(timers: Timers, engine: Engine):
    """Time the MLA layers, the gate (the engine's chosen `route` kernel) and the expert calls."""
    kernels, experts = engine.model.kernels, engine.experts
    mla, route = model_mod.mla_forward, kernels.route
    dispatch, combine = experts.dispatch, experts.combine
    model_mod.mla_forward, kernels.route = timers.wrap("attention", mla), timers.wrap("gate", route)
    experts.dispatch, experts.combine = timers.wrap("dispatch", dispatch), timers.wrap("expert_wait", combine)
    try:
        yield
    finally:
        model_mod.mla_forward, kernels.route = mla, route
        experts.dispatch, experts.combine = dispatch, combine


def greedy_agreement(engines: dict, vocab: int, prompts: int = 4, tokens: int = 24) -> dict:
    """Each engine's greedy tokens against LocalEngine's on the same prompts, batched alike: the
    share of positions that agree before the first difference, per engine (1.0: identical)."""
    g = torch.Generator().manual_seed(1234)
    batch = [[0] + torch.randint(4, vocab, (PROMPT_LEN - 1,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in engines["local"][0].generate(batch, params)]
    agreement = {}
    for name, (engine, _) in engines.items():
        got = [c.token_ids for c in engine.generate(batch, params)]
        same = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(got, want, strict=True)
        ]
        agreement[name] = sum(same) / (prompts * tokens)
    return agreement


def measure(engine: Engine, batch: int, vocab: int, timers: Timers) -> dict:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([0] + torch.randint(4, vocab, (PROMPT_LEN - 1,), generator=g).tolist(), params)
    engine.step()  # prefill (and warm-up)
    engine.step()
    timers.reset()
    with instrumented(timers, engine):
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
    ap.add_argument("--expert-threads", type=int, default=1, help="torch threads per expert worker")
    ap.add_argument(
        "--attention-threads",
        type=int,
        default=1,
        help="torch threads of the attention engine (LocalEngine gets the cluster's total)",
    )
    ap.add_argument("--no-ray", action="store_true", help="expert workers as plain processes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurements per batch and engine")
    ap.add_argument(
        "--tp", type=int, default=2, help="attention tensor-parallel ranks of the TP row (1: no TP row)"
    )
    ap.add_argument("--tp-transport", help="the TP row's data plane (default: the first of --transports)")
    ap.add_argument(
        "--device", default="cpu", help="cuda: every engine on the GPU, and a cluster row without graphs"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--transports",
        default="grpc,shm,tcp",
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
    transports = args.transports.split(",")
    tp_transport = args.tp_transport or transports[0]
    if args.tp > 1 and tp_transport not in transports:
        ap.error(f"--tp-transport {tp_transport}: its TP-1 row must be measured too (add it to --transports)")
    # like with like: LocalEngine gets the cluster's torch threads in total
    cluster_threads = args.attention_threads + args.expert_workers * args.expert_threads
    threads = {
        "cluster_total": cluster_threads,
        "local_engine": cluster_threads,
        "attention_engine": args.attention_threads,
        "expert_workers": args.expert_workers,
        "expert_threads_each": args.expert_threads,
        "tp_row_total": args.tp * args.attention_threads + args.expert_workers * args.expert_threads
        if args.tp > 1
        else None,
        "kind": "torch intra-op threads per process (data-plane I/O threads not counted)",
    }

    addresses, stop_workers = start_expert_workers(
        model_dir,
        args.expert_workers,
        args.no_ray,
        args.device,
        args.dtype,
        args.expert_threads,
        args.spin_us,
    )
    rows = {"local": []}
    engines = {}
    tp_group = tp_pool = None
    placement = None

    def experts_over(transport: str):
        """The engines' expert factory: RemoteExperts over `transport` (one placement for all)."""

        def make_experts(cfg, reader, dtype):
            nonlocal placement
            if placement is None:
                pool = Pool(tuple(addresses), ("node",) * len(addresses))
                placement = initial_placement(cfg, pool, slots_per_worker(cfg, len(addresses), 0))
                load_placement(placement, addresses, cfg.moe_layers)
            dispatch = DispatchConfig(transport=transport, spin_us=args.spin_us, device=args.device)
            return RemoteExperts(cfg, placement, addresses, dispatch)

        return make_experts

    try:
        torch.set_num_threads(threads["local_engine"])
        engines["local"] = (
            LocalEngine(EngineConfig(model=model_dir, max_num_seqs=max(batches), **on)),
            threads["local_engine"],
        )
        cluster = [(f"cluster_{t}_pingpong_{pp}", micro, True, t) for t in transports
                   for pp, micro in (("off", 1), ("on", 2))]  # fmt: skip
        if args.device == "cuda":  # the same without CUDA graphs (remote experts: captured in pieces)
            cluster.append((f"cluster_{transports[0]}_pingpong_off_eager", 1, False, transports[0]))
        for name, micro, graphs, transport in cluster:
            rows[name] = []
            ecfg = EngineConfig(
                model=model_dir, max_num_seqs=max(batches), micro_batches=micro, cuda_graphs=graphs, **on
            )
            cfg, model, experts, tok = load_engine(ecfg, experts_over(transport))
            engines[name] = (Engine(cfg, model, experts, ecfg, tok), args.attention_threads)
        if args.tp > 1:
            name = f"cluster_{tp_transport}_tp{args.tp}"
            ecfg = EngineConfig(
                model=model_dir, max_num_seqs=max(batches), num_threads=args.attention_threads, **on
            )
            init_method = f"tcp://127.0.0.1:{free_port()}"
            tp_pool = multiprocessing.get_context("spawn").Pool(args.tp - 1)
            followers = [
                tp_pool.apply_async(run_follower, (ecfg, r, args.tp, init_method)) for r in range(1, args.tp)
            ]
            cfg, model, experts, tok = load_engine(ecfg, experts_over(tp_transport))
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
                for name, (engine, engine_threads) in engines.items():
                    torch.set_num_threads(engine_threads)
                    runs[name].append(measure(engine, b, engine.cfg.vocab_size, timers))
            for name, measured in runs.items():
                row = sorted(measured, key=lambda r: r["step_s"])[len(measured) // 2]  # the median round
                best = min(r["step_s"] for r in measured)
                rows[name].append(
                    {
                        **row,
                        "best_step_s": best,
                        "best_tok_s": b / best,
                        "rounds_step_s": [r["step_s"] for r in measured],
                    }
                )
                print(name, rows[name][-1], flush=True)
        greedy = greedy_agreement(engines, vocab=engines["local"][0].cfg.vocab_size)
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

    def over(name, base, b):
        """tok/s of row `name` over row `base`'s at batch b: the median rounds' (typical) and the
        best rounds' (best), apart."""
        row, ref = at(name, b), at(base, b)
        return {"median": row["tok_s"] / ref["tok_s"], "best": row["best_tok_s"] / ref["best_tok_s"]}

    # decode tok/s of the cluster over LocalEngine's (equal threads in total), per transport,
    # ping-pong setting and batch: each setting on its own, never the best of them
    summary = {}
    for t in transports:
        for b in batches:
            for pp in ("off", "on"):
                summary[f"{t}_pingpong_{pp}_batch{b}_tok_s_over_local"] = over(
                    f"cluster_{t}_pingpong_{pp}", "local", b
                )
            summary[f"{t}_batch{b}_pingpong_on_over_off"] = over(
                f"cluster_{t}_pingpong_on", f"cluster_{t}_pingpong_off", b
            )
        if 1 in batches and 32 in batches:  # the default setting (ping-pong off), median rounds
            summary[f"{t}_target_batch1>=0.7x_batch32>=0.9x"] = (
                summary[f"{t}_pingpong_off_batch1_tok_s_over_local"]["median"] >= 0.7
                and summary[f"{t}_pingpong_off_batch32_tok_s_over_local"]["median"] >= 0.9
            )
    first = transports[0]
    if 32 in batches and args.device == "cuda":
        summary["batch32_cluster_graphs_speedup"] = (
            at(f"cluster_{first}_pingpong_off_eager", 32)["step_s"]
            / at(f"cluster_{first}_pingpong_off", 32)["step_s"]
        )
    if 32 in batches and args.tp > 1:  # over the TP-1 row of the same transport (ping-pong off both)
        tp_row, tp1_row = (
            at(f"cluster_{tp_transport}_tp{args.tp}", 32),
            at(f"cluster_{tp_transport}_pingpong_off", 32),
        )
        summary[f"{tp_transport}_batch32_tp{args.tp}_step_over_tp1"] = {
            "median": tp_row["step_s"] / tp1_row["step_s"],
            "best": tp_row["best_step_s"] / tp1_row["best_step_s"],
        }
    result = {
        "benchmark": "attention_worker_decode",
        "model": "small preset" if not args.model else model_dir,
        "expert_workers": args.expert_workers,
        "threads": threads,
        "transports": transports,
        "tp_transport": tp_transport if args.tp > 1 else None,
        "decode_steps": DECODE_STEPS,
        "rounds": args.rounds,
        "statistic": "each row: the median round (step_s, tok_s, breakdown_s) and the best round "
        "(best_step_s, best_tok_s); ratios: {median: median rounds', best: best rounds'}",
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
        "greedy_agreement_with_local": greedy,  # share of greedy positions equal to LocalEngine's
    }
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
