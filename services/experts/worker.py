"""`ExpertWorker`: the Ray actor that hosts one expert worker's gRPC server.

Ray only starts it, asks for its address and stops it (control plane); Dispatch traffic goes to
the gRPC server directly (data plane). The actor is async: the grpc.aio server runs on the
actor's event loop, expert compute and weight loading run in the servicer's threads.

    worker = ExpertWorker.options(num_cpus=0).remote(ExpertWorkerConfig(model=dir))
    address = ray.get(worker.start.remote())      # "10.0.0.5:43121"
"""

from __future__ import annotations

import logging

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

    async def start(self) -> str:
        """Start the gRPC server (idempotent); returns its "host:port"."""
        return await self.server.start()

    async def address(self) -> str | None:
        return self.server.address

    async def node_id(self) -> str:
        """The Ray node this worker runs on (EPLB's "node" of its slots)."""
        return ray.get_runtime_context().get_node_id()

    async def stop(self) -> None:
        await self.server.stop()
