"""`--deterministic` on a real cluster (#53): with batch-invariant kernels on both ends and the
combine summed per expert in a fixed order at the attention worker, a greedy request's tokens
*and the float bits of its logprobs* are those of LocalEngine run on it alone, whatever the batch
it lands in, how the experts are split over the workers, and after a live re-placement.

Tokens alone could not fail on a random checkpoint (its top logits are rarely close enough for a
rounding to flip one); logprobs can: without the flag the same comparison differs (checked below
on LocalEngine, so the comparison is known to see what it looks for)."""

import asyncio

import openai
import pytest
import ray

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.settings import BALANCER_NAME

from .clusters import tiny_cluster
from .faults import scenario

pytestmark = pytest.mark.cluster

PROMPTS, MAX_TOKENS = scenario.prompts(8, length=20), 12


def _alone(model, deterministic: bool) -> list[tuple[list[int], list[float]]]:
    """Each prompt run by itself (a batch of one): its tokens and their logprobs."""
    engine = LocalEngine(EngineConfig(model=str(model), deterministic=deterministic))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return [
        (o.token_ids, [lp.token_logprob for lp in o.logprobs])
        for p in PROMPTS
        for o in engine.generate([p], params)
    ]


def _together(model, deterministic: bool) -> list[tuple[list[int], list[float]]]:
    engine = LocalEngine(EngineConfig(model=str(model), deterministic=deterministic))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return [(o.token_ids, [lp.token_logprob for lp in o.logprobs]) for o in engine.generate(PROMPTS, params)]


def _over_the_api(url: str, concurrent: bool) -> list[tuple[list[int], list[float]]]:
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        async def one(prompt):
            r = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            choice = r.choices[0]
            return choice.model_extra["token_ids"], choice.logprobs.token_logprobs

        if concurrent:
            out = await asyncio.gather(*[one(p) for p in PROMPTS])
        else:
            out = [await one(p) for p in PROMPTS]
        await client.close()
        return out

    return [(list(t), list(lp)) for t, lp in asyncio.run(main())]


def test_without_the_flag_the_batch_changes_the_logprobs(tiny_model):
    alone, together = _alone(tiny_model, False), _together(tiny_model, False)
    assert [lp for _, lp in alone] != [lp for _, lp in together]


def test_with_the_flag_the_cluster_gives_local_engines_bits_whatever_the_batch_and_placement(tiny_model):
    want = _alone(tiny_model, True)
    assert _together(tiny_model, True) == want  # (LocalEngine: batched = alone)
    with tiny_cluster(tiny_model, attention_workers=1, expert_workers=3, balancer_period_s=0,
                      max_num_seqs=32, deterministic=True) as cluster:  # fmt: skip
        assert _over_the_api(cluster.url, concurrent=True) == want
        balancer = ray.get_actor(BALANCER_NAME, namespace=cluster.cfg.namespace)
        moved = ray.get(balancer.scale_experts.remote(2), timeout=300)  # a live re-placement: 3 -> 2 workers
        assert moved.get("ok", moved.get("migrated")), moved
        assert _over_the_api(cluster.url, concurrent=False) == want
