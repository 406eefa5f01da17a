"""Fault tolerance on a real local cluster (2 attention workers, 3 expert workers, the router,
the balancer, an embedded Redis): 16 concurrent greedy streaming requests, one process killed
with SIGKILL while they run. Every request must complete with exactly the tokens of a run
without the fault (LocalEngine), and the cluster must heal afterwards."""

import asyncio
import functools
import threading
import time

import httpx
import openai
import pytest
import ray

from services.redis_store import EmbeddedRedis, connect
from services.settings import BALANCER_NAME

from ..clusters import tiny_cluster
from . import scenario

pytestmark = pytest.mark.cluster

REQUESTS, MAX_TOKENS = 16, 96


@pytest.fixture(scope="module")
def expected(tiny_model):
    return scenario.local_tokens(tiny_model, scenario.prompts(REQUESTS), MAX_TOKENS)


@pytest.fixture(scope="module", params=["auto", "grpc", "tcp"])  # auto, on one node: shared memory
def cluster(tiny_model, request):
    with tiny_cluster(
        tiny_model, attention_workers=2, expert_workers=3, balancer_period_s=0, max_num_seqs=32,
        expert_transport=request.param,
    ) as c:  # fmt: skip
        yield c


def _run(cluster, name, fault):
    outcome = scenario.run(cluster.url, name, fault, requests=REQUESTS, max_tokens=MAX_TOKENS)
    print(f"{name}: {outcome.seconds:.1f}s, lost {outcome.lost}, longest stall {outcome.stall_s():.2f}s")
    return outcome


def _complete_and_identical(outcome, expected):
    assert outcome.errors == [None] * REQUESTS
    assert outcome.finish_reasons == ["length"] * REQUESTS
    assert outcome.tokens == expected


def _not_about_the_data_plane(cluster):
    """The faults below the data plane's (balancer, Redis, router) run with two transports, not
    every one: each run costs a minute or more."""
    if cluster.cfg.expert_transport == "tcp":
        pytest.skip("does not depend on the data plane: run with auto and grpc")


def _balancer(cluster):
    return ray.get_actor(BALANCER_NAME, namespace=cluster.cfg.namespace)


def test_without_a_fault_the_cluster_equals_local_engine(cluster, expected):
    _complete_and_identical(_run(cluster, "none", None), expected)
    want = {"auto": "shm", "grpc": "grpc", "tcp": "tcp"}[cluster.cfg.expert_transport]
    for stats in ray.get([a.stats.remote() for a in cluster.attention.values()]):
        assert set(stats["dispatch"]["transport"].values()) == {want}, stats["dispatch"]


def test_expert_worker_killed(cluster, expected):
    ns = cluster.cfg.namespace
    outcome = _run(cluster, "expert worker", scenario.kill(lambda: scenario.expert_worker_pid(ns, 1)))
    _complete_and_identical(outcome, expected)
    status = scenario.wait_healed(ns, expert_workers=3)  # healed, then replaced
    assert status["heals"] >= 1
    dead = status["dead_workers"][-1]
    assert dead["healed_s"] is not None and dead["address"] not in {w["address"] for w in status["workers"]}


def test_attention_worker_killed(cluster, expected):
    ns = cluster.cfg.namespace
    outcome = _run(cluster, "attention worker", scenario.kill(lambda: scenario.actor_pid("moe-attn-0", ns)))
    _complete_and_identical(outcome, expected)
    scenario.wait_healed(ns, expert_workers=3)
    restarted = ray.get(ray.get_actor("moe-attn-0", namespace=ns).pid.remote(), timeout=60)
    assert restarted != outcome.fault_result  # Ray restarted it; it serves again
    _complete_and_identical(_run(cluster, "after attention restart", None), expected)


def _only_once(cluster):
    if cluster.cfg.expert_transport != "auto":
        pytest.skip(
            "a freeze is found by the balancer's and the router's checks, not the data plane: run once"
        )


def test_expert_worker_frozen(cluster, expected):
    """SIGSTOP, thawed 10 s later: the balancer's health checks (deadlines from their observed
    latency) find it hung in about 1.5 s, re-place its experts and kill it (fenced: when the
    thaw comes there is nothing to serve); the streams pause briefly, no token changes."""
    _only_once(cluster)
    ns = cluster.cfg.namespace
    outcome = _run(
        cluster, "expert worker frozen", scenario.freeze(lambda: scenario.expert_worker_pid(ns, 1), 10)
    )
    _complete_and_identical(outcome, expected)
    assert outcome.stall_s() < 8, outcome.stall_s()  # (found and moved long before the thaw)
    assert scenario.gone(outcome.fault_result, wait_s=60), "the frozen expert worker was not killed"
    status = scenario.wait_healed(ns, expert_workers=3)
    assert status["dead_workers"][-1]["reason"].startswith("hung"), status["dead_workers"][-1]


def test_attention_worker_frozen(cluster, expected):
    """SIGSTOP, thawed 10 s later: its streams stall, the router pings it (deadlines from observed
    gaps and ping times), gets no answer and moves them (same tokens); the balancer, asked to
    fence it, finds it unanswering too and kills it; Ray restarts it and it serves again."""
    _only_once(cluster)
    ns = cluster.cfg.namespace
    outcome = _run(cluster, "attention worker frozen",
                   scenario.freeze(lambda: scenario.actor_pid("moe-attn-0", ns), 10))  # fmt: skip
    _complete_and_identical(outcome, expected)
    assert outcome.stall_s() < 8, outcome.stall_s()
    assert scenario.gone(outcome.fault_result, wait_s=60), "the frozen attention worker was not killed"
    status = scenario.wait_healed(ns, expert_workers=3)
    assert [f["worker"] for f in status["attention_fenced"]][-1:] == ["moe-attn-0"]
    _complete_and_identical(_run(cluster, "after the fence", None), expected)


def test_attention_worker_engine_thread_stuck(cluster, expected):
    """Its engine thread blocks for 60 s while its event loop answers pings: once the step has run
    past its stuck deadline (at least `stuck_floor_s`, 10 s) its ping answers say so, so the
    router moves its streams (same tokens) and the balancer, asked to fence it, kills it; Ray
    restarts it and it serves again."""
    _only_once(cluster)
    ns = cluster.cfg.namespace

    def block_engine_thread(worker, seconds: float) -> None:
        """Run on the worker by Ray's own `__ray_call__` (no hook of the worker's; a nested
        function: pickled by value): its engine thread sleeps `seconds` at the next step boundary
        while its event loop answers as ever. (From a thread of its own, whatever runs this.)"""
        block = functools.partial(worker.service.between_steps, functools.partial(time.sleep, seconds))
        threading.Thread(target=lambda: asyncio.run(block()), daemon=True).start()

    def fault() -> int:
        actor = ray.get_actor("moe-attn-0", namespace=ns)
        pid = ray.get(actor.pid.remote(), timeout=30)
        ray.get(actor.__ray_call__.remote(block_engine_thread, 60.0), timeout=30)
        return pid

    outcome = _run(cluster, "attention engine thread stuck", fault)
    _complete_and_identical(outcome, expected)
    assert 10 <= outcome.stall_s() < 25, outcome.stall_s()  # (the stuck deadline, then moved)
    assert scenario.gone(outcome.fault_result, wait_s=60), "the stuck attention worker was not killed"
    status = scenario.wait_healed(ns, expert_workers=3)
    fenced = status["attention_fenced"][-1]
    assert fenced["worker"] == "moe-attn-0" and "engine thread" in fenced["reason"], fenced
    _complete_and_identical(_run(cluster, "after the fence", None), expected)


def test_balancer_killed(cluster, expected):
    _not_about_the_data_plane(cluster)
    ns = cluster.cfg.namespace
    before = ray.get(_balancer(cluster).status.remote())
    outcome = _run(cluster, "balancer", scenario.kill(lambda: scenario.actor_pid(BALANCER_NAME, ns)))
    _complete_and_identical(outcome, expected)
    status = scenario.wait_healed(ns, expert_workers=3)
    assert status["resumed"]  # re-attached to the running workers, same placement
    assert status["version"] == before["version"]
    assert [w["address"] for w in status["workers"]] == [w["address"] for w in before["workers"]]


def test_balancer_killed_on_a_loaded_machine(cluster, expected):
    """The same with two CPU-bound processes beside the cluster, one per core of this machine: the
    restarted balancer may find the workers slow to answer; it waits and retries (it used to kill
    workers that did not answer within 10 s and start afresh, which could outlast any deadline)."""
    if cluster.cfg.expert_transport != "auto":
        pytest.skip("the balancer's resume does not depend on the data plane: run once (~2 min)")
    ns = cluster.cfg.namespace
    before = ray.get(_balancer(cluster).status.remote())
    with scenario.busy(2):
        outcome = _run(
            cluster, "balancer, loaded", scenario.kill(lambda: scenario.actor_pid(BALANCER_NAME, ns))
        )
        status = scenario.wait_healed(ns, expert_workers=3, timeout_s=300)
    _complete_and_identical(outcome, expected)
    assert status["resumed"] and status["version"] == before["version"]
    assert [w["address"] for w in status["workers"]] == [w["address"] for w in before["workers"]]


def test_redis_killed(cluster, expected):
    _not_about_the_data_plane(cluster)
    port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    outcome = _run(cluster, "redis", scenario.kill(lambda: cluster.redis.process.pid))
    _complete_and_identical(outcome, expected)
    cluster.redis = EmbeddedRedis.start(
        port=port, password=cluster.redis.password
    )  # back on the same port: counts flush again
    deadline = time.monotonic() + 30
    while not connect(cluster.redis_url).keys("*:load:*"):
        assert time.monotonic() < deadline, "load counts did not reach the restarted Redis"
        time.sleep(0.2)


def test_router_replica_killed(cluster, expected):
    """Two router replicas (the default): one is killed while six clients send requests with the
    official client's default retries (2, on 5xx and connection errors); every request is answered,
    with LocalEngine's tokens (a retried one by the live replica), and Serve restarts the dead one."""
    _not_about_the_data_plane(cluster)
    from ray import serve

    from services.cluster import APP_NAME

    handle = serve.get_app_handle(APP_NAME)
    pid = handle.pid.remote().result(timeout_s=30)
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=120)  # (max_retries: 2)
    results, errors, stop = [], [], threading.Event()

    def send():
        while not stop.is_set():
            try:
                reply = client.completions.create(model="tiny", prompt=scenario.prompts(1)[0], max_tokens=MAX_TOKENS,
                                                  temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
                results.append(reply.choices[0].model_extra["token_ids"])
            except Exception as e:  # noqa: BLE001 (recorded: the test asserts there is none)
                errors.append(repr(e))

    def wait_for(n: int, deadline_s: float = 120.0) -> None:
        deadline = time.monotonic() + deadline_s
        while len(results) < n and not errors:
            assert time.monotonic() < deadline, f"{len(results)} of {n} answers in {deadline_s}s"
            time.sleep(0.05)

    clients = [threading.Thread(target=send) for _ in range(6)]
    for c in clients:
        c.start()
    try:
        wait_for(6)
        scenario.sigkill(pid)
        wait_for(len(results) + 18)  # served on after the kill
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert errors == [] and all(tokens == expected[0] for tokens in results)
    deadline = time.monotonic() + 90  # Serve brings the replica count back
    while (
        len({handle.pid.remote().result(timeout_s=30) for _ in range(8)} - {pid})
        < cluster.cfg.router_replicas
    ):
        assert time.monotonic() < deadline, "the killed router replica was not replaced"
        time.sleep(0.5)


def test_shutdown_drains_running_requests(cluster, expected):
    """What SIGTERM / Ctrl-C of `moe-cluster up` does first: refuse new requests, let the running
    ones finish (bounded). Runs last: the router stays closed."""
    _not_about_the_data_plane(cluster)

    def drain():
        return cluster.drain(timeout_s=60), httpx.post(
            f"{cluster.url}/v1/completions", json={"model": "tiny", "prompt": [0, 5], "max_tokens": 4}
        )

    outcome = scenario.run(cluster.url, "drain", drain, requests=4, max_tokens=MAX_TOKENS)
    drained, refused = outcome.fault_result
    assert drained and refused.status_code == 503 and refused.headers["retry-after"]
    assert outcome.errors == [None] * 4 and outcome.tokens == expected[:4]
