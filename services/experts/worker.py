"""`ExpertWorker`: the Ray actor that hosts one expert worker's gRPC server.

Ray only starts it, asks for its address and stops it (control plane); Dispatch traffic goes to
the gRPC server directly (data plane), whose own threads run the expert compute and weight
loading.

    worker = ExpertWorker.options(num_cpus=0).remote(ExpertWorkerConfig(model=dir))
    address = ray.get(worker.start.remote())      # "10.0.0.5:43121"
"""

from __future__ import annotations

import logging
import os

import ray
import torch

from .server import ExpertServer, ExpertWorkerConfig


@ray.remote(num_cpus=0)
class ExpertWorker:
    def __init__(self, cfg: ExpertWorkerConfig):
        logging.basicConfig(level=logging.INFO)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.server = ExpertServer(cfg, host=cfg.host or ray.util.get_node_ip_address())

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
