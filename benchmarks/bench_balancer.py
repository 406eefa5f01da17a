"""The balancer on a skewed workload: balancedness over time (balancer on vs off), decode
throughput on vs off, and the longest engine step during a migration vs a normal step.

Two runs on the same machine, one after the other, each a real local cluster (1 attention
worker, `--expert-workers` expert workers, embedded Redis): "off" never re-plans; "on"
re-plans every `--period` seconds. Clients send repetitive prompts that route most tokens to a
few experts. Balancedness = mean/max of the tokens each expert worker computed in each sampling
interval, from the workers' own counters (gRPC Stats).

    python -m benchmarks.bench_balancer [--out benchmarks/results/balancer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import ray

from services.cluster import Cluster, ClusterConfig
from services.net import free_port

PROMPTS = [[0] + [5 + i % 2] * 60 + [9 + i] for i in range(8)]


def traffic(url: str, stop: threading.Event, tokens: list[int], errors: list[str], max_tokens: int) -> None:
    n = 0
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            body = {"model": "m", "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = http.post(f"{url}/v1/completions", json=body)
            if r.status_code == 200:
                tokens.append(r.json()["usage"]["completion_tokens"])
            else:
                errors.append(r.text)
            n += 1


def worker_tokens(cluster: Cluster) -> dict[tuple[str, int], int]:
    """Cumulative (token, choice) pairs each expert worker computed, per placement version
    (a released version disappears from Stats: deltas are taken per version)."""
    stats = ray.get(cluster.balancer.worker_stats.remote())
    return {(w, v): sum(sum(t) for t in layers.values()) for w, versions in stats.items()
            for v, layers in versions.items()}  # fmt: skip


def interval_loads(now: dict, prev: dict) -> list[int]:
    """Per worker: pairs computed since the previous sample (over the versions it serves)."""
    loads: dict[str, int] = {}
    for (w, v), n in now.items():
        loads[w] = loads.get(w, 0) + n - prev.get((w, v), 0)
    return list(loads.values())


def window_max(durations: list[float], n: int) -> float | None:
    """Median over consecutive chunks of `n` durations of each chunk's maximum."""
    if n == 0 or len(durations) < n:
        return None
    return statistics.median(max(durations[i : i + n]) for i in range(0, len(durations) - n + 1, n))


def run(model: str | None, balancer_on: bool, args) -> dict:
    cfg = ClusterConfig(
        model=model,
        served_model_name="m",
        port=free_port(),
        expert_workers=args.expert_workers,
        redundant_experts=args.redundant,
        balancer_period_s=args.period if balancer_on else 0,
        balancer_bucket_seconds=1.0,
        balancer_window_buckets=int(args.period * 2),
        balancer_min_gain=0.01,
    )
    cluster = Cluster.start(cfg)
    attn = next(iter(cluster.attention.values()))
    stop, tokens, errors = threading.Event(), [], []
    clients = [threading.Thread(target=traffic, args=(cluster.url, stop, tokens, errors, args.max_tokens))
               for _ in range(args.clients)]  # fmt: skip
    timeline = []
    try:
        start = time.time()
        for c in clients:
            c.start()
        prev = worker_tokens(cluster)
        while time.time() - start < args.duration:
            time.sleep(args.sample)
            now = worker_tokens(cluster)
            delta = interval_loads(now, prev)
            prev = now
            if sum(delta) > 0:
                timeline.append({"t": time.time() - start, "balancedness": statistics.mean(delta) / max(delta),
                                 "version": ray.get(cluster.balancer.status.remote())["version"]})  # fmt: skip
        stop.set()
        for c in clients:
            c.join()
        elapsed = time.time() - start
        status = ray.get(cluster.balancer.status.remote())
        steps = ray.get(attn.step_trace.remote(start))
        migrations = [m for m in ray.get(cluster.balancer.migration_log.remote()) if m["ok"]]
    finally:
        cluster.stop()
    windows = [(m["started_at"], m["started_at"] + m["total_s"] + 0.5) for m in migrations]
    in_window = lambda end: any(a <= end <= b for a, b in windows)  # noqa: E731
    # steps differ by what they carry (a prefill chunk of a new request costs several decode
    # steps), so stalls are judged on decode-only steps (one token per sequence): the steady state
    decode = [(end, d) for end, d, seqs, tokens, _ in steps if tokens == seqs]
    outside = [d for end, d in decode if not in_window(end)]
    normal = statistics.median(outside) if outside else 0.0
    outside_all = sorted(d for end, d, *_ in steps if not in_window(end))
    p99 = outside_all[int(0.99 * (len(outside_all) - 1))] if outside_all else 0.0
    stall = []
    for m, (a, b) in zip(migrations, windows, strict=True):  # steps that ended while the migration ran
        inside = [d for end, d in decode if a <= end <= b]
        switch = next(((d, tokens) for end, d, _, tokens, v in steps if v == m["version"]), (None, None))
        stall.append({"version": m["version"], "longest_decode_step_s": max(inside, default=0.0),
                      "decode_steps_during": len(inside),
                      "longest_step_s": max((d for end, d, *_ in steps if a <= end <= b), default=0.0),
                      # the same number of decode steps outside migrations, in time order: the
                      # median of their maxima is what noise alone gives for a window that long
                      "noise_window_max_s": window_max(outside, len(inside)),
                      "switch_step_s": switch[0], "switch_step_tokens": switch[1],
                      "load_s": m["load_s"], "switch_s": m["switch_s"],
                      "moved_slots": m["moved_slots"], "bytes_read": m["bytes_read"],
                      "balancedness_before": m["balancedness_before"], "balancedness_after": m["balancedness_after"]})  # fmt: skip
    half = [p["balancedness"] for p in timeline if p["t"] > args.duration / 2]
    return {
        "balancer": "on" if balancer_on else "off",
        "requests_ok": len(tokens),
        "requests_failed": len(errors),
        "decode_tok_s": sum(tokens) / elapsed,
        "timeline": timeline,
        "balancedness_second_half_mean": statistics.mean(half) if half else None,
        "median_decode_step_s": normal,
        "p99_step_s_outside_migrations": p99,
        "migrations": stall,
        "final_version": status["version"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint dir (default: the tiny preset)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--sample", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--expert-workers", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/balancer.json")
    args = ap.parse_args()
    off = run(args.model, False, args)
    print("off:", {k: v for k, v in off.items() if k != "timeline"}, flush=True)
    on = run(args.model, True, args)
    print("on:", {k: v for k, v in on.items() if k != "timeline"}, flush=True)
    worst = max(on["migrations"], key=lambda m: m["longest_decode_step_s"], default=None)
    normal = on["median_decode_step_s"]
    summary = {
        "balancedness_off": off["balancedness_second_half_mean"],
        "balancedness_on": on["balancedness_second_half_mean"],
        "decode_tok_s_off": off["decode_tok_s"],
        "decode_tok_s_on": on["decode_tok_s"],
        "failed_requests": off["requests_failed"] + on["requests_failed"],
        "migrations": len(on["migrations"]),
        "median_decode_step_s": normal,
        "p99_step_s_outside_migrations": on["p99_step_s_outside_migrations"],
        "longest_decode_step_during_migration_s": worst and worst["longest_decode_step_s"],
        "stall_over_normal": worst and normal and worst["longest_decode_step_s"] / normal,
        "noise_window_max_over_normal": worst
        and normal
        and worst["noise_window_max_s"]
        and worst["noise_window_max_s"] / normal,
        "target_stall<2x": worst and worst["longest_decode_step_s"] < 2 * normal,
    }
    print(json.dumps(summary, indent=2))
    result = {"benchmark": "balancer_on_vs_off", "args": vars(args), "summary": summary, "off": off, "on": on}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(off, on, out.with_suffix(".png"))


def plot(off: dict, on: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for run_, style in ((off, "--"), (on, "-")):
        ax.plot([p["t"] for p in run_["timeline"]], [p["balancedness"] for p in run_["timeline"]], style,
                label=f"balancer {run_['balancer']} ({run_['decode_tok_s']:.0f} tok/s)")  # fmt: skip
    versions = [(p["t"], p["version"]) for p in on["timeline"]]
    for (_, v0), (t1, v1) in zip(versions, versions[1:], strict=False):
        if v1 != v0:
            ax.axvline(t1, color="gray", alpha=0.3)
    ax.set_xlabel("seconds")
    ax.set_ylabel("expert-worker balancedness (mean/max)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Skewed workload: balancer on vs off (grey: migrations)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
