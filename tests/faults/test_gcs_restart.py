"""Ray's GCS (the head's control process) killed with SIGKILL under streaming load, then restarted,
with GCS fault tolerance: its tables in Redis (RAY_REDIS_ADDRESS, what KubeRay's
gcsFaultToleranceOptions and deploy/start-head.sh set up). The data path (Serve's proxy, the router,
the attention workers, the expert workers) makes no GCS call, so streams running through the outage
complete with LocalEngine's tokens and new requests are served while it lasts; once the GCS is back
(a restarted head: KubeRay restarts the pod) the cluster can still heal: a killed expert worker is
replaced, which needs a new actor and so the GCS. What is not survived: anything that needs the GCS
while it is down (healing, scaling, a new Serve replica) waits for it, and without Redis-backed
storage a restarted GCS starts an empty cluster (the raylets then exit)."""

import os
import time
import uuid

import openai
import pytest
import ray
from ray.cluster_utils import Cluster as RayNodes

from services.redis_store import EmbeddedRedis
from services.settings import BALANCER_NAME

from ..clusters import tiny_cluster
from . import scenario

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REQUESTS, MAX_TOKENS = 8, 48


@pytest.fixture(scope="module")
def expected(tiny_model):
    return scenario.local_tokens(tiny_model, scenario.prompts(REQUESTS), MAX_TOKENS)


@pytest.fixture(scope="module")
def nodes():
    """A head whose GCS keeps its tables in a Redis of its own (the environment is the test
    process's while the head starts, then restored: other tests' Ray must not use it)."""
    redis = EmbeddedRedis.start(password="")  # (Ray is given the address alone)
    saved = {k: os.environ.get(k) for k in ("RAY_REDIS_ADDRESS", "RAY_external_storage_namespace")}
    os.environ["RAY_REDIS_ADDRESS"] = redis.url.removeprefix("redis://").removesuffix("/0")
    os.environ["RAY_external_storage_namespace"] = f"gcs-ft-{uuid.uuid4().hex[:8]}"  # noqa: SIM112 (Ray reads this spelling)
    try:
        rn = RayNodes(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        yield rn
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ray.shutdown()
    rn.shutdown()
    redis.stop()


@pytest.fixture(scope="module")
def cluster(nodes, tiny_model):
    with tiny_cluster(tiny_model, address=nodes.address, allow_unauthenticated_ray=True,  # (cluster_utils: no token)
                      expert_workers=2, redundant_experts=0, balancer_period_s=0,
                      max_num_seqs=16, attention_threads=1, expert_threads=1) as c:  # fmt: skip
        yield c


def _completion(url: str, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    return out.choices[0].model_extra["token_ids"]


def test_serving_survives_a_gcs_restart_and_the_cluster_heals_after_it(nodes, cluster, expected):
    ns = cluster.cfg.namespace
    outcome = scenario.run(cluster.url, "gcs killed", nodes.head_node.kill_gcs_server, REQUESTS, MAX_TOKENS)
    assert outcome.lost == 0, outcome.errors
    assert outcome.tokens == expected and set(outcome.finish_reasons) == {"length"}
    assert outcome.stall_s() <= 5.0
    assert "gcs_server" not in {kind for kind, _ in nodes.head_node.live_processes()}  # (it is down)
    # the GCS is still down: new requests are served all the same
    prompts = scenario.prompts(REQUESTS)
    assert [_completion(cluster.url, p) for p in prompts[:2]] == expected[:2]

    nodes.head_node.start_gcs_server()
    deadline = time.monotonic() + 60
    while True:  # (the balancer answers through a GCS lookup by name once the GCS is back)
        try:
            ray.get(ray.get_actor(BALANCER_NAME, namespace=ns).status.remote(), timeout=10)
            break
        except Exception:
            assert time.monotonic() < deadline, "the GCS did not come back"
            time.sleep(0.5)
    # healing needs the GCS (a new actor): a killed expert worker is replaced
    before = {w["id"] for w in scenario.wait_healed(ns, 2)["workers"]}
    scenario.sigkill(scenario.expert_worker_pid(ns))
    deadline = time.monotonic() + 120
    while True:
        status = scenario.wait_healed(ns, 2, timeout_s=120)
        if {w["id"] for w in status["workers"]} != before:
            break
        assert time.monotonic() < deadline, "the killed expert worker was not replaced"
        time.sleep(0.5)
    assert [_completion(cluster.url, p) for p in prompts[2:4]] == expected[2:4]
