"""The Ray side of attention tensor parallelism: the follower rank actors of one attention worker.

An attention worker with `tp` > 1 is rank 0 of its group; it starts ranks 1..tp-1 as
`AttentionRank` actors pinned to its own node (node affinity: the group shares a machine, its
collectives stay off the network) and owned by it, so that they die with it. Each follower
loads the attention side of the model with its slice of the heads, allocates its own replica of
the latent cache and runs `tensor_parallel.follow` until rank 0 stops it. A follower that dies
takes the group down: rank 0 exits, Ray restarts it (the attention worker's `max_restarts`),
and the restarted rank 0 starts a new group; the router moves its requests meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from services.engine.engine import EngineConfig
from services.net import free_port

from .tensor_parallel import Follower, TPGroup

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=4)
class AttentionRank:
    """Follower rank `rank` of an attention worker's tensor-parallel group."""

    def __init__(self, engine_cfg: EngineConfig, rank: int, tp: int, init_method: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.follower = Follower(engine_cfg, rank, tp, init_method)

    def serve(self) -> int:
        """Run the steps rank 0 broadcasts until it stops the group; returns how many ran."""
        return self.follower.run()

    def info(self) -> dict:
        return {
            "rank": self.follower.rank,
            "pid": os.getpid(),
            "kv_cache_bytes": self.follower.cache.nbytes,
        }

    def pid(self) -> int:
        return os.getpid()


class RankGroup:
    """Rank 0's view of its followers: starts them, joins the group, watches them."""

    def __init__(self, engine_cfg: EngineConfig, tp: int, gpus: float = 0.0):
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        node = ray.get_runtime_context().get_node_id()
        self.followers = [
            AttentionRank.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), num_gpus=gpus
            ).remote(engine_cfg, rank, tp, init_method)
            for rank in range(1, tp)
        ]
        self.group = TPGroup(0, tp, init_method, engine_cfg.device)  # returns once every rank joined
        self._serving = [f.serve.remote() for f in self.followers]
        self._stopping = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """A follower that ends without being asked to (it died) takes the group down."""
        ray.wait(self._serving, num_returns=1, timeout=None)
        if not self._stopping:
            log.error("a tensor-parallel rank of this attention worker died; restarting the group")
            os._exit(1)

    def info(self) -> list[dict]:
        return ray.get([f.info.remote() for f in self.followers], timeout=30)

    def stop(self) -> None:
        self._stopping = True
        self.group.stop()
        ray.get(self._serving, timeout=30)
        self.group.close()
