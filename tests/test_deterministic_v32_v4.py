"""Deterministic mode (#53) on DeepSeek-V3.2 (the lightning indexer, sparse attention) and DeepSeek-V4
(hyper-connections, sliding window + compressed entries + the CSA indexer, attention sinks, grouped
output, sqrtsoftplus / hash gates): a request's greedy tokens and logits, bit for bit, do not depend
on the batch it lands in or on how its prompt is chunked; and without the flag they do (on this
CPU). tests/test_deterministic.py shows the same for V3 / V2 layers."""

import random

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.model.kernels import deterministic
from services.model.kernels.select import select_kernels
from services.presets import PRESETS, init_model

from .staggered import run_staggered

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PRESET_NAMES = ("tiny-v32", "tiny-v4")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {p: init_model(tmp_path_factory.mktemp(p), p, seed=0) for p in PRESET_NAMES}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Long enough for V3.2's top-16 and V4's CSA top-4 (past 20 tokens) and HCA (16) to select."""
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(3, 45))] for _ in range(n)]


def _run(engine: LocalEngine, prompts, stagger: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's (greedy tokens, logits [steps, vocab]), the prompts added together or
    (stagger) one every `stagger` steps."""
    return run_staggered(engine, prompts, GREEDY, stagger)


def _engine(
    model, det: bool, kernels: str = "auto", dtype: str = "float32", tokens: int = 2048
) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(model), deterministic=det, kernels=kernels, dtype=dtype,
                                    max_num_seqs=min(tokens, 64), max_num_batched_tokens=tokens,
                                    max_model_len=512))  # fmt: skip


def _differing(runs_a, runs_b) -> tuple[int, int]:
    """(answers whose tokens differ, logits rows not bit-identical)."""
    answers = sum(ta != tb for (ta, _), (tb, _) in zip(runs_a, runs_b, strict=True))
    rows = sum(int((la != lb).any(dim=1).sum()) for (_, la), (_, lb) in zip(runs_a, runs_b, strict=True))
    return answers, rows


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize(
    "kernels, dtype",
    [("auto", "float32"), ("torch", "float32"), ("auto", "bfloat16")],
    ids=["cpp", "torch", "bf16"],
)
def test_tokens_and_logits_do_not_depend_on_batch_or_chunking(models, preset, kernels, dtype):
    prompts = _prompts(8)
    engine = _engine(models[preset], True, kernels, dtype)
    assert engine.kernels.deterministic
    alone = [_run(engine, [p])[0] for p in prompts]
    together = _run(engine, prompts)  # one prefill step, then 8 decode rows a step
    staggered = _run(engine, prompts, stagger=2)  # prefills beside decodes
    chunked = _run(_engine(models[preset], True, kernels, dtype, tokens=16), prompts)  # 16-token chunks
    for name, other in (("together", together), ("staggered", staggered), ("chunked", chunked)):
        assert _differing(alone, other) == (0, 0), name


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_without_the_flag_logits_depend_on_the_batch(models, preset):
    """The flag matters on these models too: the default paths (MKL's linears, the padded decode
    attention, the tiled prefill, torch's sigmoid / softplus / SiLU tails, V4's batched GEMMs)
    give a row other bits beside other rows or in another chunking."""
    prompts = _prompts(8)
    engine = _engine(models[preset], False)
    alone = [_run(engine, [p])[0] for p in prompts]
    assert _differing(alone, _run(engine, prompts))[1] > 0
    assert _differing(alone, _run(_engine(models[preset], False, tokens=16), prompts))[1] > 0


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_per_choice_combine_gives_the_in_process_bits(models, preset):
    """Asking the experts for one row per (token, choice) and adding them here in expert order (what
    an attention worker's model does) gives LocalEngine's bits: a cluster's tokens are LocalEngine's."""
    prompts = _prompts(6, seed=3)
    local = _run(_engine(models[preset], True), prompts)
    per_choice = _engine(models[preset], True)
    assert per_choice.model.experts_sum_in_order
    per_choice.model.experts_sum_in_order = False
    assert _differing(local, _run(per_choice, prompts)) == (0, 0)


@pytest.mark.parametrize("allow", ["auto", "torch"])
def test_the_indexer_and_sparse_kernels_give_a_row_the_same_bits_in_any_batch(allow):
    cfg = ModelConfig.from_hf(PRESETS["tiny-v32"])
    k = select_kernels("cpu", torch.float32, cfg, allow=allow, deterministic=True)
    assert k.names()["mla_sparse_decode"] == ("cpp" if allow == "auto" else "torch")
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    Hi, Di, N, C, R = cfg.index_n_heads, cfg.index_head_dim, 4, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache = rand(20, 64, 1, C + R + Di)
    rows, count = torch.randint(0, 20 * 64, (40, 16), generator=g), torch.randint(1, 17, (40,), generator=g)
    keys, lens = rand(40, 150, Di), torch.randint(1, 151, (40,), generator=g)
    cases = {  # name: (f(x, m): the kernel on x's first m rows, x)
        "sparse_decode": (lambda x, m: k.sparse_decode(x[:m], cache, rows[:m], count[:m], C, 0.1), rand(40, N, C + R)),
        # (the keys padded to the longest visible context among the m queries, as a decode step does)
        "index_scores": (lambda x, m: k.index_scores(x[:m], wts[:m], keys[:m, : int(lens[:m].max())], lens[:m]),
                         rand(40, Hi, Di)),
    }  # fmt: skip
    wts = torch.rand(40, Hi, generator=g)
    for name, (f, x) in cases.items():
        alone = [f(x, m)[m - 1] for m in range(1, 41)]  # each row as the last of m rows
        for m in (2, 9, 17, 40):
            got = f(x, m)
            for i in range(m):
                n = got.shape[-1] if name == "sparse_decode" else int(lens[i])
                assert torch.equal(got[i, ..., :n], alone[i][..., :n]), (name, m, i)
    shared = rand(150, Di)  # (one context shared by a prefill's queries: the same scores)
    x = rand(40, Hi, Di)
    per_query = torch.stack([k.index_scores(x[i : i + 1], wts[i : i + 1], keys[i], lens[i : i + 1])[0]
                             for i in range(40)])  # fmt: skip
    assert per_query.shape == (40, 150)
    both = k.index_scores(x, wts, shared, lens)
    for i in range(40):
        alone = k.index_scores(x[i : i + 1], wts[i : i + 1], shared[: int(lens[i])], lens[i : i + 1])[0]
        assert torch.equal(both[i, : int(lens[i])], alone), i


def test_elementwise_helpers_do_not_depend_on_the_tensor_size():
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(0)) * 8
    alone = torch.cat([deterministic.softplus(x[i : i + 1]) for i in range(300)])
    assert torch.equal(deterministic.softplus(x), alone)
    torch.testing.assert_close(
        deterministic.softplus(x), torch.nn.functional.softplus(x), rtol=1e-6, atol=1e-7
    )
    y = torch.randn(37, 8, 16, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([deterministic.softmax(y[i : i + 1], 1) for i in range(37)])
    assert torch.equal(deterministic.softmax(y, 1), alone)
    torch.testing.assert_close(deterministic.softmax(y, 1), y.softmax(dim=1), rtol=1e-6, atol=1e-7)
    ties = torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0, float("-inf")]])
    assert deterministic.top_indices(ties, 4).tolist() == [[1, 4, 0, 2]]
    padded = torch.cat((ties, torch.full((1, 50), float("-inf"))), dim=1)
    assert deterministic.top_indices(padded, 4).tolist() == [[1, 4, 0, 2]]


def test_the_flag_is_taken_for_v32_and_v4():
    for preset in PRESET_NAMES:
        k = select_kernels("cpu", torch.float32, ModelConfig.from_hf(PRESETS[preset]), deterministic=True)
        assert k.deterministic and "(deterministic)" in k.summary()


@pytest.mark.cluster
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_cluster_gives_local_engines_bits_whatever_the_batch(models, preset):
    """Over the API of a cluster (1 attention worker, 2 expert workers) with the flag: each answer's
    tokens and logprob bits are LocalEngine's on the prompt alone, sent one at a time and all at
    once (tests/test_cluster_deterministic.py: the same on V3 layers, with a re-placement)."""
    import asyncio

    import openai

    from .clusters import tiny_cluster

    prompts, params = (
        _prompts(6, seed=5),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
    )
    engine = _engine(models[preset], True)
    want = [(o.token_ids, [lp.token_logprob for lp in o.logprobs]) for p in prompts
            for o in engine.generate([p], params)]  # fmt: skip

    async def ask(url: str, concurrent: bool) -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        async def one(prompt):
            r = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return list(r.choices[0].model_extra["token_ids"]), list(r.choices[0].logprobs.token_logprobs)

        out = await asyncio.gather(*map(one, prompts)) if concurrent else [await one(p) for p in prompts]
        await client.close()
        return list(out)

    with tiny_cluster(models[preset], attention_workers=1, expert_workers=2, balancer_period_s=0, max_num_seqs=8,
                      max_model_len=512, deterministic=True) as cluster:  # fmt: skip
        assert asyncio.run(ask(cluster.url, concurrent=True)) == want
        assert asyncio.run(ask(cluster.url, concurrent=False)) == want
