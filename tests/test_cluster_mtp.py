"""Speculative decoding with the MTP module in the cluster (#54): the MTP layer's routed experts are
served by the expert workers like any other layer's (placed, loaded, counted, re-placed), the
attention worker's engine verifies 2 rows per sequence through each MoE layer's one round trip,
multi-token steps reach the OpenAI API, and greedy tokens are those of LocalEngine without
speculation (deterministic mode on both ends), over the API and across a worker killed mid-stream.

Random weights draft badly (acceptance ~0), so half the requests carry a logit bias: applied to the
drafts as to the target, it makes some drafts right and some wrong (acceptance ~0.3), so steps emit
one token or two and both verify paths run."""

import argparse
import asyncio
import random
import time

import openai
import pytest
import ray
import torch

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import RemoteExperts
from services.engine.engine import Engine, EngineConfig, LocalEngine, load_engine
from services.engine.sampling import SamplingParams
from services.experts.client import ExpertClient, load_placement
from services.experts.server import ExpertServer, ExpertWorkerConfig
from services.experts.store import InvalidRequest, SlotStore
from services.model.config import ModelConfig
from services.model.mtp import served_experts
from services.presets import init_model
from services.settings import BALANCER_NAME

from .clusters import tiny_cluster
from .faults import scenario

MAX_TOKENS, BIAS = 14, {56: 6.0}  # (the bias: about a third of the drafts accepted on this model)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny-mtp"), "tiny", seed=0, mtp=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(3, 60))] for _ in range(n)]


PROMPTS = _prompts(8)


def _params(i: int) -> dict:
    """Request i's sampling parameters: greedy, every other one with the logit bias."""
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} | (
        {"logit_bias": BIAS} if i % 2 else {}
    )


def _reference(model, prompts) -> list[list[int]]:
    """LocalEngine's greedy tokens without speculation (deterministic kernels)."""
    engine = LocalEngine(EngineConfig(model=str(model), deterministic=True))
    return [
        o.token_ids
        for o in engine.generate(prompts, [SamplingParams(**_params(i)) for i in range(len(prompts))])
    ]


def test_a_store_serves_the_mtp_layer_only_in_versions_that_name_it(mtp_model):
    cfg = ModelConfig.from_dir(mtp_model)
    served = served_experts(cfg, True)
    assert served.moe_layers == [*cfg.moe_layers, 3] and served.num_moe_layers == cfg.num_moe_layers + 1
    assert (
        served.moe_index(3) == cfg.moe_index(3) == cfg.num_moe_layers
    )  # (as the model's dispatches number it)
    assert served_experts(cfg, False) is cfg
    store = SlotStore(cfg, mtp_model, torch.float32)
    experts = list(range(cfg.n_routed_experts))
    store.load(1, {layer: experts for layer in cfg.moe_layers})  # (no speculation: as before)
    store.load(2, {layer: experts for layer in served.moe_layers})
    with pytest.raises(InvalidRequest, match="MoE layer"):
        store.load(3, {1: experts, 3: experts})
    x, slot = torch.randn(2, cfg.hidden_size), torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    weight = torch.ones(2, 2)
    with pytest.raises(InvalidRequest, match="not served by version 1"):
        store.forward(1, 3, x, slot, weight)
    assert store.forward(2, 3, x, slot, weight).shape == x.shape
    slots = store.stats().slots
    assert sorted(slots[1]) == cfg.moe_layers and sorted(slots[2]) == served.moe_layers
    assert sum(slots[2][3][1]) == 3  # (its pairs counted)


@pytest.fixture(scope="module", params=["tiny", "tiny-v4"])
def any_mtp_model(request, mtp_model, tmp_path_factory):
    """The tiny V3 preset's MTP model, and the tiny V4 preset with DeepSeek's MTPBlock."""
    if request.param == "tiny":
        return mtp_model
    return init_model(tmp_path_factory.mktemp("tiny-v4-mtp"), "tiny-v4", seed=0, mtp=True)


def test_remote_experts_serve_the_mtp_pass_and_greedy_tokens_stay(any_mtp_model):
    """An engine over real gRPC expert servers (in this process, no Ray), V3 and V4: its verify
    steps and MTP passes go through them; tokens are LocalEngine's without speculation; the step's
    load counts the MTP layer after the main ones; the servers computed the MTP layer's experts."""
    mtp_model = any_mtp_model
    want = _reference(mtp_model, PROMPTS)
    cfg = served_experts(ModelConfig.from_dir(mtp_model), True)
    servers = [ExpertServer(ExpertWorkerConfig(model=str(mtp_model), deterministic=True)) for _ in range(2)]
    try:
        workers = tuple(s.start() for s in servers)
        plain = Placement.round_robin(cfg.num_moe_layers - 1, cfg.n_routed_experts, workers, 8)
        with pytest.raises(ValueError, match=f"placement has {cfg.num_moe_layers - 1} MoE layers, model has"):
            RemoteExperts(cfg, plain)
        placement = Placement.round_robin(cfg.num_moe_layers, cfg.n_routed_experts, workers, 8)
        load_placement(placement, {w: w for w in workers}, cfg.moe_layers)
        engine_cfg = EngineConfig(
            model=str(mtp_model),
            deterministic=True,
            speculative_tokens=1,
            speculative_disable_by_batch_size=1 << 20,
        )  # (every step drafts)
        mcfg, model, experts, tokenizer = load_engine(
            engine_cfg, lambda m, r, d: RemoteExperts(cfg, placement)
        )
        engine = Engine(mcfg, model, experts, engine_cfg, tokenizer)
        ids = [engine.add_request(p, SamplingParams(**_params(i))) for i, p in enumerate(PROMPTS)]
        got, load = (
            {i: [] for i in ids},
            torch.zeros(cfg.num_moe_layers, cfg.n_routed_experts, dtype=torch.long),
        )
        rows_per_step = []
        while engine.has_unfinished():
            result = engine.step()
            load += result.expert_load
            rows_per_step.append(max((len(o.token_ids) for o in result.outputs), default=0))
            for o in result.outputs:
                got[o.request_id] += o.token_ids
        assert [got[i] for i in ids] == want
        spec = engine.stats()["spec_decode"]
        assert spec["num_drafts"] > 20 and 0 < spec["num_accepted_tokens"] < spec["num_drafts"]
        assert max(rows_per_step) == 2  # (steps that emitted a draft and its bonus)
        assert bool((load[-1] > 0).any()) and int(load[-1].sum()) > 0  # the MTP layer's routed choices
        # one round trip per (MoE layer, worker) and step, the MTP pass's layer included: a verify step's
        # 2 rows per sequence go in the same call
        assert 0 < experts.stats.rpcs <= len(rows_per_step) * cfg.num_moe_layers * len(workers)
        layers = {
            ls.layer: sum(ls.tokens)
            for w in workers
            for v in ExpertClient(w).stats().versions
            for ls in v.layers
        }
        assert set(layers) == set(cfg.moe_layers) and layers[cfg.mtp_layers[0]] > 0
    finally:
        for s in servers:
            s.stop(0)


# ---- a real cluster -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(mtp_model):
    """(Every step drafts: the gate's choice is not what these tests are about.)"""
    with tiny_cluster(mtp_model, attention_workers=2, expert_workers=2, balancer_period_s=0, max_num_seqs=32,
                      deterministic=True, speculative_tokens=1, speculative_disable_by_batch_size=1 << 20) as c:  # fmt: skip
        yield c


def _over_the_api(url: str, prompts, stream: bool, concurrent: bool) -> list[list[int]]:
    async def one(client, i, prompt):
        p = _params(i)
        extra = {"ignore_eos": True, "return_token_ids": True} | (
            {"logit_bias": p["logit_bias"]} if i % 2 else {}
        )
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=stream, extra_body=extra)  # fmt: skip
        if not stream:
            return list(r.choices[0].model_extra["token_ids"])
        tokens = []
        async for chunk in r:
            tokens += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        return tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            if concurrent:
                return await asyncio.gather(*[one(client, i, p) for i, p in enumerate(prompts)])
            return [await one(client, i, p) for i, p in enumerate(prompts)]
        finally:
            await client.close()

    return asyncio.run(main())


def _spec_stats(cluster) -> list[dict]:
    return [s["spec_decode"] for s in ray.get([a.stats.remote() for a in cluster.attention.values()])]


@pytest.mark.cluster
def test_greedy_tokens_over_the_api_are_local_engines_without_speculation(cluster, mtp_model, capsys):
    want = _reference(mtp_model, PROMPTS)
    assert _over_the_api(cluster.url, PROMPTS, stream=False, concurrent=True) == want
    assert _over_the_api(cluster.url, PROMPTS, stream=True, concurrent=True) == want
    assert _over_the_api(cluster.url, PROMPTS[:3], stream=True, concurrent=False) == want[:3]
    spec = [s for s in _spec_stats(cluster) if s["num_drafts"]]
    assert spec and sum(s["num_accepted_tokens"] for s in spec) > 0  # (steps of two tokens streamed)
    assert all(s["num_accepted_tokens"] == sum(s["num_accepted_tokens_per_pos"]) for s in spec)
    from services.cli import cmd_status

    assert cmd_status(argparse.Namespace(address=None, namespace=cluster.cfg.namespace, json=False)) == 0
    out = capsys.readouterr().out
    assert "speculative decoding:" in out
    with capsys.disabled():
        print("\n" + "\n".join(line for line in out.splitlines() if "speculative decoding:" in line))


@pytest.mark.cluster
def test_the_pool_places_counts_and_re_places_the_mtp_layer(cluster, mtp_model):
    cfg = ModelConfig.from_dir(mtp_model)
    balancer = ray.get_actor(BALANCER_NAME, namespace=cluster.cfg.namespace)
    status = ray.get(balancer.status.remote())
    assert len(status["phy2log"]) == cfg.num_moe_layers + 1
    held = ray.get(balancer.worker_stats.remote())
    layers = {layer for versions in held.values() for slots in versions.values() for layer in slots}
    assert layers == {*cfg.moe_layers, 3}  # every expert worker holds MTP-layer experts
    _over_the_api(cluster.url, PROMPTS, stream=False, concurrent=True)
    time.sleep(2.5)  # (the attention workers' load reporters flush every second)
    moved = ray.get(balancer.rebalance.remote(force=True), timeout=300)  # EPLB over the loads Redis has
    loads = ray.get(balancer.status.remote())["loads"]
    assert len(loads) == cfg.num_moe_layers + 1 and sum(loads[-1]) > 0, (
        loads
    )  # the MTP pass's choices counted
    assert moved.get("migrated"), moved
    assert _over_the_api(cluster.url, PROMPTS, stream=True, concurrent=True) == _reference(mtp_model, PROMPTS)


@pytest.mark.cluster
@pytest.mark.parametrize("victim", ["expert", "attention"])
def test_a_worker_killed_mid_stream_keeps_greedy_tokens(cluster, mtp_model, victim):
    ns = cluster.cfg.namespace
    prompts = scenario.prompts(8)
    engine = LocalEngine(EngineConfig(model=str(mtp_model), deterministic=True))
    want = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0,
                                                                          ignore_eos=True))]  # fmt: skip
    pid = (lambda: scenario.expert_worker_pid(ns, 1)) if victim == "expert" else (
        lambda: scenario.actor_pid("moe-attn-0", ns))  # fmt: skip
    outcome = scenario.run(
        cluster.url, victim, scenario.kill(pid), requests=8, max_tokens=40, kill_after_tokens=6
    )
    assert outcome.errors == [None] * 8 and outcome.tokens == want
    assert any(times and times[-1] > outcome.killed_at for times in outcome.arrivals)  # (mid-stream)
    scenario.wait_healed(ns, expert_workers=2)
    if victim == "attention":  # Ray restarted it, and it speculates again
        assert scenario.actor_pid("moe-attn-0", ns) != outcome.fault_result
