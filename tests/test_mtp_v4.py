"""DeepSeek-V4's multi-token prediction (#54): DeepSeek's MTPBlock (deepseek_v4.py `mtp_forward`,
checked against transformers' V4 decoder layer) and speculative decoding with it: greedy tokens
identical to plain decoding while drafts are accepted and rejected across the compressors'
windows (a rejected draft's state rows and entries are recomputed, not rolled back), with
chunked prefill, prefix hits, preemption and state blocks short."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.sampling import SamplingParams
from services.model.batch import StepBatch
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.messages import run_interleaved
from services.presets import init_model

from .hf_oracle import load_hf
from .test_mtp import _engine, _oracle_drafts, _prompts, _run


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    """The tiny V4 preset with one MTP module (random weights), tokenizer included."""
    return init_model(tmp_path_factory.mktemp("tiny-v4-mtp"), "tiny-v4", seed=0, mtp=True)


def test_the_preset_writes_deepseeks_mtp_block_and_its_release_names_load(v4_mtp, tmp_path):
    cfg = ModelConfig.from_dir(v4_mtp)
    n = cfg.num_hidden_layers
    assert cfg.mtp_layers == [n] and cfg.moe_index(n) == cfg.num_moe_layers
    assert cfg.attention_type(n) == "sliding_attention" and not cfg.is_hash_layer(n)
    names = set(CheckpointReader(v4_mtp).names())
    for own in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                "attn.wkv.weight", "ffn.gate.bias", "ffn.experts.15.w2.weight"):  # fmt: skip
        assert f"model.layers.{n}.{own}" in names
    assert not any(f"model.layers.{n}.attn.compressor" in x for x in names)
    # DeepSeek's release names the module `mtp.0.*`: read under the same names, the same drafts
    release = tmp_path / "release"
    shutil.copytree(v4_mtp, release)
    tensors = load_file(release / "model.safetensors")
    prefix = f"model.layers.{n}."
    save_file({("mtp.0." + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()},
              release / "model.safetensors")  # fmt: skip
    requests = [(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(_prompts(2, seed=8))]  # fmt: skip
    drafts = []
    for path in (v4_mtp, release):
        engine = _engine(path, 1)
        seen = []
        original = engine.spec.draft

        def draft(parts, *args, original=original, seen=seen):
            original(parts, *args)
            seen.append([list(c.seq.draft) for part in parts for c in part])

        engine.spec.draft = draft
        _run(engine, requests)
        drafts.append(seen)
    assert drafts[0] == drafts[1] and any(any(d) for d in drafts[0])


def test_the_mtp_forward_matches_deepseeks_block_on_transformers_layers(v4_mtp, tmp_path):
    """DeepSeek's MTPBlock: streams = e_proj(enorm(embed(token p + 1))) + h_proj(hnorm(h)) with h
    the main model's streams at p, then a full V4 block, its own hc_head and norm, the shared head.
    The oracle: transformers' V4 model with the module's block as a 6th layer, its hc_head and norm
    set from the module's, and a pre-hook that feeds that layer the streams above, built from the
    5th layer's output."""
    cfg = ModelConfig.from_dir(v4_mtp)
    n = cfg.num_hidden_layers
    hf = json.loads((v4_mtp / "config.json").read_text())
    path = tmp_path / "as-layer"
    path.mkdir()
    shutil.copy(v4_mtp / "config.json", path)
    (path / "config.json").write_text(json.dumps({
        **hf, "num_hidden_layers": n + 1, "num_nextn_predict_layers": 0,
        "layer_types": hf["layer_types"] + ["sliding_attention"], "mlp_layer_types": hf["mlp_layer_types"] + ["moe"],
    }))  # fmt: skip
    tensors = load_file(v4_mtp / "model.safetensors")
    p = f"model.layers.{n}."
    own = {k: tensors.pop(p + k) for k in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")}
    tensors["model.norm.weight"] = tensors.pop(p + "norm.weight")
    for k in ("fn", "base", "scale"):
        tensors[f"model.hc_head.hc_{k}"] = tensors.pop(f"{p}hc_head_{k}")
    save_file(tensors, path / "model.safetensors")
    oracle = load_hf(path)

    prompt, after = _prompts(1, seed=5, lo=40, hi=40)[0], 7
    T, eps = len(prompt), cfg.rms_norm_eps
    nxt = torch.tensor([prompt[1:] + [after]])

    def rms(x, w):
        return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))

    def feed(module, args, kwargs):
        h = args[0]  # [1, T, M, H]: the main model's streams
        e = rms(oracle.model.embed_tokens(nxt), own["enorm.weight"]) @ own["e_proj.weight"].t()
        return (e.unsqueeze(2) + rms(h, own["hnorm.weight"]) @ own["h_proj.weight"].t(), *args[1:]), kwargs

    oracle.model.layers[n].register_forward_pre_hook(feed, with_kwargs=True)
    with torch.no_grad():
        expected = oracle(torch.tensor([prompt])).logits[0].float()

    engine = _engine(v4_mtp, 1, deterministic=False)
    model, blocks = engine.model, engine.scheduler.allocator.allocate(1)
    engine.scheduler.allocator.hold_state(blocks)
    states = engine.scheduler.allocator.block_states
    batch = StepBatch.build([(prompt, 0, blocks, True)], "cpu", states, keep_hidden=True)
    run_interleaved([model.forward(batch, engine.cache.kv)], engine.experts)
    assert batch.hidden.shape == (T, cfg.hc_mult, cfg.hidden_size)
    rows = StepBatch.build([(nxt[0].tolist(), 0, blocks, True, range(T - 1))], "cpu", states)
    got = run_interleaved(
        [model.mtp_forward(model.mtp[0], rows, batch.hidden, engine.cache.kv)], engine.experts
    )[0]
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_are_those_without_speculation_across_windows(v4_mtp, k):
    """Prompts of 3 to 90 tokens staggered into a batch, 30 new tokens each (windows of 4 and 16
    completed by drafted positions), chunks of 24, too few blocks and state blocks (preemption),
    a shared prefix (hits); most drafts the true next tokens, a random head of them with k = 2,
    so steps accept some and reject the next. Under --deterministic the tokens and logprobs are
    plain decoding's; with the default kernels, how many answers differ is printed."""
    shared = _prompts(1, seed=9, lo=70, hi=70)[0]
    prompts = _prompts(4, seed=1) + [shared + p[1:] for p in _prompts(3, seed=2, lo=2, hi=20)]
    plain = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    kinds = [SamplingParams(**plain), SamplingParams(**plain, logprobs=2),
             SamplingParams(**plain, repetition_penalty=1.3, frequency_penalty=0.5)]  # fmt: skip
    requests = [(f"r{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    config = dict(
        max_num_seqs=6, max_num_batched_tokens=24, max_model_len=192, num_kv_blocks=4, num_state_blocks=10
    )
    reference = _run(_engine(v4_mtp, 0, **config), requests, stagger=2)
    engine = _engine(v4_mtp, k, **config)
    _oracle_drafts(engine, reference, 0.7)
    assert _run(engine, requests, stagger=2) == reference
    stats = engine.stats()
    spec = stats["spec_decode"]
    assert spec["num_drafts"] / 3 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert stats["prefix_cache"]["hit_tokens"] > 0 and (stats["preemptions"] > 0 or k > 1)  # (k = 2's fits)
    assert engine.scheduler.allocator.num_free_states == engine.cache.num_state_blocks
    default = _engine(v4_mtp, k, deterministic=False, **config)
    _oracle_drafts(default, reference, 0.7)
    got = _run(default, requests, stagger=2)
    print(f"default kernels, k={k}: {sum(got[r]['tokens'] != reference[r]['tokens'] for r in got)} of "
          f"{len(requests)} answers differ")  # fmt: skip


def test_an_fp8_checkpoints_module_keeps_greedy_tokens(tmp_path):
    """FP8 block-quantised (e_proj and h_proj too: DeepSeek's V4 release ships them FP8)."""
    model = init_model(tmp_path / "fp8", "tiny-v4", mtp=True, fp8=True, fp8_block=(16, 16), tokenizer=False)
    assert CheckpointReader(model).raw("model.layers.5.e_proj.weight").dtype == torch.float8_e4m3fn
    requests = [(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(_prompts(4, seed=4))]  # fmt: skip
    reference = _run(_engine(model, 0), requests)
    engine = _engine(model, 1)
    _oracle_drafts(engine, reference, 0.5)
    assert _run(engine, requests) == reference
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
