"""Deterministic mode (#53, `EngineConfig.deterministic`) on LocalEngine: what it costs and what it buys.

- cost: decode tokens/s with and without the flag at batch 1 / 8 / 32 (greedy, 64 new tokens; the
  batch over the seconds of each decode-only step, so prefill is excluded), the same threads for
  both, the two modes interleaved run by run; the median over all steps of `--repeats` runs, and
  the best run's median.
- what it buys: `--prompts` prompts x 64 greedy tokens run one at a time (sequential), then the
  same prompts concurrently in `--rounds` rounds (all at once; then arriving one every 1, 3, ...
  steps, so each lands in other batches, beside other prefills), with and without the flag; the
  count of concurrent answers that differ from the sequential ones (and the count of logits rows
  not bit-identical to the sequential run's, over the rows both runs computed).

`--cluster` adds the same over the API of a real local cluster (2 attention workers), once with
and once without the flag: the prompts one at a time, then concurrently on 1 expert worker, on 3,
after a live re-placement (3 -> 2 workers), and with an attention worker SIGKILLed mid-stream;
for a checkpoint with an MTP module (train_small.py --mtp), also concurrently on a cluster that
speculates (one draft token per step); each answer compared with LocalEngine's answer to that
prompt alone (deterministic, no speculation), by tokens and by the float bits of its logprobs; and
the cluster's decode rate at batch 1 and 32 (batch x new tokens over the wall time of the batch's
requests, prefill included) with and without, and the attention workers' step seconds in it and
the part of them spent waiting for the routed experts.

The prompts: random token ids (8-64 of them), or for a trained checkpoint with its held-out text
pinned beside it (train_small.py) `--prompts` 64-token windows of that text.

    python -m benchmarks.bench_determinism [--model DIR | --preset small] [--threads 2] [--repeats 3]
                                           [--cluster] [--out benchmarks/results/determinism.json]
    python -m benchmarks.bench_determinism --model build/small-trained-mtp --cluster  # (train_small --mtp)

`--preset tiny-v32` / `tiny-v4` (generated checkpoints, like `small`) measures the V3.2 indexer's and
DeepSeek-V4's deterministic paths (written to benchmarks/results/determinism_<preset>.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_mtp import held_out_prompts
from benchmarks.train_small import HELD_OUT_FILE
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.presets import default_model_dir
from tests.staggered import run_staggered

NEW_TOKENS = 64


def make_prompts(n: int, vocab: int, seed: int, lo: int = 8, hi: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[0] + torch.randint(4, vocab, (n_ - 1,), generator=g).tolist() for n_ in lens]


def decode_step_seconds(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """The wall time of each decode-only step of a greedy run of `prompts` (all at once)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        result = engine.step()
        if result.num_tokens == result.num_seqs == len(prompts):  # (a decode step of the whole batch)
            times.append(time.perf_counter() - t)
    return times


def decode_tok_s(engines: dict[bool, LocalEngine], batch: int, vocab: int, repeats: int) -> dict:
    """{mode: {median, best}} decode tokens/s at `batch` (batch / a decode step's seconds), the modes
    interleaved run by run: the median over every decode step of `repeats` runs, and the best run's
    median (this box is shared: steps that waited for a core are what the median is for)."""
    prompts = make_prompts(batch, vocab, seed=batch, lo=16, hi=16)
    for engine in engines.values():  # (warm-up)
        decode_step_seconds(engine, prompts, 4)
    steps: dict[bool, list[list[float]]] = {mode: [] for mode in engines}
    for _ in range(repeats):
        for mode, engine in engines.items():
            steps[mode].append(decode_step_seconds(engine, prompts, NEW_TOKENS))
    out = {}
    for mode, runs in steps.items():
        out["deterministic" if mode else "default"] = {
            "median_tok_s": batch / statistics.median([t for run in runs for t in run]),
            "best_tok_s": max(batch / statistics.median(run) for run in runs),
            "runs_median_tok_s": [batch / statistics.median(run) for run in runs],
        }
    return out


def answers(
    engine: LocalEngine, prompts: list[list[int]], stagger: int | None
) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's (greedy tokens, logits rows): run one at a time (stagger None), or all
    concurrently, added at once (0) or one every `stagger` steps."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    if stagger is None:
        return [answers(engine, [p], 0)[0] for p in prompts]
    return run_staggered(engine, prompts, params, stagger)


def identity(engine: LocalEngine, prompts: list[list[int]], rounds: int) -> dict:
    """Sequential vs concurrent: differing answers and logits rows over `rounds` concurrent rounds."""
    sequential = answers(engine, prompts, None)
    staggers = [0, 1, 3, 5, 7][:rounds]
    out = {"answers": 0, "differing_answers": 0, "logits_rows": 0, "differing_logits_rows": 0, "rounds": []}
    for stagger in staggers:
        concurrent = answers(engine, prompts, stagger)
        differing = sum(a[0] != b[0] for a, b in zip(sequential, concurrent, strict=True))
        rows = diff_rows = 0
        for (ta, la), (tb, lb) in zip(sequential, concurrent, strict=True):
            same = next(
                (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), len(ta)
            )  # rows of one prefix
            for x, y in zip(la[: same + 1], lb[: same + 1], strict=False):
                rows += 1
                diff_rows += not torch.equal(x, y)
        out["rounds"].append({"stagger_steps": stagger, "differing_answers": differing, "logits_rows": rows,
                              "differing_logits_rows": diff_rows})  # fmt: skip
        out["answers"] += len(prompts)
        out["differing_answers"] += differing
        out["logits_rows"] += rows
        out["differing_logits_rows"] += diff_rows
    return out


def answer(engine: LocalEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A prompt's greedy tokens and their logprobs, run alone."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    (out,) = engine.generate([prompt], params)
    return out.token_ids, [lp.token_logprob for lp in out.logprobs]


def cluster_runs(model: str, prompts: list[list[int]], reference: list, deterministic: bool) -> dict:
    """The cluster runs (module docstring) in one mode: per run, answers whose tokens / logprob
    bits differ from `reference`; the decode rate at batch 1 and 32."""
    import asyncio

    import openai
    import ray

    from services.model.config import ModelConfig
    from services.settings import BALANCER_NAME
    from tests.clusters import tiny_cluster
    from tests.faults import scenario

    async def ask(url: str, batch: list[list[int]], concurrent: bool, fault=None) -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        async def one(prompt):
            r = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0,
                stream=False, extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.token_logprobs

        if not concurrent:
            out = [await one(p) for p in batch]
        else:
            tasks = [asyncio.create_task(one(p)) for p in batch]
            if fault is not None:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(fault)
            out = await asyncio.gather(*tasks)
        await client.close()
        return out

    def differing(got: list) -> dict:
        return {"answers": len(got), "tokens_differ": sum(list(t) != r[0] for (t, _), r in zip(got, reference, strict=True)),
                "logprobs_differ": sum(list(lp) != r[1] for (_, lp), r in zip(got, reference, strict=True))}  # fmt: skip

    runs, rates, waits = {}, {}, {}
    if ModelConfig.from_dir(model).num_nextn_predict_layers:  # (an MTP module: a cluster that speculates)
        with tiny_cluster(model, attention_workers=2, expert_workers=1, balancer_period_s=0, max_num_seqs=64,
                          deterministic=deterministic, speculative_tokens=1) as cluster:  # fmt: skip
            runs["concurrent, speculating (1 draft token)"] = differing(
                asyncio.run(ask(cluster.url, prompts, True))
            )
    with tiny_cluster(model, attention_workers=2, expert_workers=1, balancer_period_s=0, max_num_seqs=64,
                      deterministic=deterministic) as cluster:  # fmt: skip
        url, ns = cluster.url, cluster.cfg.namespace
        balancer = ray.get_actor(BALANCER_NAME, namespace=ns)
        runs["sequential, 1 expert worker"] = differing(asyncio.run(ask(url, prompts, False)))
        runs["concurrent, 1 expert worker"] = differing(asyncio.run(ask(url, prompts, True)))
        ray.get(balancer.scale_experts.remote(3), timeout=600)
        runs["concurrent, 3 expert workers"] = differing(asyncio.run(ask(url, prompts, True)))
        ray.get(balancer.scale_experts.remote(2), timeout=600)
        runs["concurrent, after a re-placement (3 -> 2)"] = differing(asyncio.run(ask(url, prompts, True)))
        kill = scenario.kill(lambda: scenario.actor_pid("moe-attn-0", ns))
        runs["concurrent, an attention worker killed"] = differing(asyncio.run(ask(url, prompts, True, kill)))
        scenario.wait_healed(ns, expert_workers=2)
        workers = list(cluster.attention.values())  # (a restarted one: the same handle)
        for batch in (1, 32):
            picked = [prompts[i % len(prompts)] for i in range(batch)]
            before = ray.get([a.stats.remote() for a in workers])
            t0 = time.perf_counter()
            asyncio.run(ask(url, picked, True))
            rates[str(batch)] = round(batch * NEW_TOKENS / (time.perf_counter() - t0), 1)
            after = ray.get([a.stats.remote() for a in workers])
            spent = {k: sum(a["times"][k] - b["times"][k] for a, b in zip(after, before, strict=True))
                     for k in ("step_s", "expert_wait_s")}  # fmt: skip
            waits[str(batch)] = {"attention_step_s": round(spent["step_s"], 3),
                                 "expert_wait_s": round(spent["expert_wait_s"], 3)}  # fmt: skip
    total = {k: sum(r[k] for r in runs.values()) for k in ("answers", "tokens_differ", "logprobs_differ")}
    print("cluster", "deterministic" if deterministic else "default", total, rates, flush=True)
    return {"runs": runs, "total": total, "decode_tok_s": rates, "step_seconds": waits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated --preset)")
    ap.add_argument("--preset", default="small", help="the generated preset checkpoint run without --model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32", help='the cost rows\' batches ("": none)')
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cluster", action="store_true", help="also over the API of a local cluster")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/determinism[_<preset>].json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_dir(args.preset))

    def engine(deterministic: bool) -> LocalEngine:
        return LocalEngine(EngineConfig(model=model, deterministic=deterministic, max_num_seqs=64))

    engines = {False: engine(False), True: engine(True)}
    vocab = engines[False].cfg.vocab_size
    cost = []
    for batch in [int(b) for b in args.batches.split(",") if b]:  # ("": no cost rows)
        row = {"batch": batch, **decode_tok_s(engines, batch, vocab, args.repeats)}
        row["ratio_median"] = row["deterministic"]["median_tok_s"] / row["default"]["median_tok_s"]
        row["ratio_best"] = row["deterministic"]["best_tok_s"] / row["default"]["best_tok_s"]
        print(json.dumps(row))
        cost.append(row)
    held_out = args.model and (Path(model) / HELD_OUT_FILE).is_file()
    prompts = (
        held_out_prompts(Path(model), args.prompts) if held_out else make_prompts(args.prompts, vocab, seed=7)
    )
    same = {}
    for mode, e in engines.items():
        same["deterministic" if mode else "default"] = identity(e, prompts, args.rounds)
        print(mode, {k: v for k, v in same["deterministic" if mode else "default"].items() if k != "rounds"})
    result = {
        "benchmark": "determinism",
        "issue": 53,
        "engine": "LocalEngine",
        "model": f"{args.preset} preset (random weights)" if args.model is None else args.model,
        "dtype": "float32",
        "threads": args.threads,
        "new_tokens": NEW_TOKENS,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "kernels": {
            "default": engines[False].kernels.summary(),
            "deterministic": engines[True].kernels.summary(),
        },
        "decode_cost": cost,
        "prompts": "held-out text (64-token windows)" if held_out else "random token ids (8-64)",
        "sequential_vs_concurrent": {"prompts": args.prompts, **same},
    }
    if args.cluster:
        reference = [answer(engines[True], p) for p in prompts]
        result["cluster"] = {mode: cluster_runs(model, prompts, reference, mode == "deterministic")
                             for mode in ("default", "deterministic")}  # fmt: skip
        for batch in (1, 32):
            ratio = result["cluster"]["deterministic"]["decode_tok_s"][str(batch)] / max(
                1e-9, result["cluster"]["default"]["decode_tok_s"][str(batch)]
            )
            result["cluster"][f"ratio_batch_{batch}"] = round(ratio, 3)
    suffix = "" if args.preset == "small" or args.model else f"_{args.preset}"
    out = Path(args.out or f"benchmarks/results/determinism{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
