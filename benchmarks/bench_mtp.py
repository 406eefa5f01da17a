"""Speculative decoding with the MTP module as the drafter (issue #54) on LocalEngine, side by side
with plain decoding: same checkpoint, same prompts, same threads, one run.

For each preset (a generated checkpoint with one random-weight MTP module: `init_model(...,
mtp=True)`) and batch size:

- identity: greedy tokens with speculation == without, for every prompt, under `deterministic`
  kernels (asserted), and how many answers differ with the default kernels (reported);
- acceptance rate of the drafted token (random MTP weights: near zero, reported as measured;
  `--trained DIR`: the small preset trained with its MTP module by `train_small.py --mtp`, prompted
  with the held-out text pinned beside it, `--trained-new-tokens` (128) at `--trained-batches`);
- decode tokens/s without speculation, with it (the module's own drafts), and with *oracle* drafts
  (each draft replaced by the token plain decoding emits there: acceptance 1.0, the ceiling this
  engine's verify step allows) and half-oracle ones (about 0.5): decode time = time(N new tokens)
  - time(1 new token), as bench_local_engine; the engines take turns within each repeat; median
  and best over repeats.

    python -m benchmarks.bench_mtp [--presets tiny,small] [--batches 1,8] [--threads 2] [--repeats 5]
                                   [--new-tokens 64] [--out benchmarks/results/mtp.json]
                                   [--speculative-tokens 1,2,3] [--no-oracles]
                                   [--trained build/small-trained-mtp] [--trained-batches 1,8,32]
                                   [--batch1-prompts 8] [--cluster-batches 1,8]
                                   [--cluster-identity tiny,tiny-v4] [--merge]

The trained model at batch 1 (LocalEngine and the cluster) runs `--batch1-prompts` (8) held-out
prompts, each alone, one after another: one prompt's acceptance is one text's.

With `--speculative-tokens 1,2,3` each batch has a row per k (the module chained for k > 1), all
measured in the same turns as one plain engine: acceptance per draft position, mean acceptance
length, decode tok/s and speedup over plain, side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.presets import init_model

PROMPT_LEN = 64
BIAS = {56: 6.0}  # (cluster_identity: about a third of random weights' drafts accepted)


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed * 1000 + batch)
    return [[0] + [rng.randrange(4, vocab) for _ in range(PROMPT_LEN - 1)] for _ in range(batch)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def oracle(engine: LocalEngine, reference: dict[tuple, list[int]], rate: float, seed: int = 0) -> None:
    """Replace a share `rate` of the engine's drafts by the tokens plain decoding emits there."""
    rng, original = random.Random(seed), engine.spec.draft

    def draft(parts, *args):
        original(parts, *args)
        for seq in (c.seq for part in parts for c in part):
            ref = reference.get(tuple(seq.prompt_ids), [])[len(seq.output_ids) :]
            if seq.draft and ref and rng.random() < rate:
                seq.draft = ref[: len(seq.draft)] + seq.draft[len(ref) :]

    engine.spec.draft = draft


def decode_seconds(engine: LocalEngine, groups: list[list[list[int]]], new_tokens: int) -> float:
    """Decode seconds of each group of prompts run together (a batch), the groups one after another:
    time(new_tokens) - time(1 token), summed."""
    total = 0.0
    for batch in groups:
        t = time.perf_counter()
        engine.generate(batch, greedy(1))
        one = time.perf_counter() - t
        t = time.perf_counter()
        engine.generate(batch, greedy(new_tokens))
        total += time.perf_counter() - t - one
    return total


def generate(engine: LocalEngine, groups: list[list[list[int]]], params) -> list:
    """Completions of every group's prompts, each group run as one batch, in order."""
    return [c for batch in groups for c in engine.generate(batch, params)]


def speculating(model: Path, k: int, **kw) -> EngineConfig:
    """An engine config drafting k tokens in every step (the batch-size gate never turns it off)."""
    return EngineConfig(
        model=str(model), speculative_tokens=k, speculative_disable_by_batch_size=1 << 20, **kw
    )


def identity(
    model: Path, groups: list[list[list[int]]], new_tokens: int, deterministic: bool, k: int
) -> dict:
    def run(spec: int) -> tuple[list[list[int]], dict | None]:
        cfg = speculating(model, spec, deterministic=deterministic) if spec else \
            EngineConfig(model=str(model), deterministic=deterministic)  # fmt: skip
        e = LocalEngine(cfg)
        return [c.token_ids for c in generate(e, groups, greedy(new_tokens))], e.stats()["spec_decode"]

    (plain, _), (spec, stats) = run(0), run(k)
    differ = sum(a != b for a, b in zip(plain, spec, strict=True))
    return {"deterministic": deterministic, "answers": len(plain), "answers_differing": differ,
            "identical": differ == 0, "acceptance_rate": stats["acceptance_rate"]}  # fmt: skip


def held_out_prompts(model: Path, batch: int) -> list[list[int]]:
    """`batch` prompts of PROMPT_LEN tokens from the held-out text pinned with a trained checkpoint
    (train_small.py), spread evenly over it."""
    from benchmarks.train_small import load_held_out

    ids = load_held_out(model)["token_ids"]
    step = (len(ids) - PROMPT_LEN) // batch
    return [ids[i * step : i * step + PROMPT_LEN] for i in range(batch)]


def acceptance(spec: dict, was: dict) -> dict:
    """What a run drafted and accepted (the difference of two `spec_decode` stats): the rate, per
    draft position (accepted there / drafts: vLLM's per-position acceptance) and the mean acceptance
    length (tokens a verify step emits: 1 + accepted / drafts)."""
    drafts = spec["num_drafts"] - was.get("num_drafts", 0)
    tokens = spec["num_draft_tokens"] - was.get("num_draft_tokens", 0)
    accepted = spec["num_accepted_tokens"] - was.get("num_accepted_tokens", 0)
    before = was.get("num_accepted_tokens_per_pos") or [0] * len(spec["num_accepted_tokens_per_pos"])
    per_position = [a - b for a, b in zip(spec["num_accepted_tokens_per_pos"], before, strict=True)]
    return {"acceptance_rate": accepted / max(1, tokens),
            "acceptance_per_position": [a / max(1, drafts) for a in per_position],
            "mean_acceptance_length": 1 + accepted / max(1, drafts)}  # fmt: skip


def bench(model: Path, groups: list[list[list[int]]], args) -> list[dict]:
    """One row per speculative_tokens k in `args.speculative_tokens` (the same plain engine's
    measure in each: every engine takes its turn within each repeat). groups: the prompts, each
    group run as one batch, the groups one after another (batch 1: several prompts, each alone)."""
    batch_size, ks = len(groups[0]), [int(x) for x in str(args.speculative_tokens).split(",")]
    batch = [p for g in groups for p in g]
    idents = {k: [identity(model, groups, args.new_tokens, d, k) for d in (True, False)] for k in ks}
    for ident in idents.values():
        assert ident[0]["identical"], ident[0]  # (the contract: deterministic kernels, token for token)
    engines = {"plain": LocalEngine(EngineConfig(model=str(model), num_threads=args.threads))}
    plain_answers = generate(engines["plain"], groups, greedy(args.new_tokens))
    reference = {tuple(p): c.token_ids for p, c in zip(batch, plain_answers, strict=True)}
    kinds = ("mtp", "oracle_half", "oracle") if args.oracles else ("mtp",)
    for k in ks:
        for kind in kinds:
            engines[(kind, k)] = LocalEngine(speculating(model, k, num_threads=args.threads))
            if kind != "mtp":
                oracle(engines[(kind, k)], reference, 0.5 if kind == "oracle_half" else 1.0)
    # the default gate (`auto`: measured per batch size), for the first k: what a user gets
    engines[("auto", ks[0])] = LocalEngine(
        EngineConfig(model=str(model), speculative_tokens=ks[0], num_threads=args.threads)
    )
    for e in engines.values():  # warm-up
        e.generate(groups[0], greedy(4))
    before = {n: dict(e.stats()["spec_decode"] or {}) for n, e in engines.items()}
    tps: dict = {n: [] for n in engines}
    for _ in range(args.repeats):
        for name, e in engines.items():  # (in turns: the machine's noise shared alike)
            tps[name].append(len(batch) * (args.new_tokens - 1) / decode_seconds(e, groups, args.new_tokens))

    def measure(name) -> dict:
        out = {"decode_tok_s_median": statistics.median(tps[name]), "decode_tok_s_best": max(tps[name]),
               "decode_tok_s_all": tps[name]}  # fmt: skip
        spec = engines[name].stats()["spec_decode"]
        if spec is None:
            return {**out, "acceptance_rate": None}
        plain = measure("plain")
        gate = {"gate": spec["by_batch_size_summary"]} if name[0] == "auto" else {}
        return {**out, **acceptance(spec, before[name]), **gate,
                "speedup_median": out["decode_tok_s_median"] / plain["decode_tok_s_median"],
                "speedup_best": out["decode_tok_s_best"] / plain["decode_tok_s_best"]}  # fmt: skip

    return [{"batch": batch_size, "speculative_tokens": k, "identity": idents[k], "plain": measure("plain"),
             **{kind: measure((kind, k)) for kind in kinds + (("auto",) if k == ks[0] else ())}}
            for k in ks]  # fmt: skip


def cluster_rows(
    model: Path,
    batches: list[int],
    new_tokens: int,
    repeats: int,
    ks: tuple[int, ...] = (1,),
    batch1_prompts: int = 1,
    rounds: int = 1,
) -> list[dict]:
    """The real cluster (1 attention worker, 2 expert workers, shared memory, `--deterministic`
    off) on `model` without and with speculation (k of `ks` drafts, in every step), one cluster
    each, started in turn `rounds` times: greedy streams of held-out prompts over the official
    client, per batch: decode tok/s (tokens after the first over the time from the first to the
    last, summed over the batch's streams; `repeats` per round, median and best of all), the
    speedup over plain per round (medians of the round's repeats) and its median, the answers
    that differ from the plain cluster's, the acceptance rate and the share of the attention
    worker's step spent waiting for routed experts."""
    import asyncio

    import openai
    import ray

    from services.cluster import Cluster, ClusterConfig
    from services.net import free_port

    async def stream(client, prompt: list[int]) -> tuple[list[int], float]:
        tokens, times = [], []
        response = await client.completions.create(
            model="small", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        async for chunk in response:
            for c in chunk.choices:
                got = getattr(c, "token_ids", None) or []
                tokens += got
                times += [time.perf_counter()] * len(got)
        return tokens, times[-1] - times[0]

    async def run(url: str, batch: list[list[int]]) -> tuple[list[list[int]], float]:
        """Batch > 1: the prompts at once, each stream's own decode rate summed; batch 1 (one prompt
        per group): each alone, one after another, the tokens over the seconds."""
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        if alone:
            answers = [await stream(client, p) for p in batch]
            tok_s = sum(len(t) - 1 for t, _ in answers) / sum(s for _, s in answers)
        else:
            answers = await asyncio.gather(*[stream(client, p) for p in batch])
            tok_s = sum((len(t) - 1) / s for t, s in answers)
        await client.close()
        return [t for t, _ in answers], tok_s

    acc: dict[tuple[int, int], dict] = {}  # (k, batch) -> what its clusters measured, by round
    for r in range(rounds):
        for k in dict.fromkeys((0, *ks)):  # (plain once, whether or not ks names 0)
            cfg = ClusterConfig(model=str(model), served_model_name="small", port=free_port(), attention_workers=1,
                                expert_workers=2, expert_transport="shm", balancer_period_s=0, max_num_seqs=64,
                                speculative_tokens=k, speculative_disable_by_batch_size=1 << 20)  # fmt: skip
            cluster = Cluster.start(cfg)
            try:
                attention = next(iter(cluster.attention.values()))
                alone = False
                asyncio.run(run(cluster.url, held_out_prompts(model, 1)))  # (warm-up)
                for b in batches:
                    alone = b == 1
                    batch = held_out_prompts(model, b if b > 1 else batch1_prompts)
                    before = ray.get(attention.stats.remote())
                    results = [asyncio.run(run(cluster.url, batch)) for _ in range(repeats)]
                    after = ray.get(attention.stats.remote())
                    spec, was = after.get("spec_decode") or {}, before.get("spec_decode") or {}
                    a = acc.setdefault((k, b), {"prompts": len(batch), "rates": [], "differing": 0, "drafts": 0,
                                                "accepted": 0, "step_s": 0.0, "wait_s": 0.0})  # fmt: skip
                    a["rates"].append([rate for _, rate in results])
                    plain = acc[0, b].setdefault("answers", results[0][0])
                    a["differing"] = max(
                        a["differing"], sum(x != y for x, y in zip(results[0][0], plain, strict=True))
                    )
                    a["drafts"] += spec.get("num_draft_tokens", 0) - was.get("num_draft_tokens", 0)
                    a["accepted"] += spec.get("num_accepted_tokens", 0) - was.get("num_accepted_tokens", 0)
                    a["step_s"] += after["times"]["step_s"] - before["times"]["step_s"]
                    a["wait_s"] += after["times"]["expert_wait_s"] - before["times"]["expert_wait_s"]
                    print(json.dumps({"round": r, "speculative_tokens": k, "batch": b, "tok_s": a["rates"][-1]}),
                          flush=True)  # fmt: skip
            finally:
                cluster.stop()
    rows = []
    for (k, b), a in acc.items():
        base = acc[0, b]
        rates, base_rates = sum(a["rates"], []), sum(base["rates"], [])
        by_round = [
            statistics.median(x) / statistics.median(y)
            for x, y in zip(a["rates"], base["rates"], strict=True)
        ]
        rows.append({
            "speculative_tokens": k, "batch": b, "prompts": a["prompts"],
            "decode_tok_s_median": statistics.median(rates), "decode_tok_s_best": max(rates),
            "decode_tok_s_all": rates, "answers_differing_from_plain": a["differing"],
            "acceptance_rate": a["accepted"] / a["drafts"] if a["drafts"] else None,
            "expert_wait_share": a["wait_s"] / a["step_s"] if a["step_s"] else None,
            "speedup_median": statistics.median(rates) / statistics.median(base_rates),
            "speedup_best": max(rates) / max(base_rates),
            "speedup_by_round": by_round, "speedup_round_median": statistics.median(by_round),
        })  # fmt: skip
    return rows


def cluster_identity(model: Path, preset: str, k: int, batch: list[list[int]], new_tokens: int) -> dict:
    """Greedy answers over the API of a real cluster speculating k tokens in every step (1 attention
    worker, 2 expert workers, shared memory, `--deterministic`), the batch sent at once, against
    LocalEngine's without speculation (deterministic kernels). Random weights draft badly, so every
    other request carries a logit bias (BIAS), which the drafts take as the target does: some
    drafts right, some wrong, so both verify paths run."""
    import asyncio

    import openai
    import ray

    from services.cluster import Cluster, ClusterConfig
    from services.net import free_port

    params = [
        dataclasses.replace(greedy(new_tokens), logit_bias=BIAS if i % 2 else {}) for i in range(len(batch))
    ]
    engine = LocalEngine(EngineConfig(model=str(model), deterministic=True))
    plain = [c.token_ids for c in engine.generate(batch, params)]

    async def run(url: str) -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        async def one(i, prompt):
            extra = {"ignore_eos": True, "return_token_ids": True} | ({"logit_bias": BIAS} if i % 2 else {})
            r = await client.completions.create(model=preset, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                                extra_body=extra)  # fmt: skip
            return list(r.choices[0].model_extra["token_ids"])

        try:
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(batch)])
        finally:
            await client.close()

    cfg = ClusterConfig(model=str(model), served_model_name=preset, port=free_port(), attention_workers=1,
                        expert_workers=2, expert_transport="shm", balancer_period_s=0, deterministic=True,
                        speculative_tokens=k, speculative_disable_by_batch_size=1 << 20)  # fmt: skip
    cluster = Cluster.start(cfg)
    try:
        answers = asyncio.run(run(cluster.url))
        spec = ray.get(next(iter(cluster.attention.values())).stats.remote())["spec_decode"]
    finally:
        cluster.stop()
    differ = sum(a != b for a, b in zip(answers, plain, strict=True))
    return {"preset": preset, "speculative_tokens": k, "answers": len(batch), "answers_differing": differ,
            "identical": differ == 0, "num_drafts": spec["num_drafts"], "acceptance_rate": spec["acceptance_rate"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/mtp.json")
    ap.add_argument("--trained", default=None, metavar="DIR",
                    help="also: a checkpoint of train_small.py --mtp, prompted with its held-out text")  # fmt: skip
    ap.add_argument("--speculative-tokens", default="1", metavar="K,K",
                    help="draft tokens per step compared side by side with plain decoding, e.g. 1,2,3 (the MTP "
                         "module chained past 1): a row per k")  # fmt: skip
    ap.add_argument(
        "--no-oracles",
        dest="oracles",
        action="store_false",
        help="skip the oracle / oracle_half engines (each k: one engine instead of three)",
    )
    ap.add_argument("--trained-batches", default="1,8,32")
    ap.add_argument("--batch1-prompts", type=int, default=8,
                    help="the trained model at batch 1 (LocalEngine and cluster): this many held-out prompts, "
                         "each run alone, one after another (one prompt's acceptance is one text's)")  # fmt: skip
    ap.add_argument("--trained-new-tokens", type=int, default=128)
    ap.add_argument("--cluster-batches", default="",
                    help="also: the trained model on the real cluster over shared memory at these batches")  # fmt: skip
    ap.add_argument("--cluster-rounds", type=int, default=1,
                    help="the clusters (plain, then each k) started this many times in turn, --repeats each time: "
                         "a ratio per round, paired in time (this machine's speed drifts)")  # fmt: skip
    ap.add_argument("--cluster-identity", default="", metavar="PRESETS",
                    help="also: greedy identity over a real deterministic cluster's API on these generated "
                         "presets (e.g. tiny,tiny-v4), each k of --speculative-tokens")  # fmt: skip
    ap.add_argument("--merge", action="store_true",
                    help="update --out in place: this run's presets' rows replace theirs, its cluster results "
                         "replace the file's, its settings are appended to `merged_runs`; the rest of the file "
                         "is kept")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []

    def report(row: dict) -> None:
        print(json.dumps({k: v for k, v in row.items() if k != "identity"}, default=str)[:600], flush=True)
        results.append(row)

    with tempfile.TemporaryDirectory() as tmp:
        for preset in filter(None, args.presets.split(",")):
            model = init_model(Path(tmp) / preset, preset, seed=0, mtp=True)
            vocab = ModelConfig.from_dir(model).vocab_size
            for b in (int(x) for x in filter(None, args.batches.split(","))):
                for row in bench(model, [prompts(b, vocab)], args):
                    report({"preset": preset, **row})
    identity_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in filter(None, args.cluster_identity.split(",")):
            model = init_model(Path(tmp) / preset, preset, seed=0, mtp=True)
            for k in (int(x) for x in str(args.speculative_tokens).split(",")):
                vocab = ModelConfig.from_dir(model).vocab_size
                identity_rows.append(cluster_identity(model, preset, k, prompts(8, vocab), args.new_tokens))
                print(json.dumps(identity_rows[-1]), flush=True)
    trained, cluster = None, None
    if args.trained and args.cluster_batches:
        batches = [int(x) for x in args.cluster_batches.split(",")]
        ks = tuple(int(x) for x in str(args.speculative_tokens).split(","))
        cluster = cluster_rows(Path(args.trained), batches, args.trained_new_tokens, args.repeats, ks,
                               args.batch1_prompts, args.cluster_rounds)  # fmt: skip
    if args.trained:
        trained = json.loads((Path(args.trained) / "training.json").read_text())
        for b in (int(x) for x in filter(None, args.trained_batches.split(","))):
            targs = argparse.Namespace(**{**vars(args), "new_tokens": args.trained_new_tokens})
            held_out = held_out_prompts(Path(args.trained), b if b > 1 else args.batch1_prompts)
            groups = [held_out] if b > 1 else [[p] for p in held_out]
            for row in bench(Path(args.trained), groups, targs):
                report({"preset": "small, trained (train_small.py --mtp)", "prompts": "held-out text",
                        "num_prompts": len(held_out), **row})  # fmt: skip
    out = {
        "benchmark": "mtp_speculative_decoding_local_engine",
        "issue": 54,
        "model": "generated presets with one random-weight MTP module (init_model(..., mtp=True)); with "
        "--trained, the small preset trained with its MTP module (train_small.py --mtp)",
        "dtype": "float32",
        "new_tokens": args.new_tokens,
        "prompt_len": PROMPT_LEN,
        "threads": args.threads,
        "repeats": args.repeats,
        "speculative_tokens": [int(x) for x in str(args.speculative_tokens).split(",")],
        "kernels": "default (speed, acceptance); identity also under deterministic",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "rows": results,
        "cluster": cluster,
        "cluster_identity": identity_rows or None,
        "trained_model": None
        if trained is None
        else {
            k: trained.get(k)
            for k in ("steps", "seq_len", "batch", "held_out_loss_end", "mtp", "train_wall_s")
        },
        "notes": [
            "mtp: the MTP module's own drafts; on the generated presets its weights are random, so their "
            "acceptance is what random weights give; the trained rows (--trained) are train_small.py --mtp's "
            "module prompted with the held-out text it never trained on",
            "oracle / oracle_half: each draft (or about half) replaced by the token plain decoding emits there "
            "(acceptance ~1.0 / ~0.5): the ceiling of this engine's verify step, not a drafter",
            "a verify step runs 1 + k rows per sequence: at small batch a MoE layer then reads up to 1 + k times "
            "the experts (different tokens route to different experts), and the MTP layer is one more MoE layer, "
            "run k times per step (chained past the first draft)",
            "mtp / oracle engines draft in every step (speculative_disable_by_batch_size huge); `auto` (the first "
            "k only) is the default gate, which turns speculation off in a batch-size bucket where it emits fewer "
            "tokens per second (its first repeat includes the measuring: see `gate`); acceptance_per_position: "
            "accepted at draft position i / drafts",
        ],
    }
    if args.merge and Path(args.out).is_file():
        was = json.loads(Path(args.out).read_text())
        ran = {r["preset"] for r in results}
        merged = {
            k: out[k] for k in ("new_tokens", "threads", "repeats", "speculative_tokens", "machine", "torch")
        }
        merged |= {"presets": sorted(ran), "cluster_identity_presets": args.cluster_identity or None}
        out = {**was, "rows": [r for r in was["rows"] if r["preset"] not in ran] + results,
               "merged_runs": was.get("merged_runs", []) + [merged],
               **{key: out[key] for key in ("cluster", "cluster_identity", "trained_model") if out[key] is not None}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
