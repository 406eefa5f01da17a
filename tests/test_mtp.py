"""Multi-token prediction (#54): the MTP module as DeepSeek-V3 ships it (model/mtp.py, checked against
transformers' MtpLayer) and speculative decoding with it in LocalEngine (engine/speculative.py):
greedy tokens identical to plain decoding, sampled tokens distributed as the target's (rejection
sampling), composing with batching, chunked prefill, prefix caching, preemption, stops, logprobs."""

import json
import math
import random
import shutil

import pytest
import torch
from safetensors import safe_open

from services.engine import speculative
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.speculative import accept, parse_speculative_config, speculative_tokens
from services.model.batch import StepBatch
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.messages import run_interleaved
from services.model.mtp import mtp_forward
from services.presets import init_model

from .hf_oracle import load_hf

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """The tiny preset with one MTP module (random weights), tokenizer included."""
    return init_model(tmp_path_factory.mktemp("tiny-mtp"), "tiny", seed=0, mtp=True)


def _engine(model, spec: int, deterministic: bool = True, **kw) -> LocalEngine:
    return LocalEngine(
        EngineConfig(model=str(model), speculative_tokens=spec, deterministic=deterministic, **kw)
    )


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(
    engine: LocalEngine, requests: list[tuple[str, list[int], SamplingParams]], stagger: int = 0
) -> dict:
    """request id -> Completion-like dict (tokens, logprobs, text, finish); one request added every
    `stagger` steps (0: all at once)."""
    out = {rid: {"tokens": [], "logprobs": [], "text": "", "finish": None} for rid, _, _ in requests}
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending:
            rid, prompt, params = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
            if stagger == 0:
                continue
        for _ in range(max(stagger, 1)):
            for o in engine.step().outputs:
                acc = out[o.request_id]
                acc["tokens"] += o.token_ids
                acc["logprobs"] += [(lp.token_logprob, lp.top) if lp else None for lp in o.logprobs]
                acc["text"] += o.text
                if o.prompt_logprobs is not None:
                    acc["prompt_logprobs"] = [lp and (lp.token_logprob, lp.rank) for lp in o.prompt_logprobs]
                if o.finished:
                    acc["finish"] = o.finish_reason
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks  # every block given back
    return out


def _oracle_drafts(engine: LocalEngine, reference: dict, rate: float, seed: int = 0, always: bool = False):
    """After each MTP pass, replace a share `rate` of the drafts by the reference's true next tokens
    (so that many drafts are accepted: the verify paths with a bonus token run); with k > 1 drafts a
    head of random length of them (so a step accepts some and rejects the next); always: draft k even
    where the engine would draft fewer (tokens left), so a step may emit past max_tokens if let."""
    rng, spec = random.Random(seed), engine.spec
    original = spec.draft
    if always:
        spec.num_drafts = lambda seq: 0 if seq.request_id in engine._matchers else spec.k

    def draft(parts, *args):
        original(parts, *args)
        for seq in (c.seq for part in parts for c in part):
            ref = reference[seq.request_id]["tokens"][len(seq.output_ids) :]
            if seq.draft and ref and rng.random() < rate:
                n = rng.randint(1, len(seq.draft))
                seq.draft = ref[:n] + seq.draft[n:]

    spec.draft = draft


def test_the_preset_writes_the_mtp_module_in_the_hugging_face_layout(mtp_model, tiny_model, tmp_path):
    cfg = ModelConfig.from_dir(mtp_model)
    assert (
        cfg.num_nextn_predict_layers == 1 and cfg.mtp_layers == [3] and cfg.moe_index(3) == cfg.num_moe_layers
    )
    reader = CheckpointReader(mtp_model)
    names = set(reader.names())
    mtp = {n for n in names if n.startswith("model.layers.3.")}
    for own in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        assert f"model.layers.3.{own}.weight" in mtp
    assert (
        "model.layers.3.self_attn.kv_b_proj.weight" in mtp
        and "model.layers.3.mlp.experts.15.down_proj.weight" in mtp
    )
    assert torch.equal(reader.get("model.layers.3.shared_head.head.weight"), reader.get("lm_head.weight"))
    plain = CheckpointReader(tiny_model)  # the main model is drawn first: the same weights as without MTP
    assert names - mtp == set(plain.names())
    assert all(
        torch.equal(reader.get(n), plain.get(n)) for n in ("lm_head.weight", "model.layers.2.mlp.gate.weight")
    )
    fp8 = CheckpointReader(init_model(tmp_path / "fp8", "tiny", mtp=True, fp8=True, tokenizer=False))
    assert fp8.raw("model.layers.3.eh_proj.weight").dtype == torch.float32  # (BF16 in DeepSeek's: not FP8)
    assert fp8.raw("model.layers.3.self_attn.o_proj.weight").dtype == torch.float8_e4m3fn


def test_the_mtp_forward_matches_transformers_mtp_layer(mtp_model, tmp_path):
    """transformers 5.x's MtpLayer (enorm / hnorm / eh_proj, a DeepseekV3DecoderLayer, post norm) on
    our checkpoint: its decoder layer loaded as a 4th layer of another copy, the rest set from the
    file; the main model's final-normed states in, vLLM's zeroed embedding at position 0."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf_cfg = json.loads((mtp_model / "config.json").read_text())
    models = {}
    for n in (3, 4):
        path = tmp_path / f"layers{n}"
        shutil.copytree(mtp_model, path)
        (path / "config.json").write_text(
            json.dumps({**hf_cfg, "num_hidden_layers": n, "num_nextn_predict_layers": 0})
        )
        models[n] = load_hf(path)
    main = models[3]
    layer = MtpLayer(main.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 3)
    layer.mtp_block = models[4].model.layers[3]
    with safe_open(str(mtp_model / "model.safetensors"), "pt") as f:
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("shared_head.norm", "post_norm")):  # fmt: skip
            getattr(layer, theirs).weight.data.copy_(f.get_tensor(f"model.layers.3.{ours}.weight"))
        head = f.get_tensor("model.layers.3.shared_head.head.weight")
    prompt, after = _prompts(1, seed=5, lo=40, hi=40)[0], 7
    T = len(prompt)
    with torch.no_grad():
        h = main.model(torch.tensor([prompt])).last_hidden_state
        e = main.model.embed_tokens(torch.tensor([prompt[1:] + [after]])).clone()
        e[:, 0] = 0
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer.eval()(e, h, main.model.rotary_emb(e, position_ids=pos), mask, pos, None)
        expected = (out @ head.t())[0]

    engine = _engine(mtp_model, 1, deterministic=False)
    model, blocks = engine.model, engine.scheduler.allocator.allocate(1)
    batch = StepBatch.build([(prompt, 0, blocks, True, range(T - 1))], "cpu", keep_hidden=True)
    run_interleaved([model.forward(batch, engine.cache.kv)], engine.experts)
    assert (batch.hidden - h[0]).abs().max() < 1e-4
    drafts = StepBatch.build([(prompt[1:] + [after], 0, blocks, True, range(T - 1))], "cpu")
    got = run_interleaved(
        [mtp_forward(model, model.mtp[0], drafts, batch.hidden, engine.cache.kv)], engine.experts
    )[0]
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()  # (logits of ~20: within 2e-3)


def test_what_speculation_needs_is_refused_clearly(tiny_model, mtp_model, tmp_path):
    with pytest.raises(ValueError, match="MTP module"):
        _engine(tiny_model, 1)  # (no MTP module declared)
    broken = tmp_path / "declared"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text(json.dumps({**json.loads((tiny_model / "config.json").read_text()),
                                                    "num_nextn_predict_layers": 1}))  # fmt: skip
    with pytest.raises(ValueError, match="no model.layers.3.eh_proj.weight"):
        _engine(broken, 1)
    with pytest.raises(ValueError, match="1 to 4 draft tokens per step"):
        _engine(mtp_model, 5)
    off = _engine(mtp_model, 0)
    assert off.spec is None and off.model.mtp == [] and off.cache.kv.shape[0] == 3  # (nothing loaded or held)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default-kernels"])
def test_greedy_tokens_and_logprobs_are_those_without_speculation(mtp_model, deterministic):
    """Several prompts, staggered into a running batch; some with penalties, a logit bias or
    min_tokens (they speculate, their drafts' rows processed as if accepted), some asking for
    logprobs and prompt logprobs; half the drafts replaced by the true next token so that accepted
    drafts and bonus tokens occur."""
    plain = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    kinds = [SamplingParams(**plain), SamplingParams(**plain, logprobs=2, prompt_logprobs=1),
             SamplingParams(**plain, repetition_penalty=1.3, frequency_penalty=0.5),
             SamplingParams(**plain, logit_bias={56: 5.0}, presence_penalty=0.4),
             SamplingParams(**plain, min_tokens=8, stop_token_ids=[56])]  # fmt: skip
    requests = [(f"r{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(_prompts(10, seed=1))]
    reference = _run(_engine(mtp_model, 0, deterministic), requests, stagger=2)
    for rate in (0.0, 0.5):
        engine = _engine(mtp_model, 1, deterministic)
        _oracle_drafts(engine, reference, rate)
        got = _run(engine, requests, stagger=2)
        stats = engine.stats()["spec_decode"]
        assert stats["num_drafts"] > 50 and stats["num_draft_tokens"] == stats["num_drafts"]
        if rate:
            assert stats["num_accepted_tokens"] > stats["num_drafts"] / 4  # (the bonus path ran)
        if deterministic:
            assert got == reference
        else:  # (kernels by batch size: a verify step's rows may take other sums; report, not a bound)
            differing = sum(got[r]["tokens"] != reference[r]["tokens"] for r, _, _ in requests)
            print(f"default kernels, oracle rate {rate}: {differing} of {len(requests)} answers differ")


def test_chunked_prefill_prefix_hits_and_preemption_compose(mtp_model):
    shared = _prompts(1, seed=9, lo=80, hi=80)[0]  # one full block and more in common
    prompts = [shared + p[1:] for p in _prompts(6, seed=2, lo=2, hi=30)]
    requests = [(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]  # fmt: skip
    config = dict(max_num_seqs=6, max_num_batched_tokens=24, num_kv_blocks=7)  # chunks of 24; too few blocks
    reference = _run(_engine(mtp_model, 0, **config), requests, stagger=3)
    engine = _engine(mtp_model, 1, **config)
    _oracle_drafts(engine, reference, 0.6)
    assert _run(engine, requests, stagger=3) == reference
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["spec_decode"]["num_accepted_tokens"] > 0


def test_stops_and_max_tokens_cut_a_speculative_step(mtp_model):
    """Every draft the true next token, drafted even with one token left: a step that would emit a
    bonus past max_tokens, past a stop token or past a stop string emits only what plain decoding
    would (the same tokens, text and finish reasons)."""
    prompts = _prompts(6, seed=3)
    ref_free = _run(_engine(mtp_model, 0), [(f"f{i}", p, GREEDY) for i, p in enumerate(prompts)])
    engine = _engine(mtp_model, 0)
    text_of = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    requests = []
    for i, p in enumerate(prompts):
        toks = ref_free[f"f{i}"]["tokens"]
        stop_tok = next(t for t in toks[3:] if t not in toks[:3])
        printable = next((t for t in toks[2:] if text_of(t).isascii() and text_of(t).strip()), None)
        requests += [
            (f"len{i}", p, SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True, logprobs=0)),
            (
                f"tok{i}",
                p,
                SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
            ),
        ]
        if printable is not None:
            requests.append((f"str{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                          stop=[text_of(printable)])))  # fmt: skip
    reference = _run(engine, requests)
    spec = _engine(mtp_model, 1)
    _oracle_drafts(spec, reference, 1.0, always=True)
    got = _run(spec, requests)
    assert got == reference
    assert {v["finish"] for v in reference.values()} >= {"length", "stop"}
    assert spec.stats()["spec_decode"]["acceptance_rate"] > 0.5


def test_fp8_checkpoints_with_the_module_kept_fp8(tmp_path):
    """An FP8 block-quantised checkpoint (eh_proj left BF16 as DeepSeek ships it): the module's
    layer loads with its linears and experts kept FP8, and speculation changes no token."""
    model = init_model(tmp_path / "fp8", "tiny", mtp=True, fp8=True, fp8_block=(16, 16), tokenizer=False)
    kept = dict(keep_fp8_linears=True, keep_fp8_experts=True)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts(4, seed=4))]
    reference = _run(_engine(model, 0, **kept), requests)
    engine = _engine(model, 1, **kept)
    assert type(engine.model.mtp[0].layer.attn.o).__name__ == "Fp8Weight"
    assert _run(engine, requests) == reference


def test_structured_outputs_fall_back_to_plain_decoding(mtp_model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [("json", [0, 40, 50], SamplingParams(max_tokens=30, temperature=0.0, json_schema=schema)),
                ("free", [0, 40, 50], GREEDY)]  # fmt: skip
    reference = _run(_engine(mtp_model, 0), requests)
    engine = _engine(mtp_model, 1)
    assert _run(engine, requests) == reference
    assert engine.stats()["spec_decode"]["refused_requests"] == 1


# ---- sampled: the output distribution is the target's ------------------------------------------------------
def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-draft", "argmax-draft"])
def test_rejection_sampling_gives_the_target_distribution(greedy_draft, monkeypatch):
    """A small vocabulary, a target p and a draft q far apart: the first emitted token is
    distributed as p (total variation within sampling noise, ~0.005 here), and a rule that resamples
    a rejected draft from p instead of norm(max(0, p - q)) fails the same bound."""
    V, N, bound = 6, 20000, 0.02
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)

    def first_tokens() -> torch.Tensor:
        counts, gen = torch.zeros(V), torch.Generator().manual_seed(1)
        for _ in range(N):
            d = int(q[0].argmax()) if greedy_draft else int(torch.multinomial(q[0], 1, generator=gen))
            counts[accept(p, None if greedy_draft else q, [d], gen)[0]] += 1
        return counts

    assert _tv(first_tokens(), p[0]) < bound
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)  # (the wrong rule)
    assert _tv(first_tokens(), p[0]) > bound


def _chi2_critical(dof: int, z: float = 3.72) -> float:
    """The chi-square quantile at p = 1e-4 (z: the normal's), by Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_outputs_through_the_engine_follow_the_target(tmp_path, monkeypatch, k):
    """A vocabulary of 8: the joint distribution of the two tokens after the first (k = 1: the first
    and the second) over 2,400 seeded requests, the step after the prefill verifying k drafts (k = 2:
    the second and third tokens, the third drawn from the chained module's draft where the second
    was accepted), against the exact one from the target's logits (deterministic kernels: the same
    bits in both engines); chi-square at p = 1e-4. A rule that accepts every draft fails it."""
    model = init_model(tmp_path / "v8", "tiny", mtp=True, tokenizer=False, overrides={"vocab_size": 8})
    prompt, T, N = [0, 5, 3, 6, 2], 2.0, 2400
    params = lambda seed: SamplingParams(max_tokens=2 + k, temperature=T, ignore_eos=True, seed=seed)  # noqa: E731
    plain = _engine(model, 0, max_num_seqs=256)

    def probs(tokens: list[int]) -> torch.Tensor:
        plain.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        return torch.softmax(plain.step().logits[0] / T, -1)

    def pairs(context: list[int]) -> torch.Tensor:  # [a, b]: the next two tokens' joint distribution
        return probs(context)[:, None] * torch.stack([probs(context + [t]) for t in range(8)])

    if k == 1:
        exact = pairs(prompt)
    else:  # (the first token summed out)
        exact = sum(p * pairs(prompt + [t]) for t, p in enumerate(probs(prompt).tolist()))
    first = k - 1  # (the output index of the pair's first token)

    def chi2() -> tuple[float, int, dict]:
        engine = _engine(model, k, max_num_seqs=256, speculative_disable_by_batch_size=256)
        counts = torch.zeros(8, 8)
        for start in range(0, N, 240):
            outs = engine.generate([prompt] * 240, [params(s) for s in range(start, start + 240)])
            for o in outs:
                counts[o.token_ids[first], o.token_ids[first + 1]] += 1
        expected = (exact * N).flatten()
        big = expected >= 5
        obs, exp = counts.flatten()[big], expected[big]
        obs = torch.cat([obs, counts.flatten()[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
        return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1, engine.stats()["spec_decode"]

    stat, dof, stats = chi2()
    assert stats["num_drafts"] >= N and stats["num_draft_tokens"] >= k * N
    assert stats["acceptance_rate"] > 0.1 and len(stats["num_accepted_tokens_per_pos"]) == k
    assert min(stats["num_accepted_tokens_per_pos"]) > 0  # (accepted and rejected both, at each position)
    assert stat < _chi2_critical(dof), (stat, dof)
    monkeypatch.setattr(speculative, "accept", lambda p, q, draft, g: [*draft, int(p[-1].argmax())])
    wrong, dof, _ = chi2()
    assert wrong > _chi2_critical(dof), (wrong, dof)


# ---- configuration and metrics -----------------------------------------------------------------------------
def test_flags_speculative_config_and_metrics(mtp_model):
    from services.cli import build_parser
    from services.router.metrics import RouterMetrics

    assert parse_speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 1}') == 1
    assert speculative_tokens(None, '{"method": "mtp", "num_speculative_tokens": 1}') == 1
    assert speculative_tokens(1, None) == 1 and speculative_tokens(None, None) == 0
    for bad in ('{"method": "eagle", "num_speculative_tokens": 1}', '{"num_speculative_tokens": -1}'):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)
    with pytest.raises(ValueError, match="disagree"):
        speculative_tokens(2, '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
    args = build_parser().parse_args(["generate", "--speculative-config", '{"method": "deepseek_mtp"}'])
    assert speculative_tokens(args.speculative_tokens, args.speculative_config) == 1
    assert build_parser().parse_args(["generate", "--speculative-tokens", "1"]).speculative_tokens == 1
    assert build_parser().parse_args(["init-model", "x", "--mtp"]).mtp

    engine = _engine(mtp_model, 1)
    engine.generate(_prompts(2), GREEDY)
    spec = engine.stats()["spec_decode"]
    assert spec["num_drafts"] == spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == sum(spec["num_accepted_tokens_per_pos"]) <= spec["num_drafts"]
    stats = {**engine.stats(), "worker_id": "w0", "placement_version": 1,
             "times": {"steps": 1, "step_s": 0.1, "expert_wait_s": 0.0, "failed_steps": 0}}  # fmt: skip
    text = RouterMetrics().render([stats], None).decode()
    assert f'vllm:spec_decode_num_drafts{{worker="w0"}} {float(spec["num_drafts"])}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos{position="0",worker="w0"}' in text
    assert "vllm:spec_decode_num_draft_tokens" in text and "vllm:spec_decode_num_accepted_tokens{" in text


def test_v32s_mtp_layer_with_its_indexer_keeps_greedy_tokens(tmp_path):
    """DeepSeek-V3.2: the MTP layer has its own lightning indexer (its keys in its cache slot's rows);
    contexts past index_topk, so the layer's attention is top-k sparse. Greedy tokens identical, the
    drafts accepted or not (half replaced by the true next tokens)."""
    model = init_model(tmp_path / "v32", "tiny-v32", seed=0, mtp=True, tokenizer=False)
    cfg = ModelConfig.from_dir(model)
    assert f"model.layers.{cfg.mtp_layers[0]}.self_attn.indexer.wk.weight" in set(
        CheckpointReader(model).names()
    )
    prompts = _prompts(6, seed=6, lo=cfg.index_topk, hi=cfg.index_topk + 60)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    reference = _run(_engine(model, 0), requests, stagger=2)
    for k in (1, 2):
        engine = _engine(model, k)
        _oracle_drafts(engine, reference, 0.6)
        assert _run(engine, requests, stagger=2) == reference
        spec = engine.stats()["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
