"""Attention tensor parallelism x data parallelism in the cluster, over the API: 2 attention
workers of 2 tensor-parallel ranks each (real processes, gloo), 2 expert workers."""

import httpx
import openai
import pytest
import ray

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .clusters import tiny_cluster
from .faults import scenario

pytestmark = pytest.mark.cluster

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with tiny_cluster(tiny_model, attention_workers=2, attention_tp=2, expert_workers=2, balancer_period_s=0,
                      max_num_batched_tokens=64) as c:  # fmt: skip
        yield c


def _prompts():
    return [scenario.prompts(1, length=n)[0] for n in (5, 150, 40, 90)]  # 150, 90: chunked prefill


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))  # whole prefill, one process
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(_prompts(), params)]


def _complete(cluster, prompt):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    return reply.choices[0].model_extra["token_ids"]


def test_tp2_x_dp2_equals_one_process(cluster, expected):
    got = [_complete(cluster, p) for p in _prompts() * 2]  # both attention workers get some
    assert got == expected * 2
    stats = [ray.get(a.stats.remote()) for a in cluster.attention.values()]
    for s in stats:
        ranks = s["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
        assert ranks[0]["kv_cache_bytes"] == ranks[1]["kv_cache_bytes"] > 0  # each rank: the whole cache
    assert all(s["times"]["steps"] > 0 for s in stats)  # data parallel: both served


def test_requests_sharing_a_prefix_go_to_the_worker_holding_it(cluster):
    """Prefix affinity: the router sends requests with a common prefix to one attention worker,
    where they hit its prefix cache (the other worker sees none of them)."""

    def hits():
        return {
            n: ray.get(a.stats.remote())["prefix_cache"]["hit_tokens"] for n, a in cluster.attention.items()
        }

    shared = [0] + list(range(4, 204))  # 3 full cacheable blocks
    before = hits()
    for i in range(4):
        _complete(cluster, shared + [300 + i])
    gained = sorted(hits()[n] - before[n] for n in before)
    assert gained == [0, 3 * 192]


def test_a_dead_rank_restarts_its_group_and_requests_move_on(cluster, expected, tiny_model):
    """SIGKILL of a follower rank: its attention worker goes down as a group and restarts; the
    router moves the requests; every one completes with the same tokens."""
    worker = cluster.attention["moe-attn-0"]
    follower_pid = ray.get(worker.stats.remote())["ranks"][1]["pid"]
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    want = [
        o.token_ids
        for o in LocalEngine(EngineConfig(model=str(tiny_model))).generate(scenario.prompts(8), params)
    ]
    outcome = scenario.run(
        cluster.url, "tp rank", scenario.kill(lambda: follower_pid), requests=8, max_tokens=96
    )
    assert outcome.errors == [None] * 8 and outcome.tokens == want
    scenario.wait_healed(cluster.cfg.namespace, expert_workers=2)
    ranks = ray.get(worker.stats.remote(), timeout=120)["ranks"]
    assert len(ranks) == 2 and follower_pid not in {r["pid"] for r in ranks}  # a new group
    assert httpx.get(f"{cluster.url}/ready").status_code == 200
