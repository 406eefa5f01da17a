"""The deploy layout on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`, every node a
separate raylet on this machine): a head with no custom resources, one `attention_node` and two
`expert_node` machines, as deploy/ declares them, with the app deployed from deploy/serve.yaml the
way `serve run` / `serve deploy` / KubeRay do (the builder services.serve:app, detached
workers, Redis URL and API key from the environment).

Shows that workers land by resource, that EPLB's nodes are the Ray nodes the expert workers run on
(hierarchical placement keeps every expert group on one node), that an added expert node is used
by `scale-experts`, and that greedy outputs over HTTP equal the single-process LocalEngine's
throughout."""

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster as RayNodes
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from services.balancer.policy import Pool
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.net import free_port
from services.redis_store import EmbeddedRedis
from services.settings import BALANCER_NAME, NAMESPACE

pytestmark = pytest.mark.cluster

SERVE_CONFIG = Path(__file__).parent.parent / "deploy" / "serve.yaml"
NODE_WORKERS = 2  # expert workers per expert node: the node's `expert_node` resource
API_KEY = "multinode-key"
PROMPTS = [[0, 5, 6, 7], [0] + [9] * 20 + [3], [0, 11, 2, 13, 4, 15]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def nodes():
    """Head (router, balancer; no custom resources) + 1 attention node + 2 expert nodes."""
    rn = RayNodes(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    roles = {rn.head_node.node_id: "head"}
    roles[rn.add_node(num_cpus=1, resources={"attention_node": 1}).node_id] = "attention"
    for _ in range(2):
        roles[rn.add_node(num_cpus=1, resources={"expert_node": NODE_WORKERS}).node_id] = "expert"
    rn.wait_for_nodes()
    ray.init(address=rn.address, namespace=NAMESPACE, log_to_driver=False)
    yield rn, roles
    ray.shutdown()
    rn.shutdown()


@dataclass
class Deployed:
    url: str
    balancer: ray.actor.ActorHandle
    attention: ray.actor.ActorHandle


@pytest.fixture(scope="module")
def cluster(nodes, tiny_model):
    """deploy/serve.yaml with the tiny model, a local Redis and 2 expert workers per expert node;
    secrets through the environment (MOE_REDIS_URL, MOE_API_KEY) as on KubeRay."""
    redis = EmbeddedRedis.start()
    port = free_port()
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    app = config["applications"][0]
    args = app["args"]
    del args["redis_url"]
    args.update(model=str(tiny_model), served_model_name="tiny", dtype="float32", redundant_experts=0,
                expert_workers=2 * NODE_WORKERS, attention_threads=1, expert_threads=1,
                balancer_period_s=0)  # fmt: skip
    app["runtime_env"] = {"env_vars": {"MOE_REDIS_URL": redis.url, "MOE_API_KEY": API_KEY}}
    # All "nodes" share 127.0.0.1 here, so one HTTP proxy (on the head) rather than one per node.
    config.update(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    schema = ServeDeploySchema.model_validate(config)
    try:
        # what `serve run deploy/serve.yaml` does (ray/serve/scripts.py)
        client = serve_start(
            http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location
        )
        client.deploy_apps(schema)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        yield Deployed(url, ray.get_actor(BALANCER_NAME), ray.get_actor("moe-attn-0"))
    finally:
        _stop_app()
        redis.stop()


def _stop_app() -> None:
    """Serve, then the detached actors the app builder started (they outlive the Serve app)."""
    with contextlib.suppress(Exception):
        serve.shutdown()
    with contextlib.suppress(Exception):
        balancer = ray.get_actor(BALANCER_NAME)
        ray.get(balancer.shutdown.remote(), timeout=30)  # stops the expert workers
        ray.kill(balancer)
    with contextlib.suppress(Exception):
        ray.kill(ray.get_actor("moe-attn-0"))


def _wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout}s: {serve.status()}")


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _status(cluster) -> dict:
    return ray.get(cluster.balancer.status.remote())


def _actor_node(handle) -> str:
    """The Ray node an actor runs on, from the GCS actor table."""
    return ray._private.state.actors(handle._actor_id.hex())["Address"]["NodeID"]


def _groups_on_one_node(status: dict, experts_per_group: int) -> bool:
    """Every logical expert group's slots, in every MoE layer, on one Ray node."""
    slot_node = {slot: w["node"] for w in status["workers"] for slot in w["slots"]}
    for row in status["phy2log"]:
        nodes_of_group: dict[int, set[str]] = {}
        for slot, expert in enumerate(row):
            nodes_of_group.setdefault(expert // experts_per_group, set()).add(slot_node[slot])
        if any(len(n) != 1 for n in nodes_of_group.values()):
            return False
    return True


def _expert_nodes(status: dict) -> dict[str, str]:
    return {w["id"]: w["node"] for w in status["workers"]}


def test_workers_land_on_their_nodes(nodes, cluster, expected):
    _, roles = nodes
    unauthorized = httpx.post(f"{cluster.url}/v1/completions", json={"model": "tiny", "prompt": [0]})
    assert unauthorized.status_code == 401  # MOE_API_KEY reached the router
    assert roles[_actor_node(cluster.attention)] == "attention"
    st = _status(cluster)
    workers = _expert_nodes(st)
    assert len(workers) == 2 * NODE_WORKERS
    for wid, node in workers.items():  # the balancer's record = where the actor really runs
        assert roles[node] == "expert"
        assert ray.get(ray.get_actor(f"moe-{wid}").node_id.remote()) == node
    per_node = {n: list(workers.values()).count(n) for n in set(workers.values())}
    assert sorted(per_node.values()) == [NODE_WORKERS, NODE_WORKERS]
    for p, prompt in enumerate(PROMPTS):
        assert _complete(cluster.url, prompt) == expected[p]


def test_hierarchical_placement_keeps_groups_on_a_node(cluster, tiny_model, expected):
    from services.model.config import ModelConfig

    mcfg = ModelConfig.from_dir(tiny_model)
    group = mcfg.n_routed_experts // mcfg.n_group
    st = _status(cluster)
    pool = Pool.grouped(_expert_nodes(st))
    assert pool.eplb_args(mcfg) == (2, 2 * NODE_WORKERS)  # EPLB nodes = the 2 Ray nodes
    assert tuple(w["id"] for w in st["workers"]) == pool.workers  # slots follow node boundaries
    assert _groups_on_one_node(st, group)
    # skewed loads: the hot experts get spread, still without a group crossing nodes
    loads = [[1000.0 if e in (0, 1, 5) else 10.0 for e in range(mcfg.n_routed_experts)]] * mcfg.num_moe_layers
    result = ray.get(cluster.balancer.rebalance.remote(force=True, loads=loads))
    assert result["migrated"], result
    st = _status(cluster)
    assert st["version"] == 2 and _groups_on_one_node(st, group)
    for p, prompt in enumerate(PROMPTS):
        assert _complete(cluster.url, prompt) == expected[p]


def _requested_bundles() -> list[dict]:
    """What Ray's autoscaler was asked to make room for (request_resources), read back from Ray."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"[]")


def test_a_worker_without_room_asks_for_a_node_and_uses_it(nodes, cluster, tiny_model, expected):
    """scale-experts beyond the expert nodes' room: the fifth worker waits (pending in status), Ray's
    autoscaler is asked for room for five workers; a node with room joins (what `ray up` / KubeRay
    would add) and the worker starts there, nobody else moves. Shrinking asks for four again."""
    from services.model.config import ModelConfig

    rn, roles = nodes
    before = _expert_nodes(_status(cluster))
    grow = 2 * NODE_WORKERS + 1
    up_ref = cluster.balancer.scale_experts.remote(grow)  # (returns once the worker started)
    deadline = time.monotonic() + 60
    while not (st := _status(cluster))["pending_workers"]:
        assert time.monotonic() < deadline, f"no pending worker in 60 s: {st['requested']}"
        time.sleep(0.2)
    assert st["requested"] == {"workers": grow, "bundle": {"expert_node": 1.0}}
    assert _requested_bundles() == [{"expert_node": 1.0}] * grow
    assert len(_expert_nodes(st)) == 2 * NODE_WORKERS  # (serving on as before)
    assert _complete(cluster.url, PROMPTS[0]) == expected[0]

    new_node = rn.add_node(num_cpus=1, resources={"expert_node": 1}).node_id  # room for one worker
    roles[new_node] = "expert"
    up = ray.get(up_ref, timeout=180)
    assert up["ok"] and up["workers"] == grow, up
    st = _status(cluster)
    workers = _expert_nodes(st)
    added = {w: n for w, n in workers.items() if w not in before}
    assert list(added.values()) == [new_node]  # the new worker runs on the new node
    assert {w: workers[w] for w in before} == before  # nobody else moved
    mcfg = ModelConfig.from_dir(tiny_model)
    pool = Pool.grouped(workers)
    assert tuple(w["id"] for w in st["workers"]) == pool.workers
    assert pool.eplb_args(mcfg) == (1, 2 * NODE_WORKERS + 1)  # uneven nodes: the global policy
    for p, prompt in enumerate(PROMPTS):
        assert _complete(cluster.url, prompt) == expected[p]

    # shrinking stops the newest worker: back to 2 nodes, hierarchical again
    down = ray.get(cluster.balancer.scale_experts.remote(2 * NODE_WORKERS))
    assert down["ok"] and down["workers"] == 2 * NODE_WORKERS, down
    st = _status(cluster)
    assert st["pending_workers"] == {} and _requested_bundles() == [{"expert_node": 1.0}] * 2 * NODE_WORKERS
    assert _expert_nodes(st) == before
    assert _groups_on_one_node(st, mcfg.n_routed_experts // mcfg.n_group)
    for p, prompt in enumerate(PROMPTS):
        assert _complete(cluster.url, prompt) == expected[p]
