"""The expert pool sizing itself under a load that rises and falls (issue #39's "must show").

One local cluster (real Ray, Redis, gRPC) on a generated checkpoint, expert pool autoscaled between
`--min` and `--max` workers on busy time. Offered load in phases of concurrent streaming-free
clients (`--phases`, "clients:seconds,..."); every second the run samples the balancer's status
(pool size, the size wanted, per-worker busy fractions, the decision's reason) and what the clients
finished in that second (tokens/s, mean end-to-end milliseconds per output token, queueing and
prefill included). Writes JSON and a plot:

    python -m benchmarks.bench_autoscale --out benchmarks/results/autoscale.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import openai
import ray

from services.cluster import Cluster, ClusterConfig
from services.net import free_port
from services.presets import init_model

PROMPT = [0, 7, 8, 9, 10, 11, 12, 13]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.25, help="expert target utilization")
    ap.add_argument("--upscale-delay-s", type=float, default=4.0)
    ap.add_argument("--downscale-delay-s", type=float, default=12.0)
    ap.add_argument("--phases", default="0:6,2:25,8:35,0:35", help="clients:seconds, in order")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/autoscale.json")
    args = ap.parse_args()
    phases = [tuple(int(x) for x in p.split(":")) for p in args.phases.split(",")]
    model_dir = init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset)
    cfg = ClusterConfig(model=str(model_dir), served_model_name="m", port=free_port(), expert_workers=args.min,
                        min_expert_workers=args.min, max_expert_workers=args.max,
                        expert_target_utilization=args.target, expert_upscale_delay_s=args.upscale_delay_s,
                        expert_downscale_delay_s=args.downscale_delay_s, balancer_period_s=0)  # fmt: skip
    cluster = Cluster.start(cfg)
    done: list[tuple[float, int, float]] = []  # (finished at, tokens, seconds)
    errors: list[str] = []
    active = [0]  # client i sends while i < active[0]
    stop = threading.Event()

    def client_loop(i: int) -> None:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        while not stop.is_set():
            if i >= active[0]:
                time.sleep(0.05)
                continue
            t0 = time.monotonic()
            try:
                r = api.completions.create(model="m", prompt=PROMPT, max_tokens=args.max_tokens, temperature=0.0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
                done.append((time.monotonic(), r.usage.completion_tokens, time.monotonic() - t0))
            except Exception as e:  # noqa: BLE001 (counted in the result)
                errors.append(repr(e))

    threads = [
        threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(max(c for c, _ in phases))
    ]
    for t in threads:
        t.start()
    timeline, start = [], time.monotonic()
    try:
        for n, seconds in phases:
            active[0] = n
            phase_end = time.monotonic() + seconds
            while time.monotonic() < phase_end:
                time.sleep(1.0)
                now = time.monotonic()
                st = ray.get(cluster.balancer.status.remote())
                recent = [d for d in done if d[0] > now - 1.0]
                auto = st.get("autoscale") or {}
                timeline.append({
                    "t": round(now - start, 2), "clients": n,
                    "workers": sum(w["state"] == "serving" for w in st["workers"]),
                    "desired": auto.get("desired"), "busy": auto.get("busy_by_worker"), "reason": auto.get("reason"),
                    "tok_s": sum(d[1] for d in recent),
                    "ms_per_token_e2e": 1e3 * sum(d[2] / max(1, d[1]) for d in recent) / len(recent) if recent else None,
                })  # fmt: skip
                print(json.dumps(timeline[-1]), flush=True)
    finally:
        stop.set()
        cluster.stop()
    sizes = [p["workers"] for p in timeline]
    result = {"benchmark": "expert_pool_autoscaling", "preset": args.preset, "args": vars(args),
              "requests": len(done), "errors": len(errors), "first_errors": errors[:3],
              "max_workers_reached": max(sizes), "final_workers": sizes[-1], "timeline": timeline}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(timeline, out.with_suffix(".png"))
    print(f"wrote {out}: {len(done)} requests, {len(errors)} errors, pool {min(sizes)}..{max(sizes)}")


def plot(timeline: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.step(t, [p["clients"] for p in timeline], where="post", label="offered load (clients)")
    top.step(t, [p["workers"] for p in timeline], where="post", label="expert workers")
    top.step(t, [p["desired"] for p in timeline], where="post", linestyle=":", label="wanted")
    top.legend(loc="upper right")
    bottom.plot(t, [p["tok_s"] for p in timeline], label="tokens/s")
    bottom.set_ylabel("tokens/s")
    tpot = bottom.twinx()
    tpot.plot(
        t,
        [p["ms_per_token_e2e"] for p in timeline],
        color="gray",
        alpha=0.6,
        label="ms per output token, end to end",
    )
    tpot.set_ylabel("ms / token")
    bottom.set_xlabel("seconds")
    top.set_title("Expert pool autoscaling on busy time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
