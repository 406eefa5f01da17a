"""A checkpoint without a tokenizer serves in token-id mode (like vLLM's skip_tokenizer_init)."""

import openai
import pytest

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.presets import init_model

from .clusters import tiny_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("no-tokenizer"), "tiny", seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def client(model_dir):
    with tiny_cluster(model_dir, expert_workers=1, balancer_period_s=0) as c:
        yield openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_token_ids_in_token_ids_out(client, model_dir):
    expect = LocalEngine(EngineConfig(model=str(model_dir))).generate(
        [[0, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )[0]
    r = client.completions.create(model="tiny", prompt=[0, 8, 9], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].token_ids == expect.token_ids and r.choices[0].text == ""


def test_text_prompts_and_chat_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="token-id mode"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
