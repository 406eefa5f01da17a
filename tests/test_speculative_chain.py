"""More than one draft token per step (#54): the MTP module chained (engine/speculative.py), and the
gate that turns speculation off by batch size (engine/spec_gate.py) wired into LocalEngine. Greedy
tokens stay those of plain decoding, with k = 2 and 3, under deterministic kernels, through
batching, chunked prefill, prefix hits, preemption, stops, max_tokens near the end, and steps that
switch between speculating and not mid-request."""

import itertools

import pytest

from services.engine.sampling import SamplingParams
from services.presets import init_model

from .test_mtp import _engine, _oracle_drafts, _prompts, _run

PLAIN = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
ALWAYS = dict(speculative_disable_by_batch_size=1024)  # (every step speculates: the gate not measuring)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """The tiny preset with one MTP module (random weights), tokenizer included."""
    return init_model(tmp_path_factory.mktemp("tiny-mtp"), "tiny", seed=0, mtp=True)


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_tokens_are_those_without_speculation_with_k_drafts(mtp_model, k):
    """Staggered prompts (some crossing a 64-token block while drafting: the chained passes' rows
    take blocks), penalties, a logit bias, min_tokens, logprobs; drafts as drawn, then with heads of
    them replaced by the true tokens (every position accepted somewhere, and rejected)."""
    kinds = [SamplingParams(**PLAIN), SamplingParams(**PLAIN, logprobs=2, prompt_logprobs=1),
             SamplingParams(**PLAIN, repetition_penalty=1.3, frequency_penalty=0.5),
             SamplingParams(**PLAIN, logit_bias={56: 5.0}, presence_penalty=0.4),
             SamplingParams(**PLAIN, min_tokens=8, stop_token_ids=[56])]  # fmt: skip
    requests = [(f"r{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(_prompts(10, seed=1, lo=40, hi=90))]
    reference = _run(_engine(mtp_model, 0), requests, stagger=2)
    for rate in (0.0, 0.7):
        engine = _engine(mtp_model, k, **ALWAYS)
        _oracle_drafts(engine, reference, rate)
        assert _run(engine, requests, stagger=2) == reference
        stats = engine.stats()["spec_decode"]
        per_position = stats["num_accepted_tokens_per_pos"]
        assert len(per_position) == k and stats["num_speculative_tokens"] == k
        assert stats["num_draft_tokens"] > stats["num_drafts"] > 50  # (k drafts mostly, fewer near the end)
        assert stats["num_accepted_tokens"] == sum(per_position)
        if rate:
            assert all(n > 0 for n in per_position) and per_position == sorted(per_position, reverse=True)
            assert stats["mean_acceptance_length"] > 1.5


def test_chunked_prefill_prefix_hits_and_preemption_compose_with_k_drafts(mtp_model):
    shared = _prompts(1, seed=9, lo=80, hi=80)[0]
    prompts = [shared + p[1:] for p in _prompts(6, seed=2, lo=2, hi=30)]
    requests = [(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]  # fmt: skip
    config = dict(max_num_seqs=6, max_num_batched_tokens=24, num_kv_blocks=7)  # chunks of 24; too few blocks
    reference = _run(_engine(mtp_model, 0, **config), requests, stagger=3)
    for k in (2, 3):
        engine = _engine(mtp_model, k, **config, **ALWAYS)
        _oracle_drafts(engine, reference, 0.6)
        assert _run(engine, requests, stagger=3) == reference
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
        assert stats["spec_decode"]["num_accepted_tokens_per_pos"][1] > 0


def test_stops_and_max_tokens_cut_a_step_of_k_drafts(mtp_model):
    """Every draft the true tokens, k drafted even with fewer tokens left: a step that would emit
    past max_tokens, a stop token or a stop string emits only what plain decoding would."""
    prompts = _prompts(6, seed=3)
    engine = _engine(mtp_model, 0)
    free = _run(engine, [(f"f{i}", p, SamplingParams(**PLAIN)) for i, p in enumerate(prompts)])
    text_of = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    requests = []
    for i, p in enumerate(prompts):
        toks = free[f"f{i}"]["tokens"]
        stop_tok = next(t for t in toks[4:] if t not in toks[:4])
        printable = next((t for t in toks[3:] if text_of(t).isascii() and text_of(t).strip()), None)
        requests += [(f"len{i}", p, SamplingParams(**{**PLAIN, "max_tokens": 1 + i}, logprobs=0)),
                     (f"tok{i}", p, SamplingParams(**PLAIN, stop_token_ids=[stop_tok]))]  # fmt: skip
        if printable is not None:
            requests.append((f"str{i}", p, SamplingParams(**PLAIN, stop=[text_of(printable)])))
    reference = _run(engine, requests)
    for k in (2, 3):
        spec = _engine(mtp_model, k, **ALWAYS)
        _oracle_drafts(spec, reference, 1.0, always=True)
        assert _run(spec, requests) == reference
        assert spec.stats()["spec_decode"]["acceptance_rate"] > 0.5
    assert {v["finish"] for v in reference.values()} >= {"length", "stop"}


def test_a_sequence_near_its_end_drafts_fewer(mtp_model):
    """num_drafts: up to k, below the tokens left to generate and to the context's end."""
    engine = _engine(mtp_model, 3, max_model_len=64, **ALWAYS)
    seen = []
    original = engine.spec.draft

    def draft(parts, *args):
        original(parts, *args)
        seen.extend((len(c.seq.output_ids), len(c.seq.draft)) for part in parts for c in part if c.seq.draft)

    engine.spec.draft = draft
    engine.generate([[0, 5, 6]], SamplingParams(**{**PLAIN, "max_tokens": 6}))
    assert seen and all(n <= min(3, 6 - out - 1) for out, n in seen)
    assert {out: n for out, n in seen}.get(4) == 1  # (two tokens left: one draft, the step's own token)
    engine.generate([[0] + list(range(4, 60))], SamplingParams(**{**PLAIN, "max_tokens": 7}))  # 57 + 7 = 64
    assert all(57 + out + n <= 63 for out, n in seen[-3:])  # (never past the context's end)


def test_greedy_tokens_survive_switching_between_speculative_and_plain_steps(mtp_model):
    """The gate's choice flips every step or two, mid-request (and the measured `auto` gate on its
    own): plain and speculative steps are interchangeable, the tokens are plain decoding's."""
    requests = [(f"r{i}", p, SamplingParams(**PLAIN)) for i, p in enumerate(_prompts(6, seed=4))]
    reference = _run(_engine(mtp_model, 0), requests, stagger=1)
    for k in (1, 2):
        engine = _engine(mtp_model, k)
        choices = itertools.cycle([True, False, True, True, False])
        engine.spec.gate.speculate = lambda n, choices=choices: next(choices)
        _oracle_drafts(engine, reference, 0.5)
        assert _run(engine, requests, stagger=1) == reference
        assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    auto = _engine(mtp_model, 2)
    auto.spec.gate.probe_every = 3  # (plain steps often, while measuring)
    assert _run(auto, requests, stagger=1) == reference
    gate = auto.stats()["spec_decode"]["by_batch_size"]
    assert gate["disable_by_batch_size"] == "auto"
    assert any(b["samples"][0] and b["samples"][1] for b in gate["buckets"].values())  # (both sides ran)


def test_an_explicit_disable_by_batch_size_speculates_only_at_or_below_it(mtp_model):
    requests = [(f"r{i}", p, SamplingParams(**PLAIN)) for i, p in enumerate(_prompts(4, seed=5))]
    reference = _run(_engine(mtp_model, 0), requests)
    off = _engine(mtp_model, 2, speculative_disable_by_batch_size=3)  # (4 running: plain until one ends)
    assert _run(off, requests) == reference
    assert off.stats()["spec_decode"]["num_drafts"] == 0
    on = _engine(mtp_model, 2, speculative_disable_by_batch_size=4)
    assert _run(on, requests) == reference
    stats = on.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["by_batch_size"] == {"disable_by_batch_size": 4, "buckets": {}}


def test_the_chained_passes_rows_take_free_blocks_or_draft_fewer(mtp_model, monkeypatch):
    """Prompts of 64 tokens: after the prefill the chained passes write at position 64, a block the
    sequences do not hold yet. With 3 blocks in all the first takes the free one, the second drafts
    one token (none left); the tokens are plain decoding's, every block given back."""
    from services.engine.scheduler import Scheduler

    grown = []
    original = Scheduler.grow_blocks

    def grow_blocks(self, seq, num_tokens):
        before = len(seq.block_ids)
        ok = original(self, seq, num_tokens)
        grown.append((seq.request_id, ok, len(seq.block_ids) - before))
        return ok

    monkeypatch.setattr(Scheduler, "grow_blocks", grow_blocks)
    prompts = [[0] + p[1:64] for p in _prompts(2, seed=6, lo=70, hi=80)]
    requests = [(f"r{i}", p, SamplingParams(**PLAIN)) for i, p in enumerate(prompts)]
    reference = _run(_engine(mtp_model, 0, num_kv_blocks=3), requests)
    engine = _engine(mtp_model, 3, num_kv_blocks=3, **ALWAYS)
    seen = []
    original_draft = engine.spec.draft

    def draft(parts, *args):
        original_draft(parts, *args)
        seen.append({c.seq.request_id: len(c.seq.draft) for part in parts for c in part})

    engine.spec.draft = draft
    assert _run(engine, requests) == reference
    assert grown[:2] == [("r0", True, 1), ("r1", False, 0)]
    assert seen[0] == {"r0": 3, "r1": 1}


def test_chained_passes_go_to_remote_experts_and_count_in_the_tally(mtp_model, monkeypatch):
    """An engine over real gRPC expert servers (in this process, no Ray), k = 2: greedy tokens are
    plain decoding's; every MTP pass (the first and the chained one) dispatches its MoE layer to the
    servers, one round trip per pass and worker, and the step's tally counts each pass's routed
    choices in the MTP layer's row."""
    from services.dataplane.placement import Placement
    from services.dataplane.remote_experts import RemoteExperts
    from services.engine.engine import Engine, EngineConfig, load_engine
    from services.experts.client import load_placement
    from services.experts.server import ExpertServer, ExpertWorkerConfig
    from services.model.config import ModelConfig
    from services.model.mtp import served_experts

    prompts = _prompts(6, seed=7, lo=3, hi=60)
    params = [SamplingParams(**{**PLAIN, "max_tokens": 14}, logit_bias={56: 6.0} if i % 2 else {})
              for i in range(len(prompts))]  # fmt: skip
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    reference = _run(_engine(mtp_model, 0), requests)
    mtp_rows, passes = [], []
    cfg = served_experts(ModelConfig.from_dir(mtp_model), True)
    servers = [ExpertServer(ExpertWorkerConfig(model=str(mtp_model), deterministic=True)) for _ in range(2)]
    try:
        workers = tuple(s.start() for s in servers)
        placement = Placement.round_robin(cfg.num_moe_layers, cfg.n_routed_experts, workers, 8)
        load_placement(placement, {w: w for w in workers}, cfg.moe_layers)
        engine_cfg = EngineConfig(model=str(mtp_model), deterministic=True, speculative_tokens=2, **ALWAYS)
        mcfg, model, experts, tokenizer = load_engine(
            engine_cfg, lambda m, r, d: RemoteExperts(cfg, placement)
        )
        original = model.mtp_forward

        def mtp_forward(w, batch, hidden, kv):  # (counts each pass's rows)
            mtp_rows.append(len(batch.input_ids))
            return (yield from original(w, batch, hidden, kv))

        model.mtp_forward = mtp_forward
        engine = Engine(mcfg, model, experts, engine_cfg, tokenizer)
        got = {rid: [] for rid, _, _ in requests}
        for rid, p, sp in requests:
            engine.add_request(p, sp, request_id=rid)
        mtp_load = 0
        while engine.has_unfinished():
            before = len(mtp_rows)
            result = engine.step()
            passes.append(len(mtp_rows) - before)
            mtp_load += int(result.expert_load[-1].sum())
            for o in result.outputs:
                got[o.request_id] += o.token_ids
        assert got == {rid: v["tokens"] for rid, v in reference.items()}
        spec = engine.stats()["spec_decode"]
        assert spec["num_accepted_tokens_per_pos"][0] > 0 and spec["num_draft_tokens"] > spec["num_drafts"]
        assert max(passes) == 2  # (the first pass and one chained pass per step)
        assert mtp_load == sum(mtp_rows) * cfg.num_experts_per_tok  # (every pass's rows in the tally)
        steps = len(passes)
        assert 0 < experts.stats.rpcs <= (steps * (cfg.num_moe_layers - 1) + sum(passes)) * len(workers)
    finally:
        for s in servers:
            s.stop(0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-v32", "tiny-v4"])
def test_a_step_that_does_not_speculate_writes_the_modules_rows_alone(preset, tmp_path):
    """After a step the gate keeps plain, the module only writes its cache rows (no MoE layer, no
    head: `mtp_cache_rows`), and they are the rows a full pass writes: the drafts a later
    speculating step makes are, bit for bit under --deterministic, those of an engine that ran the
    full pass after every step (V3, V3.2 with its indexer keys, V4's state rows). Greedy tokens are
    plain decoding's."""
    model = init_model(tmp_path / preset, preset, seed=0, mtp=True, tokenizer=False)
    requests = [
        (f"r{i}", p, SamplingParams(**PLAIN)) for i, p in enumerate(_prompts(4, seed=8, lo=20, hi=80))
    ]
    reference = _run(_engine(model, 0), requests)

    def drafting(engine) -> tuple[dict, list]:
        drafts, passes, original = {}, [], engine.spec.draft

        def draft(parts, *args):
            original(parts, *args)
            for seq in (c.seq for part in parts for c in part if c.seq.draft):
                drafts[seq.request_id, len(seq.output_ids)] = list(seq.draft)

        for name in ("mtp_forward", "mtp_cache_rows"):
            method = getattr(engine.model, name)
            setattr(
                engine.model, name, lambda *a, name=name, method=method: passes.append(name) or method(*a)
            )
        engine.spec.draft = draft
        return drafts, passes

    always = _engine(model, 1, **ALWAYS)
    always_drafts, always_passes = drafting(always)
    assert _run(always, requests) == reference
    flipping = _engine(model, 1)
    choices = itertools.cycle([True, False, False, True, False])
    flipping.spec.gate.speculate = lambda n: next(choices)
    drafts, passes = drafting(flipping)
    assert _run(flipping, requests) == reference
    common = drafts.keys() & always_drafts.keys()
    assert len(common) >= 20 and all(drafts[key] == always_drafts[key] for key in common)
    assert passes.count("mtp_cache_rows") > passes.count("mtp_forward") / 2  # (the plain steps')
    assert always_passes.count("mtp_cache_rows") <= len(requests)  # (only where no sequence may draft)
