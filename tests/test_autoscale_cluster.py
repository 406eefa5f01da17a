"""The expert pool sizes itself on a real cluster: it grows under load, shrinks when idle, holds
still while pinned by `scale-experts N`, and no request is lost or changed meanwhile."""

import threading
import time

import openai
import pytest
import ray

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .clusters import tiny_cluster

pytestmark = pytest.mark.cluster
PROMPT = [0, 7, 8, 9]


def _workers(cluster) -> int:
    return len(ray.get(cluster.balancer.status.remote())["workers"])


def _wait(cluster, n: int, what: str, deadline_s: float = 150.0) -> None:
    deadline = time.monotonic() + deadline_s
    while _workers(cluster) != n:
        assert time.monotonic() < deadline, f"the pool did not {what} to {n} workers in {deadline_s}s"
        time.sleep(0.25)


def test_the_pool_grows_under_load_and_shrinks_when_idle(tiny_model):
    want = (
        LocalEngine(EngineConfig(model=str(tiny_model)))
        .generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        .token_ids
    )
    settings = dict(expert_workers=1, min_expert_workers=1, max_expert_workers=2, expert_target_utilization=0.01,
                    expert_upscale_delay_s=1.0, expert_downscale_delay_s=4.0, balancer_period_s=0)  # fmt: skip
    with tiny_cluster(tiny_model, **settings) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        results, errors, stop = [], [], threading.Event()

        def send():
            while not stop.is_set():
                try:
                    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
                    results.append(r.choices[0].model_extra["token_ids"])
                except Exception as e:  # noqa: BLE001 (recorded: asserted below)
                    errors.append(repr(e))

        senders = [threading.Thread(target=send) for _ in range(3)]
        for s in senders:
            s.start()
        try:
            _wait(cluster, 2, "grow")
            served = len(results)
            deadline = time.monotonic() + 60
            while len(results) < served + 6 and not errors:  # served by the grown pool too
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            stop.set()
            for s in senders:
                s.join()
        assert errors == [] and results and all(tokens == want for tokens in results)
        status = ray.get(cluster.balancer.status.remote())
        assert status["autoscale"]["max"] == 2 and not status["autoscale"]["pinned"]
        _wait(cluster, 1, "shrink")  # idle: back to the minimum
        # pinned by hand: it stays at 2 while idle, until handed back
        assert ray.get(cluster.balancer.scale_experts.remote(2))["ok"]
        time.sleep(8.0)  # (two downscale delays of idleness: what would have shrunk it)
        assert _workers(cluster) == 2 and ray.get(cluster.balancer.status.remote())["autoscale"]["pinned"]
        assert ray.get(cluster.balancer.scale_experts.remote(None))["ok"]
        _wait(cluster, 1, "shrink after unpinning")
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert r.choices[0].model_extra["token_ids"] == want
