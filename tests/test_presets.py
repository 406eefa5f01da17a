"""`moe-cluster init-model` checkpoints: loadable by transformers, equal outputs, tokenizer."""

import json

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Detokenizer, Tokenizer
from services.model.config import ModelConfig
from services.presets import init_model

from .hf_oracle import generate_with_logits, hf_greedy, load_hf


def test_tiny_preset_matches_transformers(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    hf = load_hf(tiny_model)
    prompts = [[0, 17, 99, 250], list(range(3, 80))]
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    outs, logits = generate_with_logits(
        engine, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    for prompt, out, ours in zip(prompts, outs, logits, strict=True):
        tokens, ref = hf_greedy(hf, prompt, 16)
        assert out.token_ids == tokens
        assert (ours - ref).abs().max() <= 1e-4


@pytest.mark.slow
def test_small_preset_shape_and_transformers_loading(tmp_path):
    path = init_model(tmp_path / "small", "small")
    cfg = ModelConfig.from_dir(path)
    assert cfg.num_moe_layers >= 8 and cfg.n_routed_experts == 64 and cfg.num_experts_per_tok in (6, 8)
    assert cfg.n_group > 1
    hf = load_hf(path)
    n_params = sum(p.numel() for p in hf.parameters())
    assert 50e6 <= n_params <= 100e6, n_params
    with torch.no_grad():
        logits = hf(torch.tensor([[0, 5, 6]])).logits
    assert torch.isfinite(logits).all()


def test_byte_level_tokenizer_round_trips(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    text = "Hello, wörld! 你好 🙂\n\tend"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text
    assert all(i < 384 for i in ids)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<｜Assistant｜>") and "hi" in chat


def test_detokenizer_streams_whole_characters_and_holds_back_stop_prefixes(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode("ab 你好 cd STOP ef", add_bos=False)
    detok = Detokenizer(tok, ["STOP"])
    pieces, stopped = [], False
    for n in range(1, len(ids) + 1):
        piece, stopped = detok.step(ids[:n], final=n == len(ids))
        assert "\ufffd" not in piece
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == "ab 你好 cd "


@pytest.mark.parametrize("seam", range(1, 12))
def test_a_resumed_detokenizer_continues_the_text_across_the_seam(tiny_model, seam):
    """A request moved to another worker mid-stream (router failover): the new detokenizer starts
    from the tokens and characters already sent; a character or stop string across the seam
    comes out whole, exactly once."""
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode("ab 你好 cSTOP ef", add_bos=False)

    def stream(detok, earlier, rest):
        pieces = []
        for n in range(1, len(rest) + 1):
            piece, stopped = detok.step(rest[:n], final=earlier + n == len(ids))
            pieces.append(piece)
            if stopped:
                return "".join(pieces), True
        return "".join(pieces), False

    first, stopped = stream(Detokenizer(tok, ["STOP"]), 0, ids[:seam])
    if not stopped:
        second, stopped = stream(Detokenizer(tok, ["STOP"], ids[:seam], len(first)), seam, ids[seam:])
        first += second
    assert stopped and first == "ab 你好 c" and "\ufffd" not in first


def test_token_id_mode_without_tokenizer(tmp_path):
    path = init_model(tmp_path / "noid", "tiny", tokenizer=False)
    engine = LocalEngine(EngineConfig(model=str(path)))
    assert engine.tokenizer is None
    out = engine.generate([[0, 5, 6]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""


def test_medium_preset_is_v2_lite_sized_and_draws_in_bf16(tmp_path):
    """The GPU benchmarks' preset: DeepSeek-V2-Lite's shape (~16B parameters, no q_lora), never
    generated here in full; the same config cut to 3 layers and 8 experts writes bf16 weights
    that load and run."""
    from services.presets import PRESETS

    hf = PRESETS["medium"]
    cfg = ModelConfig.from_hf({**hf, "torch_dtype": "bfloat16"})
    H, I, E, L = (
        hf["hidden_size"],
        hf["moe_intermediate_size"],
        hf["n_routed_experts"],
        hf["num_hidden_layers"],
    )
    routed = 3 * H * I * E * (L - hf["first_k_dense_replace"])
    assert cfg.q_lora_rank is None and cfg.kv_lora_rank == 512 and 14e9 < routed < 15e9
    small = {"num_hidden_layers": 3, "n_routed_experts": 8, "vocab_size": 512, "intermediate_size": 256}
    path = init_model(tmp_path / "medium-cut", "medium", overrides=small, dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    engine = LocalEngine(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=64))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_the_detokenizer_decodes_each_token_a_bounded_number_of_times(tiny_model):
    """A long output streams in linear time (#52: it used to decode the whole output at every
    step): the tokens decoded over the stream stay within a constant factor of its length, and the
    text is the whole decode's."""
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode("ab 你好 cd ef " * 200, add_bos=False)
    decoded = 0
    whole = tok.decode

    def counting(chunk, *args, **kwargs):
        nonlocal decoded
        decoded += len(chunk)
        return whole(chunk, *args, **kwargs)

    tok.decode = counting
    detok, pieces = Detokenizer(tok, ["STOP"]), []
    for n in range(1, len(ids) + 1):
        pieces.append(detok.step(ids[:n], final=n == len(ids))[0])
    assert "".join(pieces) == whole(ids)
    assert decoded <= 20 * len(ids), (decoded, len(ids))  # (quadratic: ~len(ids)**2 / 2)
