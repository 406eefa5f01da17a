"""Faults on a real local cluster: what a SIGKILL or a freeze of each kind of process costs the requests.

One cluster (tiny preset, 2 attention workers, 3 expert workers, embedded Redis), scenarios in
turn: no fault; an expert worker, an attention worker, the balancer, Redis killed (SIGKILL); the
same four frozen (SIGSTOP, SIGCONT `--freeze-s` later). In each, `--requests` concurrent greedy
streaming completions (official `openai` client); once every stream has tokens, the fault; every
stream is read to its end and compared with LocalEngine's tokens for the same prompts. Between
scenarios the cluster heals (the balancer replaces a dead or fenced expert worker, Ray restarts
the attention worker and the balancer, Redis is started again on its port).

Per scenario: requests, lost (ended with an error), identical (tokens equal LocalEngine's), the
longest pause of a stream running at the fault (its longest wait between two tokens after it: the
client's view of the recovery), the balancer's heal time for expert workers (detected -> its
experts served by the survivors) and what detected it, the seconds from the fault until the
cluster was whole again, the run's seconds, and for a freeze whether the thawed process was
fenced (killed) or served on. Writes benchmarks/results/faults.json.

    python -m benchmarks.bench_faults [--requests 16] [--max-tokens 96] [--freeze-s 20] [--out ...]

`--node-loss ROUNDS` instead loses whole nodes of a multi-raylet cluster, ROUNDS times per role
(attention, expert), and writes benchmarks/results/faults_node_loss.json. `--chaos SECONDS`
instead mixes kills and freezes of every process kind under continuous load (`chaos`) and writes
benchmarks/results/faults_chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import openai
import ray
import torch

from services.cluster import Cluster, ClusterConfig
from services.net import free_port
from services.presets import init_model
from services.redis_store import EmbeddedRedis
from services.settings import BALANCER_NAME
from tests.faults import scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--freeze-s", type=float, default=20.0, help="how long each frozen process stays frozen")
    ap.add_argument("--out", default="benchmarks/results/faults.json")
    ap.add_argument("--node-loss", type=int, default=0, metavar="ROUNDS",
                    help="instead: whole nodes lost on a multi-raylet cluster, ROUNDS per role")  # fmt: skip
    ap.add_argument("--node-loss-out", default="benchmarks/results/faults_node_loss.json")
    ap.add_argument("--chaos", type=float, default=0.0, metavar="SECONDS",
                    help="instead: kills and freezes of every process kind under continuous load")  # fmt: skip
    ap.add_argument("--chaos-out", default="benchmarks/results/faults_chaos.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", default=[], metavar="SCENARIO",
                    help='run only this scenario (repeatable), e.g. --only "expert worker frozen"')  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times")
    args = ap.parse_args()

    model = init_model(Path(tempfile.mkdtemp(prefix="bench-faults-")) / "tiny", "tiny", seed=0)
    expected = scenario.local_tokens(model, scenario.prompts(args.requests), args.max_tokens)

    if args.node_loss:
        return node_loss(model, expected, args)
    cfg = ClusterConfig(model=str(model), served_model_name="tiny", port=free_port(), attention_workers=2,
                        expert_workers=3, balancer_period_s=0, max_num_seqs=32)  # fmt: skip
    cluster = Cluster.start(cfg)
    if args.chaos:
        return chaos(cluster, expected, args)
    ns = cfg.namespace
    pid_of = {
        "expert worker": lambda: scenario.expert_worker_pid(ns, 1),
        "attention worker": lambda: scenario.actor_pid("moe-attn-0", ns),
        "balancer": lambda: scenario.actor_pid(BALANCER_NAME, ns),
        "redis": lambda: cluster.redis.process.pid,
    }
    faults = {"none": None}
    faults |= {name: scenario.kill(pid) for name, pid in pid_of.items()}
    faults |= {f"{name} frozen": scenario.freeze(pid, args.freeze_s) for name, pid in pid_of.items()}
    unknown = set(args.only) - set(faults)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; known: {sorted(faults)}")
    runs = [(n, f) for n, f in faults.items() if not args.only or n in args.only for _ in range(args.repeat)]
    rows = []
    try:
        for name, fault in runs:
            outcome = scenario.run(
                cluster.url, name, fault, requests=args.requests, max_tokens=args.max_tokens
            )
            if name == "redis":
                _restart_redis(cluster)
            status = scenario.wait_healed(ns, expert_workers=3)
            whole_s = time.time() - outcome.killed_at  # healed, replaced, restarted: as before the fault
            if name.endswith("frozen"):  # (then the thaw: the process is back, or was fenced and is gone)
                time.sleep(max(0.0, outcome.killed_at + args.freeze_s + 1 - time.time()))
                status = scenario.wait_healed(ns, expert_workers=3)
            dead = [d for d in status["dead_workers"] if d["detected_at"] >= outcome.killed_at]
            row = {
                "scenario": name,
                "requests": args.requests,
                "lost": outcome.lost,
                "identical": sum(t == e for t, e in zip(outcome.tokens, expected, strict=True)),
                "longest_pause_s": round(outcome.stall_s(), 3) if fault else None,
                "expert_heal_s": round(dead[0]["healed_s"], 3) if dead and dead[0]["healed_s"] else None,
                "detected": dead[0]["reason"] if dead else None,
                "detected_after_s": round(dead[0]["detected_at"] - outcome.killed_at, 3) if dead else None,
                **_heal_breakdown(status, outcome.killed_at),
                "cluster_whole_again_s": round(whole_s, 2) if fault else None,
                "run_s": round(outcome.seconds, 2),
                "errors": sorted({e for e in outcome.errors if e})[:3],
            }
            if name.endswith("frozen"):
                row["thawed_process"] = (
                    "killed (fenced)" if scenario.gone(outcome.fault_result) else "alive, serving"
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        cluster.stop()

    result = {
        "benchmark": "faults",
        "host": {"cpus": torch.get_num_threads(), "machine": platform.machine(), "ray": ray.__version__},
        "setup": {
            "preset": "tiny",
            "attention_workers": 2,
            "expert_workers": 3,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "fault": f"once every stream has 8 tokens: SIGKILL, or SIGSTOP then SIGCONT {args.freeze_s:g} s later",
        },  # fmt: skip
        "target": {"longest_pause_s": 3.0, "lost": 0},
        "scenarios": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _heal_breakdown(status: dict, since: float) -> dict:
    """The seconds the first heal after `since` spent loading the survivors and switching the
    attention workers (from the balancer's recent migrations)."""
    heals = [
        m for m in status["recent_migrations"] if m["reason"].startswith("heal") and m["started_at"] >= since
    ]
    if not heals:
        return {}
    return {"heal_load_s": round(heals[0]["load_s"], 3), "heal_switch_s": round(heals[0]["switch_s"], 3)}


def _restart_redis(cluster: Cluster) -> None:
    """Redis back on its port with its password (killed: the cluster runs without it meanwhile)."""
    port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    cluster.redis = EmbeddedRedis.start(port=port, password=cluster.redis.password)


def chaos(cluster: Cluster, expected: list[list[int]], args) -> None:
    """`args.chaos` seconds of continuous load (`args.requests` clients, each sending greedy
    streams of the prompts in turn) while a fault hits a random process every 8-15 s: SIGKILL or a
    SIGSTOP of 5-30 s (then SIGCONT) of an expert worker, an attention worker, the balancer or
    Redis (a killed Redis is started again 5 s later). Every finished request is checked against
    LocalEngine's tokens. Router replicas are left alone: their streams cannot move (docs/deploy.md)."""
    ns, rng = cluster.cfg.namespace, random.Random(args.seed)
    kinds = {
        "expert worker": lambda: scenario.expert_worker_pid(ns, rng.randrange(2)),
        "attention worker": lambda: scenario.actor_pid(f"moe-attn-{rng.randrange(2)}", ns),
        "balancer": lambda: scenario.actor_pid(BALANCER_NAME, ns),
        "redis": lambda: cluster.redis.process.pid,
    }
    prompts, stop = scenario.prompts(args.requests), threading.Event()
    faults: list[dict] = []

    def inject() -> None:
        while not stop.wait(rng.uniform(8, 15)):
            kind, frozen_s = rng.choice(sorted(kinds)), rng.choice([0, 0, rng.uniform(5, 30)])
            try:
                pid = kinds[kind]()
                if frozen_s:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(frozen_s, scenario.thaw, (pid,)).start()
                else:
                    scenario.sigkill(pid)
                    if kind == "redis":
                        threading.Timer(5.0, _restart_redis, (cluster,)).start()
            except Exception as e:  # noqa: BLE001 (its target restarting: the next fault)
                faults.append({"at": time.time(), "kind": kind, "skipped": repr(e)})
                continue
            faults.append(
                {
                    "at": time.time(),
                    "kind": kind,
                    "fault": f"SIGSTOP {frozen_s:.0f} s" if frozen_s else "SIGKILL",
                }
            )
            print(json.dumps(faults[-1]), flush=True)

    sent, identical, lost, pauses, errors = 0, 0, 0, [], []

    async def client(i: int, deadline: float) -> None:
        nonlocal sent, identical, lost
        http = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)
        k = i
        while time.time() < deadline:
            k = (k + 1) % len(prompts)
            got, times = [], []
            sent += 1
            try:
                await scenario._stream(http, prompts[k], args.max_tokens, got, times)
            except Exception as e:  # noqa: BLE001 (a lost request: counted)
                lost += 1
                errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            identical += got == expected[k]
            gaps = [(b - a, a) for a, b in zip(times, times[1:], strict=False)]
            pauses.append(max(gaps, default=(0.0, time.time())))  # (its longest gap, when it began)
        await http.close()

    async def load() -> None:
        deadline = time.time() + args.chaos
        await asyncio.gather(*[client(i, deadline) for i in range(args.requests)])

    injector = threading.Thread(target=inject, daemon=True)
    t0 = time.time()
    injector.start()
    try:
        asyncio.run(load())
    finally:
        stop.set()
        injector.join()
    time.sleep(31)  # (the last freeze thawed)
    healed = None
    try:
        scenario.wait_healed(ns, expert_workers=3, timeout_s=180)
        healed = round(time.time() - t0 - args.chaos, 1)
    finally:
        cluster.stop()
    result = {
        "benchmark": "faults_chaos",
        "host": {"cpus": torch.get_num_threads(), "machine": platform.machine(), "ray": ray.__version__},
        "setup": {
            "preset": "tiny",
            "attention_workers": 2,
            "expert_workers": 3,
            "clients": args.requests,
            "max_tokens": args.max_tokens,
            "seconds": args.chaos,
            "seed": args.seed,
            "faults": "every 8-15 s, a random expert worker / attention worker / balancer / Redis: SIGKILL "
            "(2 in 3) or SIGSTOP 5-30 s then SIGCONT",
        },  # fmt: skip
        "target": {"lost": 0, "longest_pause_s": 3.0},
        "sent": sent,
        "identical": identical,
        "lost": lost,
        "longest_pause_s": round(max(pauses, default=(0.0,))[0], 3),
        "pause_p99_s": round(sorted(p for p, _ in pauses)[int(0.99 * (len(pauses) - 1))], 3)
        if pauses
        else None,
        "longest_pauses": _attributed(pauses, faults, t0),
        "healed_after_s": healed,
        "faults": faults,
        "errors": sorted(set(errors))[:5],
    }
    Path(args.chaos_out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=1))
    print(f"wrote {args.chaos_out}")


def _attributed(pauses: list[tuple[float, float]], faults: list[dict], t0: float, top: int = 8) -> list[dict]:
    """The `top` longest pauses (seconds, wall-clock start) with the last fault injected before
    each began (the pause's likely cause), times in seconds from the run's start."""
    rows = []
    for pause, at in sorted(pauses, reverse=True)[:top]:
        before = [f for f in faults if f["at"] <= at + 0.05 and "fault" in f]
        cause = before[-1] if before else None
        rows.append({
            "pause_s": round(pause, 3),
            "at_s": round(at - t0, 1),
            "after": f"{cause['kind']} {cause['fault']}, {at - cause['at']:.1f} s before" if cause else None,
        })  # fmt: skip
    return rows


def node_loss(model: Path, expected: list[list[int]], args) -> None:
    """Whole nodes lost (raylet and every process on it) on a multi-raylet cluster on this machine:
    a head with the router and balancer, 2 attention nodes, 2 expert nodes of 2 workers. Each round
    adds a fresh node of the role (room for what the lost one held), then removes the oldest one
    while the streams run."""
    from ray.cluster_utils import Cluster as RayNodes

    rn = RayNodes(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head_node": 4},
                                                          "include_dashboard": False})  # fmt: skip
    room = {"attention": {"attention_node": 1}, "expert": {"expert_node": 2}}
    nodes = {role: [rn.add_node(num_cpus=1, resources=r) for _ in range(2)] for role, r in room.items()}
    rn.wait_for_nodes()
    cfg = ClusterConfig(model=str(model), served_model_name="tiny", port=free_port(), address=rn.address,
                        allow_unauthenticated_ray=True,
                        attention_workers=2, expert_workers=4, redundant_experts=0, balancer_period_s=0,
                        max_num_seqs=32, attention_resources={"attention_node": 1},
                        expert_resources={"expert_node": 1}, control_resources={"head_node": 1})  # fmt: skip
    cluster, rows = Cluster.start(cfg), []
    try:
        for r in range(args.node_loss):
            for role in ("attention", "expert"):
                nodes[role].append(rn.add_node(num_cpus=1, resources=room[role]))
                rn.wait_for_nodes()
                victim = nodes[role].pop(0)
                outcome = scenario.run(cluster.url, f"{role} node", lambda v=victim: rn.remove_node(v, False),
                                       requests=args.requests, max_tokens=args.max_tokens)  # fmt: skip
                scenario.wait_healed(cfg.namespace, expert_workers=4, timeout_s=180)
                rows.append({"round": r, "node": role, "requests": args.requests, "lost": outcome.lost,
                             "identical": sum(t == e for t, e in zip(outcome.tokens, expected, strict=True)),
                             "finished": sum(f == "length" for f in outcome.finish_reasons),
                             "longest_pause_s": round(outcome.stall_s(), 3),
                             "cluster_whole_again_s": round(time.time() - outcome.killed_at, 2),
                             "errors": sorted({e for e in outcome.errors if e})[:3]})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.stop()
        ray.shutdown()
        rn.shutdown()
    result = {"benchmark": "faults_node_loss", "setup": {"preset": "tiny", "nodes": "head (router, balancer) + "
              "2 attention nodes + 2 expert nodes of 2 workers, raylets on one machine", "requests": args.requests,
              "max_tokens": args.max_tokens, "fault": "ray.cluster_utils remove_node (no grace) once every "
              "stream has 8 tokens"}, "target": {"longest_pause_s": 5.0, "lost": 0}, "rounds": rows}  # fmt: skip
    Path(args.node_loss_out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.node_loss_out}")


if __name__ == "__main__":
    main()
