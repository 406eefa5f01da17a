"""`ExpertWorker`: the Ray actor that hosts one expert worker's gRPC server.

Ray only starts it, asks for its address and stops it (control plane); Dispatch traffic goes to
the gRPC server directly (data plane), whose own threads run the expert compute and weight
loading.

    worker = ExpertWorker.options(num_cpus=0).remote(ExpertWorkerConfig(model=dir))
    address = ray.get(worker.start.remote())      # "10.0.0.5:43121"
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

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
        peers = None if cfg.namespace is None else ClusterPeers(cfg.namespace)
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


class ClusterPeers:
    """Which addresses are the cluster's own expert workers (the named actors the balancer started
    in `namespace`, this worker aside): the only peers LoadSlots may copy experts from.

    Each worker's address is asked once and kept while Ray still lists its name, so a check asks
    only workers it has not met: a hung worker met before costs nothing (the heal that replaces it
    names peers while it is still frozen), and an unmet one is waited for at most `timeout_s`."""

    def __init__(self, namespace: str, timeout_s: float = 5.0):
        self.namespace, self.timeout_s = namespace, timeout_s
        self.addresses: dict[str, str] = {}  # actor name -> its gRPC address

    def __call__(self, wanted: set[str]) -> set[str]:
        """The addresses of `wanted` that are expert workers of the cluster."""
        me = ray.get_runtime_context().get_actor_name()
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and EXPERT_WORKER_NAME.match(a["name"]) and a["name"] != me}  # fmt: skip
        self.addresses = {n: a for n, a in self.addresses.items() if n in names}  # (gone: forgotten)
        if not wanted <= set(self.addresses.values()):
            self._learn(names - set(self.addresses), wanted)
        return wanted & set(self.addresses.values())

    def _learn(self, names: set[str], wanted: set[str]) -> None:
        """Ask workers `names` for their addresses until every `wanted` one is known, or for
        `timeout_s` (a worker still starting, pending or hung is left to the next check)."""
        refs = {}
        for name in names:
            try:
                refs[ray.get_actor(name, namespace=self.namespace).address.remote()] = name
            except ValueError:  # (gone meanwhile)
                continue
        deadline = time.monotonic() + self.timeout_s
        while refs and not wanted <= set(self.addresses.values()) and time.monotonic() < deadline:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                name = refs.pop(ref)
                with contextlib.suppress(ray.exceptions.RayError):  # (died meanwhile)
                    if (address := ray.get(ref)) is not None:
                        self.addresses[name] = address
