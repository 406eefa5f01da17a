"""The balancer on a real cluster: live re-placement and pool scaling under traffic with zero
failed requests and unchanged outputs, balance measured by the expert workers' own counters,
and a Redis restart that stops rebalancing but not serving."""

import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import ray
import torch

from services.balancer.eplb import gpu_loads
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.redis_store import EmbeddedRedis

from .clusters import tiny_cluster
from .hf_oracle import run_requests

pytestmark = pytest.mark.cluster

MAX_TOKENS = 24
CANDIDATE_TOKENS = range(1, 33)


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


@dataclass
class Workload:
    prompts: list[list[int]]
    expected: list[list[int]]  # greedy completions, from LocalEngine
    predicted_balance: float  # expert-worker balance of these prompts on the initial placement


def _prompts(token: int) -> list[list[int]]:
    """A token repeated: most tokens route to the same few experts."""
    return [[0] + [token] * 60 + [9 + i] for i in range(6)]


@pytest.fixture(scope="module")
def workload(tiny_model, cluster) -> Workload:
    """Of the repeated-token prompt sets, the one whose load is the most skewed over the expert
    workers on the cluster's initial placement (routing counted by LocalEngine, which routes as the
    cluster does), so that the test starts from an unbalanced placement by construction."""
    status = _status(cluster)
    phy2log, num_workers = torch.tensor(status["phy2log"]), len(status["workers"])
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    best = None
    for token in CANDIDATE_TOKENS:
        prompts = _prompts(token)
        outs, _, load = run_requests(engine, prompts, params)
        expected = [o.token_ids for o in outs]
        worker_load = gpu_loads(phy2log, load.double(), num_workers).sum(0)
        balance = float(worker_load.mean() / worker_load.max())
        if best is None or balance < best.predicted_balance:
            best = Workload(prompts, expected, balance)
    return best


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


class Traffic:
    """Clients sending the workload's prompts in a loop until stopped; records every result."""

    def __init__(self, url: str, workload: Workload, clients: int = 3):
        self.url, self.prompts, self.results, self.errors = url, workload.prompts, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            p = n % len(self.prompts)
            try:
                self.results.append((p, _complete(self.url, self.prompts[p])))
            except Exception as e:  # noqa: BLE001 (recorded, asserted by the test)
                self.errors.append(repr(e))
            n += 1

    def wait_for(self, results: int, deadline_s: float = 120.0) -> None:
        """Until `results` requests have completed in all (or an error was recorded), at most deadline_s."""
        deadline = time.monotonic() + deadline_s
        while len(self.results) < results and not self.errors:
            assert time.monotonic() < deadline, f"{len(self.results)} of {results} requests in {deadline_s} s"
            time.sleep(0.05)

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


def _wait_counts_in_redis(cluster, deadline_s: float = 60.0) -> None:
    """Until every attention worker's load reporter has written all it counted to Redis (it
    counts a step's load before the step's tokens go out, so this covers every answered request)."""
    deadline = time.monotonic() + deadline_s
    while True:
        stats = ray.get([a.stats.remote() for a in cluster.attention.values()])
        unflushed = [s["load_reporter"]["unflushed_tokens"] for s in stats]
        if not any(unflushed):
            return
        assert time.monotonic() < deadline, f"load counts not in Redis after {deadline_s} s: {unflushed}"
        time.sleep(0.1)


def test_rebalance_raises_measured_balance_and_keeps_outputs(cluster, workload):
    v1, expected = _status(cluster)["version"], workload.expected
    for p, prompt in enumerate(workload.prompts):  # phase A on the uniform initial placement
        assert _complete(cluster.url, prompt) == expected[p]
    _wait_counts_in_redis(cluster)
    before = _worker_balance(cluster, v1)
    # the workers' own counters agree with LocalEngine's routing (replicas take turns instead of
    # splitting exactly, hence the tolerance), and phase A is skewed
    assert before == pytest.approx(workload.predicted_balance, abs=0.02)
    assert before < 0.9, before
    with Traffic(cluster.url, workload) as traffic:
        traffic.wait_for(3)  # in flight while the placement changes
        result = ray.get(cluster.balancer.rebalance.remote())
        traffic.wait_for(len(traffic.results) + 3)  # and served after it
    assert result["migrated"], result
    assert not traffic.errors and traffic.results
    assert all(tokens == expected[p] for p, tokens in traffic.results)
    v2 = _status(cluster)["version"]
    assert v2 == v1 + 1
    for p, prompt in enumerate(workload.prompts):  # phase B: the same traffic on the new placement
        assert _complete(cluster.url, prompt) == expected[p]
    after = _worker_balance(cluster, v2)
    assert after > before and after >= 0.9, (before, after)
    st = _status(cluster)
    assert st["last_migration"]["ok"] and st["last_migration"]["moved_slots"] > 0


def test_scale_2_to_3_to_1_under_traffic(cluster, workload):
    expected = workload.expected
    try:
        with Traffic(cluster.url, workload) as traffic:
            traffic.wait_for(3)
            up = ray.get(cluster.balancer.scale_experts.remote(3))
            traffic.wait_for(len(traffic.results) + 3)  # served by 3 workers
            down = ray.get(cluster.balancer.scale_experts.remote(1))
            traffic.wait_for(len(traffic.results) + 3)  # and by 1
        assert up["ok"] and up["workers"] == 3, up
        assert down["ok"] and down["workers"] == 1, down
        assert not traffic.errors, traffic.errors[:3]
        assert len(traffic.results) >= 9
        assert all(tokens == expected[p] for p, tokens in traffic.results)
        st = _status(cluster)
        assert len(st["workers"]) == 1 and st["slots_per_worker"] >= 16
    finally:  # the module's cluster goes on with its 2 workers whatever happened here
        assert ray.get(cluster.balancer.scale_experts.remote(2))["ok"]


def test_redis_restart_stops_rebalancing_not_serving(cluster, workload):
    prompts, expected = workload.prompts, workload.expected
    redis: EmbeddedRedis = cluster.redis
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    redis.stop()
    try:
        for p, prompt in enumerate(prompts[:3]):
            assert _complete(cluster.url, prompt) == expected[p]
        result = ray.get(cluster.balancer.rebalance.remote())
        assert not result["migrated"] and "Redis" in result["reason"]
    finally:
        cluster.redis = EmbeddedRedis.start(port=port, password=cluster.redis.password)
    for p, prompt in enumerate(prompts[:3]):
        assert _complete(cluster.url, prompt) == expected[p]
    _wait_counts_in_redis(cluster)  # counts kept while Redis was down are flushed now
    result = ray.get(cluster.balancer.rebalance.remote())
    assert "Redis" not in result.get("reason", ""), result


def test_load_slots_copies_only_from_the_clusters_expert_workers(cluster):
    """A LoadSlots naming a peer that is not one of the cluster's live expert workers is refused
    before anything loads (the worker would send that host the secret and take its weights); the
    cluster's own workers pass the check (the bad layout is what refuses that call)."""
    import grpc

    from services.experts.client import ExpertClient

    secret = ray.get(cluster.balancer.data_plane_secret.remote())
    addresses = [w["address"] for w in _status(cluster)["workers"]]
    client = ExpertClient(addresses[0], secret=secret)
    try:
        with pytest.raises(grpc.RpcError) as stranger:
            client.load_slots(99, {}, timeout=60, peers=["203.0.113.9:50051", addresses[1]])
        assert stranger.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "203.0.113.9:50051" in stranger.value.details()
        with pytest.raises(grpc.RpcError) as own:
            client.load_slots(99, {}, timeout=60, peers=addresses)
        assert own.value.code() == grpc.StatusCode.INVALID_ARGUMENT, own.value.details()
    finally:
        client.close()
