"""The expert pool sizes itself on a real cluster: it grows under load, shrinks when idle, holds
still while pinned by `scale-experts N`, and no request is lost or changed meanwhile."""

import contextlib
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


def _local_tokens(model_dir) -> list[int]:
    """LocalEngine's greedy tokens for PROMPT (what every answer must be)."""
    engine = LocalEngine(EngineConfig(model=str(model_dir)))
    return engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids


def _complete(client) -> list[int]:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    return r.choices[0].model_extra["token_ids"]


@contextlib.contextmanager
def _load(client, senders: int):
    """`senders` clients sending PROMPT back to back while the block runs: yields (token ids of
    each answer, errors), complete once the block has ended."""
    results, errors, stop = [], [], threading.Event()

    def send():
        while not stop.is_set():
            try:
                results.append(_complete(client))
            except Exception as e:  # noqa: BLE001 (recorded: the tests assert there is none)
                errors.append(repr(e))

    threads = [threading.Thread(target=send) for _ in range(senders)]
    for t in threads:
        t.start()
    try:
        yield results, errors
    finally:
        stop.set()
        for t in threads:
            t.join()


def _workers(cluster) -> int:
    return len(ray.get(cluster.balancer.status.remote())["workers"])


def _wait(cluster, n: int, what: str, deadline_s: float = 150.0) -> None:
    deadline = time.monotonic() + deadline_s
    while _workers(cluster) != n:
        assert time.monotonic() < deadline, f"the pool did not {what} to {n} workers in {deadline_s}s"
        time.sleep(0.25)


def _pinned_shrink_decision(cluster, deadline_s: float = 150.0) -> dict:
    """The balancer's status as its autoscaler ticks, polled until a tick has decided to shrink
    the pinned pool of 2 (idle for a whole downscale delay) and, pinned, not acted on it. A tick
    that acted would have taken the new target (1) before yielding to this status call."""
    deadline, reasons = time.monotonic() + deadline_s, []
    while True:
        status = ray.get(cluster.balancer.status.remote())
        reason = status["autoscale"]["reason"]
        if ": 2 -> 1 " in reason and "(pinned by scale-experts: not acting)" in reason:
            return status
        reasons = reasons if reason in reasons else [*reasons[-4:], reason]
        assert time.monotonic() < deadline, (
            f"no pinned shrink decision in {deadline_s}s; last reasons {reasons}"
        )
        time.sleep(0.1)


def test_the_pool_grows_under_load_and_shrinks_when_idle(tiny_model):
    want = _local_tokens(tiny_model)
    # (the autoscaler ticks every 2 s: an upscale delay of 0 grows at the first tick that wants it, a
    # downscale delay of 2 s shrinks at the second idle tick in a row)
    settings = dict(expert_workers=1, min_expert_workers=1, max_expert_workers=3, expert_target_utilization=0.01,
                    expert_upscale_delay_s=0.0, expert_downscale_delay_s=2.0, balancer_period_s=0)  # fmt: skip
    with tiny_cluster(tiny_model, **settings) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        with _load(client, 3) as (results, errors):
            started = time.monotonic()
            _wait(cluster, 2, "grow")  # within a tick or two (busy fractions need two) plus one re-plan
            _wait(cluster, 3, "grow")  # one step at a time, up to the max
            grown_s = time.monotonic() - started
            served = len(results)
            deadline = time.monotonic() + 60
            while len(results) < served + 6 and not errors:  # served by the grown pool too
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert errors == [] and results and all(tokens == want for tokens in results)
        status = ray.get(cluster.balancer.status.remote())
        assert (
            status["autoscale"]["max"] == 3
            and not status["autoscale"]["pinned"]
            and status["autoscale"]["signals"]
        )
        print(f"1 -> 3 expert workers in {grown_s:.1f} s under load")
        _wait(cluster, 1, "shrink")  # idle: back to the minimum, a step per downscale delay
        # pinned by hand: it stays at 2 while idle, until handed back
        assert ray.get(cluster.balancer.scale_experts.remote(2))["ok"]
        pinned = ray.get(cluster.balancer.status.remote())
        held = _pinned_shrink_decision(cluster)  # idle for a downscale delay: a shrink decided, not done
        assert held["autoscale"]["pinned"] and held["target_workers"] == 2, held["autoscale"]
        assert [w["state"] for w in held["workers"]] == ["serving", "serving"], held["workers"]
        assert held["migrations"] == pinned["migrations"]  # (no resize since it was pinned)
        assert ray.get(cluster.balancer.scale_experts.remote(None))["ok"]
        _wait(cluster, 1, "shrink after unpinning")
        assert _complete(client) == want


def _attention(cluster) -> dict:
    return ray.get(cluster.balancer.status.remote())["attention_autoscale"]


def _wait_attention(cluster, serving: int, what: str, deadline_s: float = 150.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        state = _attention(cluster)
        if len(state["serving"]) == serving and not state["starting"] and not state["draining"]:
            return state
        assert time.monotonic() < deadline, f"the attention pool did not {what} to {serving}: {state}"
        time.sleep(0.25)


def test_the_attention_pool_grows_on_queues_and_drains_when_idle(tiny_model):
    """llm-d's saturation rule: one request per batch and a queue of 2 saturate a worker, so four
    clients grow the pool to 2; the router sends the new worker requests at once; idle, the pool
    drains one worker and stops it. Every request completes with LocalEngine's tokens."""
    want = _local_tokens(tiny_model)
    settings = dict(attention_workers=1, min_attention_workers=1, max_attention_workers=2, max_num_seqs=1,
                    attention_queue_threshold=2, attention_upscale_delay_s=0.0, attention_downscale_delay_s=2.0,
                    expert_workers=1, balancer_period_s=0)  # fmt: skip
    with tiny_cluster(tiny_model, **settings) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        with _load(client, 4) as (results, errors):
            grown = _wait_attention(cluster, 2, "grow")
            new = ray.get_actor(
                next(n for n in grown["serving"] if n not in cluster.attention), namespace="moe-cluster"
            )
            deadline = time.monotonic() + 60
            while not ray.get(new.stats.remote())["prefix_cache"]["queried_tokens"]:  # the router uses it
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.1)
            served = len(results)
            while len(results) < served + 4 and not errors:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert errors == [] and results and all(tokens == want for tokens in results)
        shrunk = _wait_attention(cluster, 1, "shrink")  # idle: one drained and stopped
        assert shrunk["desired"] == 1 and "1 -> " not in shrunk["reason"]
        gone = next(n for n in grown["serving"] if n not in shrunk["serving"])
        with pytest.raises(ValueError):  # stopped for good, not restarted
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ray.get_actor(gone, namespace="moe-cluster")
                time.sleep(0.25)
        assert _complete(client) == want
        metrics = client.with_options(max_retries=0)._client.get(f"{cluster.url}/metrics").text
        assert 'moe_attention_workers{state="serving"} 1.0' in metrics
