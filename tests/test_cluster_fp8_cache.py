"""A cluster serving with the FP8 latent cache (`kv_cache_dtype: fp8`): greedy tokens over the API
equal LocalEngine's on the same cache format, and `moe-cluster status` shows the cache's rows
and its capacity in tokens."""

import openai
import pytest

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.presets import init_model

from .clusters import tiny_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # (FP8 rows scale c_kv in groups of 128: the tiny preset with a 128-wide latent)
    return init_model(tmp_path_factory.mktemp("fp8-cache"), "tiny", seed=3, overrides={"kv_lora_rank": 128})


def test_api_tokens_equal_local_engine_on_fp8_rows(model_dir, capsys):
    from services.cli import main as cli

    prompts = [[0, 5, 6, 7], [0] + list(range(10, 140))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    local = LocalEngine(EngineConfig(model=str(model_dir), kv_cache_dtype="fp8"))
    expected = [c.token_ids for c in local.generate(prompts, params)]
    with tiny_cluster(
        model_dir, expert_workers=1, balancer_period_s=0, kv_cache_dtype="fp8", kv_cache_gib=0.25
    ) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(prompts, expected, strict=True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
            assert r.choices[0].token_ids == want
        assert cli(["status", "--namespace", c.cfg.namespace]) == 0
        out = capsys.readouterr().out
        assert "tokens (fp8 rows)" in out, out
