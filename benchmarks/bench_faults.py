"""Faults on a real local cluster: what a SIGKILL of each kind of process costs the requests.

One cluster (tiny preset, 2 attention workers, 3 expert workers, embedded Redis), scenarios in
turn: no fault, an expert worker, an attention worker, the balancer, Redis. In each, `--requests`
concurrent greedy streaming completions (official `openai` client); once every stream has
tokens, the process is killed with SIGKILL; every stream is read to its end and compared with
LocalEngine's tokens for the same prompts. Between scenarios the cluster heals (the balancer
replaces the dead expert worker, Ray restarts the attention worker and the balancer, Redis is
started again on its port).

Per scenario: requests, lost (ended with an error), identical (tokens equal the no-fault run),
seconds until tokens flowed again (the longest wait of a stream that was running at the kill, for
its next token: the client's view of the recovery), the balancer's heal time for expert workers
(death detected -> its experts served by the survivors), the seconds from the kill until the
cluster was whole again (a replacement expert worker loaded, restarted actors answering; checked
after the run) and the run's seconds. Writes benchmarks/results/faults.json.

    python -m benchmarks.bench_faults [--requests 16] [--max-tokens 96] [--out ...]

`--node-loss ROUNDS` instead loses whole nodes of a multi-raylet cluster, ROUNDS times per role
(attention, expert), and writes benchmarks/results/faults_node_loss.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

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
    ap.add_argument("--out", default="benchmarks/results/faults.json")
    ap.add_argument("--node-loss", type=int, default=0, metavar="ROUNDS",
                    help="instead: whole nodes lost on a multi-raylet cluster, ROUNDS per role")  # fmt: skip
    ap.add_argument("--node-loss-out", default="benchmarks/results/faults_node_loss.json")
    args = ap.parse_args()

    model = init_model(Path(tempfile.mkdtemp(prefix="bench-faults-")) / "tiny", "tiny", seed=0)
    expected = scenario.local_tokens(model, scenario.prompts(args.requests), args.max_tokens)

    if args.node_loss:
        return node_loss(model, expected, args)
    cfg = ClusterConfig(model=str(model), served_model_name="tiny", port=free_port(), attention_workers=2,
                        expert_workers=3, balancer_period_s=0, max_num_seqs=32)  # fmt: skip
    cluster = Cluster.start(cfg)
    ns = cfg.namespace
    redis_port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    kills = {
        "none": None,
        "expert worker": scenario.kill(lambda: scenario.expert_worker_pid(ns, 1)),
        "attention worker": scenario.kill(lambda: scenario.actor_pid("moe-attn-0", ns)),
        "balancer": scenario.kill(lambda: scenario.actor_pid(BALANCER_NAME, ns)),
        "redis": scenario.kill(lambda: cluster.redis.process.pid),
    }
    rows = []
    try:
        for name, kill in kills.items():
            outcome = scenario.run(
                cluster.url, name, kill, requests=args.requests, max_tokens=args.max_tokens
            )
            if name == "redis":
                cluster.redis = EmbeddedRedis.start(port=redis_port)
            status = scenario.wait_healed(ns, expert_workers=3)
            whole_s = time.time() - outcome.killed_at  # healed, replaced, restarted: as before the kill
            dead = [d for d in status["dead_workers"] if d["detected_at"] >= outcome.killed_at]
            row = {
                "scenario": name,
                "requests": args.requests,
                "lost": outcome.lost,
                "identical": sum(t == e for t, e in zip(outcome.tokens, expected, strict=True)),
                "seconds_until_tokens_flow_again": round(outcome.stall_s(), 3) if kill else None,
                "expert_heal_s": round(dead[0]["healed_s"], 3) if dead and dead[0]["healed_s"] else None,
                "cluster_whole_again_s": round(whole_s, 2) if kill else None,
                "run_s": round(outcome.seconds, 2),
                "errors": sorted({e for e in outcome.errors if e})[:3],
            }
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
            "fault": "SIGKILL once every stream has 8 tokens",
        },  # fmt: skip
        "target": {"seconds_until_tokens_flow_again": 10.0, "lost": 0},
        "scenarios": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


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
