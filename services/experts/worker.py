"""`ExpertWorker`: the Ray actor that hosts one expert worker's gRPC server.

Ray only starts it, asks for its address and stops it (control plane); Dispatch traffic goes to
the gRPC server directly (data plane), whose own threads run the expert compute and weight
loading.

    worker = ExpertWorker.options(num_cpus=0).remote(ExpertWorkerConfig(model=dir))
    address = ray.get(worker.start.remote())      # "10.0.0.5:43121"
"""

from __future__ import annotations

import functools
import logging
import os

import ray
import torch

from services.gpus import limit_gpu_memory
from services.settings import EXPERT_WORKER_NAME

from .server import ExpertServer, ExpertWorkerConfig


@ray.remote(num_cpus=0)
class ExpertWorker:
    def __init__(self, cfg: ExpertWorkerConfig):
        logging.basicConfig(level=logging.INFO)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        limit_gpu_memory()  # (part of a shared GPU: held to its share)
        peers = None if cfg.namespace is None else functools.partial(cluster_expert_addresses, cfg.namespace)
        self.server = ExpertServer(cfg, host=cfg.host or ray.util.get_node_ip_address(), known_peers=peers)

    def start(self) -> str:
        """Start the gRPC server (idempotent); returns its "host:port"."""
        return self.server.start()

    def address(self) -> str | None:
        return self.server.address

    def pid(self) -> int:
        """The worker's process id (fault tests kill it)."""
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker runs on (EPLB's "node" of its slots)."""
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self.server.stop()


def cluster_expert_addresses(namespace: str, timeout_s: float = 5.0) -> set[str]:
    """The gRPC addresses of the live expert workers named in `namespace` (the named actors the
    balancer started), this worker's own aside: the only peers LoadSlots may copy experts from.
    A worker that does not answer within `timeout_s` (still starting, or pending) is left out."""
    me = ray.get_runtime_context().get_actor_name()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == namespace and EXPERT_WORKER_NAME.match(a["name"]) and a["name"] != me]  # fmt: skip
    refs = []
    for name in names:
        try:
            refs.append(ray.get_actor(name, namespace=namespace).address.remote())
        except ValueError:  # (gone meanwhile)
            continue
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    addresses = set()
    for ref in ready:
        try:
            addresses.add(ray.get(ref))
        except ray.exceptions.RayError:  # (died meanwhile)
            continue
    return addresses - {None}
