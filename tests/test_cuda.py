"""The same engine on a CUDA device (skipped without one; CI has none)."""

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .hf_oracle import generate_with_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cuda_engine_matches_cpu(tiny_model, micro_batches):
    prompts = [[0, 5, 6, 7], list(range(3, 90)), [0] + [9] * 40]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cpu, cpu_logits = generate_with_logits(LocalEngine(EngineConfig(model=str(tiny_model))), prompts, params)
    gpu_engine = LocalEngine(EngineConfig(model=str(tiny_model), device="cuda", micro_batches=micro_batches))
    gpu, gpu_logits = generate_with_logits(gpu_engine, prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for a, b in zip(gpu_logits, cpu_logits, strict=True):
        assert (a.cpu() - b).abs().max() <= 1e-3  # TF32-free fp32 on GPU, different reduction order


def test_cuda_bf16_grouped_mm_path(tiny_model, monkeypatch):
    """kernels="torch": the routed experts go through torch's grouped_mm (bf16 on CUDA). Its sorting
    synchronises, so the decode graphs are refused in the checked warm-up, before any capture:
    the engine runs eagerly, on the default stream, with the tokens of an engine built eager."""
    from torch.nn import functional as F

    calls, grouped_mm = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    prompts = [[0, 5, 6, 7], list(range(3, 90))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        engine = LocalEngine(EngineConfig(model=str(tiny_model), device="cuda", dtype="bfloat16",
                                          max_num_seqs=8, cuda_graphs=graphs, kernels="torch"))  # fmt: skip
        assert engine.graphs is None and engine.kernels.names()["expert_ffn"] == "torch"
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.cuda.get_sync_debug_mode() == 0
        calls.clear()
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert calls  # (the generation's own)
    assert outs[True] == outs[False] and len(outs[True][0]) == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(tiny_model, dtype):
    """Decode steps replayed from CUDA graphs (decode_graphs.py; Triton kernels inside) give the
    eager engine's tokens; the capture must succeed (no synchronising op in the decode step)."""
    prompts = [[0, 5, 6, 7], list(range(3, 90)), [0] + [9] * 40]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = dict(model=str(tiny_model), device="cuda", dtype=dtype, max_num_seqs=8)
    eager = LocalEngine(EngineConfig(**cfg, cuda_graphs=False))
    graphed = LocalEngine(EngineConfig(**cfg))
    assert graphed.graphs is not None and graphed.graphs.capture
    ref, ref_logits = generate_with_logits(eager, prompts, params)
    out, logits = generate_with_logits(graphed, prompts, params)
    if dtype == "float32":
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max() <= (1e-3 if dtype == "float32" else 5e-2)


def test_cuda_fp8_experts_kept_fp8_in_graphs(tmp_path):
    """keep_fp8_experts on CUDA: the fused MoE reads the FP8 experts and scales as held (half of
    bf16's memory), inside captured decode graphs too; the CPU engine's tokens (fp32, no TF32)."""
    from services.presets import init_model

    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    prompts = [[0, 5, 6, 7], list(range(3, 90))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu, cpu_logits = generate_with_logits(LocalEngine(EngineConfig(model=str(path))), prompts, params)
    gpu = LocalEngine(EngineConfig(model=str(path), device="cuda", keep_fp8_experts=True, max_num_seqs=8))
    assert gpu.experts.packed.w13[1].dtype == torch.float8_e4m3fn and gpu.experts.packed.w13[1].is_cuda
    assert gpu.graphs is not None and gpu.graphs.capture
    out, logits = generate_with_logits(gpu, prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in cpu]
    for a, b in zip(logits, cpu_logits, strict=True):
        assert (a.cpu() - b).abs().max() <= 1e-3


def test_cuda_flashmla_matches_triton_in_graphs(tmp_path):
    """FlashMLA (installed from source on a Hopper GPU) as the decode attention: inside captured
    decode graphs, the greedy tokens of the Triton MLA kernel (a checkpoint with V3's latent widths,
    512 + 64: FlashMLA's only dense layout)."""
    pytest.importorskip("flash_mla")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashMLA's dense decode runs on SM90 only")
    from services.model.kernels import flashmla
    from services.presets import init_model

    path = init_model(
        tmp_path / "v3-latent", "tiny", seed=0, overrides={"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    )
    prompts = [[0, 5, 6, 7], list(range(3, 90)), [0] + [9] * 40]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs, ran = {}, {}
    for flag, kernels in (("0", "triton,torch"), ("1", "auto")):
        with pytest.MonkeyPatch.context() as mp:
            kernel, calls = flashmla.mla_decode, []
            mp.setattr(
                flashmla, "mla_decode", lambda *a, _k=kernel, _c=calls, **kw: _c.append(1) or _k(*a, **kw)
            )
            engine = LocalEngine(
                EngineConfig(
                    model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8, kernels=kernels
                )
            )
            outs[flag] = [o.token_ids for o in engine.generate(prompts, params)]
            # (no fall back: still FlashMLA after the run)
            ran[flag] = bool(calls) and engine.kernels.names()["mla_decode"] == "flashmla"
    assert ran == {"0": False, "1": True}  # FlashMLA took the decode attention by default only
    assert outs["1"] == outs["0"]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cuda_segmented_graphs_with_remote_experts_match_eager(tiny_model, micro_batches):
    """An attention engine on the GPU whose experts answer over gRPC (two expert servers in this
    process, on CPU): decode steps replayed from the captured pieces between expert messages
    (decode_graphs.SegmentedDecodeGraphs) give the eager engine's tokens; the capture must succeed."""
    from services.dataplane.remote_experts import RemoteExperts
    from services.engine.engine import Engine
    from services.model.checkpoint import CheckpointReader
    from services.model.model import DeepseekV3

    from .clusters import expert_servers_in_process

    prompts = [[0, 5, 6, 7], list(range(3, 90)), [0] + [9] * 40]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    with expert_servers_in_process(tiny_model) as (placement, cfg):
        model = DeepseekV3.load(CheckpointReader.for_config(tiny_model, cfg), cfg, torch.float32).to("cuda")
        for graphs in (False, True):
            experts = RemoteExperts(cfg, placement)
            ecfg = EngineConfig(model=str(tiny_model), device="cuda", max_num_seqs=8, micro_batches=micro_batches,
                                cuda_graphs=graphs)  # fmt: skip
            engine = Engine(cfg, model, experts, ecfg)
            assert bool(engine.segment_graphs) == graphs  # (captured at construction)
            outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
            experts.close()
    assert outs[True] == outs[False]
