"""`moe-cluster up --weight-dtype bfloat16`: the attention worker's linears and the expert workers'
experts are held in bf16 and computed in fp32; over the API the cluster gives the bf16-weight
LocalEngine's tokens and logprobs, and the expert workers hold half the bytes. `--keep-fp8-experts`:
the expert workers hold an FP8 checkpoint's experts as shipped."""

import openai
import pytest
import ray

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.experts.client import ExpertClient
from services.model.config import ModelConfig
from services.presets import init_model

from .clusters import tiny_cluster

pytestmark = pytest.mark.cluster

PROMPTS = [[0, 5, 9, 11], [0, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def _logprobs(completion) -> list[float]:
    return [lp.token_logprob for lp in completion.logprobs]


def test_cluster_serves_bf16_weights(tmp_path):
    path = init_model(tmp_path, "tiny", seed=4)
    want = LocalEngine(EngineConfig(model=str(path), weight_dtype="bfloat16")).generate(PROMPTS, PARAMS)
    fp32 = LocalEngine(EngineConfig(model=str(path))).generate(PROMPTS, PARAMS)
    # the rounding shows in the logprobs, so the comparison below can tell bf16 from fp32
    assert (
        max(
            abs(a - b)
            for w, f in zip(want, fp32, strict=True)
            for a, b in zip(_logprobs(w), _logprobs(f), strict=True)
        )
        > 1e-5
    )

    with tiny_cluster(path, expert_workers=2, balancer_period_s=0, weight_dtype="bfloat16") as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, expected in zip(PROMPTS, want, strict=True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            choice = r.choices[0]
            assert choice.text == expected.text
            for got, exp in zip(choice.logprobs.token_logprobs, _logprobs(expected), strict=True):
                assert abs(got - exp) < 1e-5
        status = ray.get(cluster.balancer.status.remote())
        secret = ray.get(
            cluster.balancer.data_plane_secret.remote()
        )  # (the cluster's own: its calls are served)
        held = sum(ExpertClient(w["address"], secret=secret).stats().weight_bytes for w in status["workers"])
    cfg = ModelConfig.from_dir(path)
    experts_bytes = (
        cfg.num_moe_layers * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    )
    assert held == 2 * experts_bytes  # bf16: 2 bytes per weight, every expert once (no replicas)


def test_cluster_keeps_fp8_experts_fp8(tmp_path):
    """`moe-cluster up --keep-fp8-experts` on an FP8 checkpoint: the expert workers hold the
    experts as shipped (1 byte per weight, plus the block scales) and the API gives the tokens
    and logprobs of LocalEngine, which dequantizes them."""
    path = init_model(tmp_path, "tiny", seed=4, fp8=True, fp8_block=(16, 16))
    want = LocalEngine(EngineConfig(model=str(path))).generate(PROMPTS, PARAMS)
    with tiny_cluster(path, expert_workers=2, balancer_period_s=0, keep_fp8_experts=True) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, expected in zip(PROMPTS, want, strict=True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            assert r.choices[0].text == expected.text
            for got, exp in zip(r.choices[0].logprobs.token_logprobs, _logprobs(expected), strict=True):
                assert abs(got - exp) < 1e-5
        status = ray.get(cluster.balancer.status.remote())
        secret = ray.get(
            cluster.balancer.data_plane_secret.remote()
        )  # (the cluster's own: its calls are served)
        held = sum(ExpertClient(w["address"], secret=secret).stats().weight_bytes for w in status["workers"])
    cfg = ModelConfig.from_dir(path)
    weights = cfg.num_moe_layers * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    scales = weights // (16 * 16) * 4  # one fp32 scale per 16 x 16 block
    assert held == weights + scales  # FP8: 1 byte per weight, every expert once
