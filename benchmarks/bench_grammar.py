"""Grammar-constrained decoding: what the token mask costs per step.

Per decode step the engine asks every constrained request's llguidance matcher for its allowed
tokens (one [B, vocab] bool mask, computed on llguidance's thread pool), masks the logits in
one op, and feeds each sampled token back. This measures those three parts at batch 1 / 8 / 32
with a DeepSeek-sized vocabulary (129,280 tokens) and compares them with the sampler's own
cost and with the measured decode step of the `tiny` and `small` presets.

No DeepSeek tokenizer can be downloaded here, so a byte-level BPE with 129,280 tokens is
trained on Python's standard library sources (once, cached under $MOE_CLUSTER_CACHE). Each
request sits mid-way through a JSON object of a schema with strings, numbers, enums and arrays
(the state where masks cost most: inside strings nearly every token is allowed).

    python -m benchmarks.bench_grammar [--out benchmarks/results/grammar.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from services.engine.grammar import GrammarCompiler
from services.engine.sampling import SamplingParams, sample
from services.presets import cache_root

VOCAB = 129_280
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["person", "company", "place"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "kind", "address"],
}
DOCUMENT = {"name": "Ada Lovelace, Countess", "age": 36, "tags": ["math", "poetry", "engines"], "kind": "person",
            "address": {"city": "London", "zip": "W1"}}  # fmt: skip


def big_tokenizer(vocab: int) -> str:
    """A byte-level BPE tokenizer JSON with `vocab` tokens, trained on the stdlib's sources."""
    path = cache_root() / f"bench-bpe-{vocab}.json"
    if path.is_file():
        return path.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = [p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "-packages" not in str(p)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    print(f"training a {vocab}-token BPE on {len(files)} stdlib files ...", file=sys.stderr)
    tok.train_from_iterator((p.read_bytes().decode("utf-8", "ignore") for p in files), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path.read_text()


def timed(fn, repeats: int) -> float:
    """Median seconds of fn()."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/grammar.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tokenizers import Tokenizer

    tokenizer_json = big_tokenizer(VOCAB)
    hf = Tokenizer.from_str(tokenizer_json)
    vocab = max(VOCAB, hf.get_vocab_size())
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer_json, vocab, [1], threads=args.threads)
    tokenizer_s = time.perf_counter() - t0
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    ids = hf.encode(text, add_special_tokens=False).ids
    results = {"vocab": vocab, "tokenizer_vocab": hf.get_vocab_size(), "threads": args.threads,
               "tokenizer_init_s": round(tokenizer_s, 3), "batches": {}}  # fmt: skip
    t0 = time.perf_counter()
    compiler.matcher(SCHEMA)
    results["schema_compile_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    for batch in (1, 8, 32):
        # request i stands at a different point of the document: inside strings, numbers, keys, arrays
        matchers = []
        for i in range(batch):
            m = compiler.matcher(SCHEMA)
            for t in ids[: 1 + (i * 7) % (len(ids) - 1)]:
                assert m.consume(t)
            matchers.append(m)
        mask_s = timed(lambda m=matchers: compiler.allowed(m), args.repeats)
        mask = compiler.allowed(matchers)
        allowed_frac = mask.float().mean().item()
        logits = torch.randn(batch, vocab)
        params = [SamplingParams(temperature=0.0)] * batch
        gens = [p.make_generator() for p in params]
        sample_free = timed(lambda lg=logits, p=params, g=gens: sample(lg, p, g), args.repeats)
        allowed = (list(range(batch)), mask)
        sample_masked = timed(
            lambda lg=logits, p=params, g=gens, a=allowed: sample(lg, p, g, allowed=a), args.repeats
        )
        first_allowed = [int(row.nonzero()[0]) for row in mask]

        def consume(ms=matchers, toks=first_allowed):  # advance by one allowed token, then undo
            for m, t in zip(ms, toks, strict=True):
                m.consume(t)
            for m in ms:
                m._m.rollback(1)

        consume_s = timed(consume, args.repeats)
        results["batches"][str(batch)] = {
            "mask_ms": round(mask_s * 1e3, 3),
            "mask_ms_per_request": round(mask_s * 1e3 / batch, 3),
            "apply_mask_ms": round((sample_masked - sample_free) * 1e3, 3),
            "consume_ms": round(consume_s * 1e3 / 2, 3),  # the rollback costs about as much as the consume
            "sampler_ms_unconstrained": round(sample_free * 1e3, 3),
            "allowed_fraction": round(allowed_frac, 4),
        }
        print(f"B={batch}: {results['batches'][str(batch)]}", file=sys.stderr)
    step = Path(args.out).parent / "local_engine.json"
    if step.is_file():
        results["decode_step_reference"] = (
            "benchmarks/results/local_engine.json (decode step times on this host)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    main()
