"""`Cluster.start` that fails or is interrupted (Ctrl-C) part way leaves nothing running: the
embedded Redis (its own session, so a terminal's Ctrl-C never reaches it) is stopped and the Ray
instance it started is shut down."""

import pytest
import ray

import services.cluster as cluster_mod
from services import redis_store
from services.net import free_port


@pytest.mark.cluster
def test_interrupted_start_leaves_nothing_running(tiny_model, monkeypatch):
    assert not ray.is_initialized(), "this test starts its own Ray instance"
    started = []

    def start_redis(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    def interrupted_backend(*args, **kwargs):
        raise KeyboardInterrupt

    real_start = redis_store.EmbeddedRedis.start
    monkeypatch.setattr(redis_store.EmbeddedRedis, "start", start_redis)
    monkeypatch.setattr(cluster_mod, "start_backend", interrupted_backend)
    cfg = cluster_mod.ClusterConfig(model=str(tiny_model), port=free_port(), num_cpus=4)
    with pytest.raises(KeyboardInterrupt):
        cluster_mod.Cluster.start(cfg)
    assert len(started) == 1 and started[0].process.poll() is not None, "embedded Redis still running"
    assert not ray.is_initialized()
