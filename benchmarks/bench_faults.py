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
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
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
    args = ap.parse_args()

    model = init_model(Path(tempfile.mkdtemp(prefix="bench-faults-")) / "tiny", "tiny", seed=0)
    local = LocalEngine(EngineConfig(model=str(model)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in local.generate(scenario.prompts(args.requests), params)]
    del local

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


if __name__ == "__main__":
    main()
