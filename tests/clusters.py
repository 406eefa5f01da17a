"""A real local cluster on the tiny checkpoint, for the cluster test modules."""

from contextlib import contextmanager

from services.net import free_port


@contextmanager
def tiny_cluster(model_dir, **settings):
    """Ray + embedded Redis + expert workers + attention worker + balancer + router, serving
    `model_dir` as "tiny" on a free port; `settings` are ClusterConfig fields. Stopped on exit."""
    from services.cluster import Cluster, ClusterConfig

    cluster = Cluster.start(
        ClusterConfig(model=str(model_dir), served_model_name="tiny", port=free_port(), **settings)
    )
    try:
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def expert_servers_in_process(model_dir, n: int = 2):
    """`n` expert servers (real gRPC, in this process, no Ray) holding the model's routed experts
    round robin, their placement loaded: yields (placement, model config); released on exit."""
    from services.dataplane.placement import Placement
    from services.experts.client import load_placement, release_version
    from services.experts.server import ExpertServer, ExpertWorkerConfig
    from services.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    servers = [ExpertServer(ExpertWorkerConfig(model=str(model_dir))) for _ in range(n)]
    try:
        workers = tuple(s.start() for s in servers)
        slots = -(-cfg.n_routed_experts // n)
        placement = Placement.round_robin(cfg.num_moe_layers, cfg.n_routed_experts, workers, slots)
        load_placement(placement, {a: a for a in workers}, cfg.moe_layers)
        yield placement, cfg
        release_version(placement.version, workers)
    finally:
        for s in servers:
            s.stop(0)
