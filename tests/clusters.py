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
