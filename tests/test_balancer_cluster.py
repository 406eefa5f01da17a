"""The balancer on a real cluster: live re-placement and pool scaling under traffic with zero
failed requests and unchanged outputs, balance measured by the expert workers' own counters,
and a Redis restart that stops rebalancing but not serving."""

import threading
import time

import httpx
import pytest
import ray

from services.model.engine import EngineConfig, LocalEngine
from services.model.redis_store import EmbeddedRedis
from services.model.sampling import SamplingParams

from .clusters import tiny_cluster

pytestmark = pytest.mark.cluster

# repetitive prompts route most tokens to a few experts: a skewed load
PROMPTS = [[0] + [5 + i % 2] * 60 + [9 + i] for i in range(6)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with tiny_cluster(
        tiny_model,
        expert_workers=2,
        redundant_experts=2,
        max_num_seqs=16,
        balancer_period_s=0,  # rebalance on demand in tests
        balancer_bucket_seconds=1.0,
        balancer_window_buckets=120,
        balancer_min_gain=0.0,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


class Traffic:
    """Clients sending the PROMPTS in a loop until stopped; records every result."""

    def __init__(self, url: str, clients: int = 3):
        self.url, self.results, self.errors = url, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            p = n % len(PROMPTS)
            try:
                self.results.append((p, _complete(self.url, PROMPTS[p])))
            except Exception as e:  # noqa: BLE001 (recorded, asserted by the test)
                self.errors.append(repr(e))
            n += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()


def _worker_balance(cluster, version: int) -> float:
    """mean/max expert-worker load of `version`, from the workers' own per-slot counters."""
    stats = ray.get(cluster.balancer.worker_stats.remote())
    loads = [sum(sum(tokens) for tokens in s.get(version, {}).values()) for s in stats.values()]
    return (sum(loads) / len(loads)) / max(loads)


def _status(cluster) -> dict:
    return ray.get(cluster.balancer.status.remote())


def test_rebalance_raises_measured_balance_and_keeps_outputs(cluster, expected):
    v1 = _status(cluster)["version"]
    for p, prompt in enumerate(PROMPTS):  # phase A on the uniform initial placement
        assert _complete(cluster.url, prompt) == expected[p]
    time.sleep(2.5)  # the attention worker flushes its counts to Redis every second
    before = _worker_balance(cluster, v1)
    with Traffic(cluster.url) as traffic:
        time.sleep(1.0)
        result = ray.get(cluster.balancer.rebalance.remote())
        time.sleep(1.0)
    assert result["migrated"], result
    assert not traffic.errors and traffic.results
    assert all(tokens == expected[p] for p, tokens in traffic.results)
    v2 = _status(cluster)["version"]
    assert v2 == v1 + 1
    for p, prompt in enumerate(PROMPTS):  # phase B: the same traffic on the new placement
        assert _complete(cluster.url, prompt) == expected[p]
    after = _worker_balance(cluster, v2)
    # phase A's placement can already measure near-balanced on a short run (0.975 seen in CI):
    # then the new placement must stay balanced rather than beat it
    assert after > before or after >= 0.95, (before, after)
    st = _status(cluster)
    assert st["last_migration"]["ok"] and st["last_migration"]["moved_slots"] > 0


def test_scale_2_to_3_to_1_under_traffic(cluster, expected):
    with Traffic(cluster.url) as traffic:
        time.sleep(1.0)
        up = ray.get(cluster.balancer.scale_experts.remote(3))
        time.sleep(1.0)
        down = ray.get(cluster.balancer.scale_experts.remote(1))
        time.sleep(1.0)
    assert up["ok"] and up["workers"] == 3, up
    assert down["ok"] and down["workers"] == 1, down
    assert not traffic.errors, traffic.errors[:3]
    assert len(traffic.results) >= 6
    assert all(tokens == expected[p] for p, tokens in traffic.results)
    st = _status(cluster)
    assert len(st["workers"]) == 1 and st["slots_per_worker"] >= 16
    ray.get(cluster.balancer.scale_experts.remote(2))


def test_redis_restart_stops_rebalancing_not_serving(cluster, expected):
    redis: EmbeddedRedis = cluster.redis
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    redis.stop()
    try:
        for p, prompt in enumerate(PROMPTS[:3]):
            assert _complete(cluster.url, prompt) == expected[p]
        result = ray.get(cluster.balancer.rebalance.remote())
        assert not result["migrated"] and "Redis" in result["reason"]
    finally:
        cluster.redis = EmbeddedRedis.start(port=port)
    for p, prompt in enumerate(PROMPTS[:3]):
        assert _complete(cluster.url, prompt) == expected[p]
    time.sleep(2.5)  # counts kept while Redis was down are flushed now
    result = ray.get(cluster.balancer.rebalance.remote())
    assert "Redis" not in result.get("reason", ""), result
