"""FlashMLA as the decode attention backend (services/model/kernels/flashmla.py).

FlashMLA builds only on a Hopper GPU with CUDA, so on CPU these tests put a torch stand-in for
the `flash_mla` package in sys.modules. The stand-in checks every constraint FlashMLA's dense
decode documents and TORCH_CHECKs (../shared/reference/deepseek-v3.md, section 3.2: q [b, s_q, h,
576], cache [blocks, 64, 1, 576] with a contiguous last dim, int32 tables and lengths, head_dim_v
512) and computes its documented result (V = the first 512 channels of each row), so what is
tested here is our side of the contract: the layout, dtypes and scale we pass, the schedule made
once per step, and the cases left to the other kernels. The real kernel is compared with the
Triton one by `benchmarks/bench_kernels.py` on a GPU host.
"""

import logging
import sys
import types

import pytest
import torch

from services.model.batch import DecodeRows
from services.model.config import ModelConfig
from services.model.kernels.select import select_kernels
from services.model.kv_cache import BLOCK_SIZE
from services.presets import PRESETS

SCALE = 0.1352338  # DeepSeek-V3's softmax scale (FlashMLA's own default would be 1/sqrt(576))


def stand_in(calls: dict) -> types.ModuleType:
    """A `flash_mla` module with the Feb 2025 API's calls, in torch (see the module docstring)."""

    def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.dim() == 1
        assert num_heads_k == 1
        calls["metadata"] = calls.get("metadata", 0) + 1
        num_sm_parts = 4
        return (
            torch.zeros(num_sm_parts, 8, dtype=torch.int32),
            torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32),
        )

    def flash_mla_with_kvcache(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
        softmax_scale=None, causal=False,
    ):  # fmt: skip
        b, s_q, h, d = q.shape
        assert (s_q, d, head_dim_v) == (1, 576, 512) and q.dtype in (torch.bfloat16, torch.float16)
        assert k_cache.dtype == q.dtype and tuple(k_cache.shape[1:]) == (64, 1, 576)
        assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
        assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        assert block_table.shape[0] == b and cache_seqlens.shape == (b,)
        assert tile_scheduler_metadata.dtype == torch.int32 and num_splits.shape == (b + 1,)
        assert softmax_scale is not None  # (FlashMLA would default to 1/sqrt(576))
        calls["kernel"] = calls.get("kernel", 0) + 1
        out = torch.empty(b, 1, h, head_dim_v, dtype=q.dtype)
        lse = torch.empty(b, h, 1, dtype=torch.float32)
        for i in range(b):
            n = int(cache_seqlens[i])
            rows = k_cache[block_table[i].long()].view(-1, d)[:n].float()  # [n, 576]
            scores = q[i, 0].float() @ rows.T * softmax_scale  # [h, n]
            out[i, 0] = (scores.softmax(-1) @ rows[:, :head_dim_v]).to(q.dtype)
            lse[i, :, 0] = scores.logsumexp(-1)
        return out, lse

    module = types.ModuleType("flash_mla")
    module.get_mla_metadata = get_mla_metadata
    module.flash_mla_with_kvcache = flash_mla_with_kvcache
    return module


@pytest.fixture
def flashmla(monkeypatch):
    """The stand-in installed as `flash_mla`; yields its call counts."""
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "flash_mla", stand_in(calls))
    return calls


def on_flashmla(dtype, preset: str = "tiny", fp8_cache: bool = False, **overrides):
    """Kernels with FlashMLA asked for (on CPU tensors: the stand-in), torch otherwise, for a
    `preset` model with V3's latent widths (512 + 64) and `overrides`."""
    cfg = ModelConfig.from_hf({**PRESETS[preset], "kv_lora_rank": 512, "qk_rope_head_dim": 64, **overrides})
    return select_kernels("cpu", dtype, cfg, allow="flashmla,torch", fp8_cache=fp8_cache)


def decode_rows(lens: list[int], width: int, dtype, seed: int = 0):
    """(cache [blocks, 64, 1, width] of random rows, DecodeRows over shuffled blocks)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in lens]
    cache = torch.randn(sum(need) + 2, BLOCK_SIZE, 1, width, generator=g).to(dtype)
    order = torch.randperm(cache.shape[0], generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n]
        used += n
    rows = torch.arange(len(lens))
    return cache, DecodeRows(rows, rows, table, torch.tensor(lens))


def reference(q, cache, dec, C):
    """Decode attention as model.mla_forward's torch path computes it (gather, mask, softmax)."""
    ctx = cache[dec.table].view(q.shape[0], -1, cache.shape[-1]).float()
    scores = torch.bmm(q.float(), ctx[..., : q.shape[-1]].transpose(1, 2)) * SCALE
    pad = torch.arange(ctx.shape[1])[None, :] >= dec.lens[:, None]
    probs = scores.masked_fill(pad[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(probs, ctx[..., :C]).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashmla_gives_the_torch_paths_attention(flashmla, dtype):
    """V3's latent rows (512 + 64) in bf16 / fp16, contexts across block boundaries, 16 heads: the
    same output as the torch path, with the schedule made once for the step's layers."""
    k = on_flashmla(dtype)
    assert k.names()["mla_decode"] == "flashmla"
    cache, dec = decode_rows([1, 64, 65, 200], 576, dtype)
    ref_calls = dict(flashmla)
    for layer in range(3):  # the step's layers share one schedule
        q = 4 * torch.randn(4, 16, 576, generator=torch.Generator().manual_seed(layer)).to(dtype)  # peaked
        o = k.mla_decode(q, cache, dec, 512, SCALE)
        assert o.shape == (4, 16, 512) and o.dtype == dtype
        torch.testing.assert_close(o.float(), reference(q, cache, dec, 512).float(), rtol=1e-2, atol=1e-2)
    assert flashmla == {**ref_calls, "metadata": 1, "kernel": 3}

    _, next_step = decode_rows([66, 3, 9, 130], 576, dtype, seed=1)  # a new step: a new schedule
    k.mla_decode(q, cache, next_step, 512, SCALE)
    assert flashmla["metadata"] == 2


@pytest.mark.parametrize(
    "dtype, overrides, fp8_cache, why",
    [
        (torch.float32, {}, False, "bf16 / fp16 only"),  # FlashMLA's dense decode is bf16 / fp16 only
        (torch.bfloat16, {"kv_lora_rank": 64, "qk_rope_head_dim": 16}, False, "512 + 64 latent rows only"),
        (torch.bfloat16, {}, True, "torch.uint8 cache"),  # FP8 rows: FlashMLA's dense kernel reads bf16 rows
    ],
)
def test_flashmla_is_not_chosen_for_other_layouts(flashmla, dtype, overrides, fp8_cache, why):
    """A model FlashMLA's dense decode cannot take is refused when the kernels are selected, with
    the reason; the next kernel (here torch) runs its decode attention."""
    k = on_flashmla(dtype, fp8_cache=fp8_cache, **overrides)
    assert k.names()["mla_decode"] == "torch" and why in k.reasons()["mla_decode"]["flashmla"]
    if fp8_cache:
        return
    C, R = k.target.cfg.kv_lora_rank, k.target.cfg.qk_rope_head_dim
    cache, dec = decode_rows([70, 5], C + R, dtype)
    q = torch.randn(2, 8, C + R, generator=torch.Generator().manual_seed(1)).to(dtype)
    o = k.mla_decode(q, cache, dec, C, SCALE)
    assert "kernel" not in flashmla and "metadata" not in flashmla
    torch.testing.assert_close(o.float(), reference(q, cache, dec, C).float(), rtol=2e-2, atol=2e-2)


def test_v32_decodes_over_its_top_k_rows_without_flashmla(flashmla):
    """V3.2's rows carry indexer keys after the latent and its decode attends to gathered top-k
    rows: no dense decode to run, FlashMLA is not among its kernels."""
    k = on_flashmla(torch.bfloat16, "tiny-v32", index_head_dim=128)
    assert "mla_decode" not in k.names() and k.names()["mla_sparse_decode"] == "torch"
    assert "flashmla" not in k.reasons()["mla_sparse_decode"]


def test_a_failing_flashmla_is_logged_once_and_left(flashmla, caplog):
    """A FlashMLA that fails here (another build's API, an unsupported GPU) is logged once; the
    next kernel takes its work from then on."""
    import flash_mla

    def broken(*args, **kwargs):
        flashmla["kernel"] = flashmla.get("kernel", 0) + 1
        raise RuntimeError("unsupported GPU architecture")

    flash_mla.flash_mla_with_kvcache = broken
    k = on_flashmla(torch.bfloat16)
    cache, dec = decode_rows([70, 5], 576, torch.bfloat16)
    q = torch.randn(2, 8, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            o = k.mla_decode(q, cache, dec, 512, SCALE)
            torch.testing.assert_close(o.float(), reference(q, cache, dec, 512).float(), rtol=2e-2, atol=2e-2)
    assert flashmla["kernel"] == 1
    assert [r.message for r in caplog.records if "the flashmla kernel of mla_decode failed" in r.message]
    assert k.names()["mla_decode"] == "torch" and "unsupported GPU" in k.reasons()["mla_decode"]["flashmla"]


def test_engine_on_flashmla_keeps_greedy_outputs(tmp_path, flashmla, monkeypatch):
    """A bf16 LocalEngine on a checkpoint with V3's latent widths (512 + 64): FlashMLA takes every
    decode step's attention and the greedy tokens are the torch path's."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.presets import init_model

    path = init_model(
        tmp_path / "v3-latent", "tiny", seed=0, overrides={"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    )
    prompts = [[0, 5, 6, 7], list(range(3, 70))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for flag, kernels in (("0", "torch"), ("1", "flashmla,torch")):
        engine = LocalEngine(EngineConfig(model=str(path), dtype="bfloat16", max_num_seqs=4, kernels=kernels))
        assert engine.stats()["kernels"]["mla_decode"] == ("flashmla" if flag == "1" else "torch")
        outs[flag] = [o.token_ids for o in engine.generate(prompts, params)]
        assert ("kernel" in flashmla) == (flag == "1")
    assert outs["1"] == outs["0"]
