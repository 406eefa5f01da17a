"""Whole nodes lost under streaming load: a multi-raylet Ray cluster on this machine (as
tests/test_deploy_multinode.py builds one: a head with the router and balancer (kept there by
`control_resources`), two attention
nodes, two expert nodes with two workers each). A node is removed (its raylet and every process
on it killed) while 16 greedy streams run; every stream must complete with exactly LocalEngine's
tokens and end with its finish_reason (never silently), and the longest pause is reported."""

import pytest
import ray
from ray.cluster_utils import Cluster as RayNodes

from services.settings import BALANCER_NAME

from ..clusters import tiny_cluster
from . import scenario

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REQUESTS, MAX_TOKENS = 16, 64


@pytest.fixture(scope="module")
def expected(tiny_model):
    return scenario.local_tokens(tiny_model, scenario.prompts(REQUESTS), MAX_TOKENS)


@pytest.fixture(scope="module")
def nodes():
    rn = RayNodes(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"head_node": 4}, "include_dashboard": False},
    )
    roles = {"attention": [], "expert": []}
    for _ in range(2):
        roles["attention"].append(rn.add_node(num_cpus=1, resources={"attention_node": 1}))
    for _ in range(2):
        roles["expert"].append(rn.add_node(num_cpus=1, resources={"expert_node": 2}))
    rn.wait_for_nodes()
    yield rn, roles
    ray.shutdown()
    rn.shutdown()


@pytest.fixture(scope="module")
def cluster(nodes, tiny_model):
    rn, _ = nodes
    with tiny_cluster(
        tiny_model, address=rn.address, allow_unauthenticated_ray=True,  # (cluster_utils: no token)
        attention_workers=2, expert_workers=4, redundant_experts=0,
        attention_resources={"attention_node": 1}, expert_resources={"expert_node": 1},
        balancer_period_s=0, max_num_seqs=32, attention_threads=1, expert_threads=1,
        control_resources={"head_node": 1},  # router and balancer on the head (losing a router
    ) as c:  # fmt: skip                    # replica is test_faults' scenario)
        yield c


def _control_plane_nodes() -> set[str]:
    """Nodes of the router replicas and the balancer (from Ray's GCS table of actors: the state API
    needs the dashboard, which this cluster runs without)."""
    from ray._private.state import actors

    return {a["Address"]["NodeID"] for a in actors().values() if a["State"] == "ALIVE"
            and ("Router" in a.get("ActorClassName", "") or a.get("Name") == BALANCER_NAME)}  # fmt: skip


def _lose(rn, node) -> int:
    rn.remove_node(node, allow_graceful=False)
    return 0


@pytest.mark.parametrize("role", ["attention", "expert"])
def test_a_whole_node_lost_under_streams(nodes, cluster, expected, role):
    rn, roles = nodes
    assert _control_plane_nodes() == {rn.head_node.node_id}  # (control_resources)
    victim = roles[role].pop(0)
    outcome = scenario.run(cluster.url, f"{role} node lost", lambda: _lose(rn, victim),
                           requests=REQUESTS, max_tokens=MAX_TOKENS)  # fmt: skip
    print(
        f"{role} node lost: {outcome.seconds:.1f}s, lost {outcome.lost}, longest stall {outcome.stall_s():.2f}s"
    )
    assert outcome.errors == [None] * REQUESTS
    assert outcome.finish_reasons == ["length"] * REQUESTS  # (none ended silently)
    assert outcome.tokens == expected
