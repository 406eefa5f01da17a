"""The expert worker's gRPC server: the Expert service (servicer.py) and the standard
grpc.health.v1 service on one grpc server, for one expert worker process; beside it the
shared-memory Dispatch for clients on the same node (services/dataplane/shm.py) and the TCP one for
clients on other nodes (services/dataplane/tcp.py), over the same compute.

A sync server: every call runs on a thread of the server's pool, the same hand-off a raw echo
handler pays, and the Dispatch compute happens right there (one at a time, see servicer.py).
Control calls (health, Stats, LoadSlots, FetchExperts) keep being answered on the other threads
while experts compute."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from services.dataplane import auth, shm, tcp, tls
from services.hf_models import ModelNotFound, ensure_local
from services.model.config import ModelConfig, check_weight_dtype, parse_dtype
from services.rpc import wire

from .servicer import ExpertServicer, add_expert_service, status_of
from .store import SlotStore

log = logging.getLogger(__name__)


@dataclass
class ExpertWorkerConfig:
    # checkpoint directory as seen on the worker's node. Its safetensors files are optional:
    # experts it lacks are copied from the LoadSlots peers. config.json is read from it unless
    # `model_config` is given.
    model: str
    dtype: str = "float32"  # compute dtype; Dispatch hidden states must come in this dtype
    weight_dtype: str | None = None  # experts held narrower than dtype: "bfloat16" under float32 on CPU
    keep_fp8_experts: bool = False  # an FP8 checkpoint's experts held as shipped, with their block scales
    deterministic: bool = False  # batch-invariant expert kernels (SharedSettings.deterministic)
    device: str = "cpu"  # where the experts are held and computed ("cuda": the GPU Ray gave the worker)
    num_threads: int | None = 1  # torch intra-op threads in the worker process (None: leave as is)
    compute_concurrency: int = (
        1  # Dispatches computed at once (each with num_threads threads): cores of its own
    )
    host: str | None = None  # None: the Ray node's IP inside an actor, else 127.0.0.1
    port: int = 0  # 0: an ephemeral port
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    max_versions: int = 3  # placement versions held at once (serving + loading)
    spare_rows: int = 0  # expert rows per layer beyond the first version's, for re-plans' moved experts
    max_concurrent_rpcs: int = 1024  # beyond this the server answers RESOURCE_EXHAUSTED
    rpc_threads: int = 16  # server threads: calls handled at once (queued beyond, up to the limit above)
    dispatch_streams: int = (
        64  # DispatchStream calls open at once (each holds a thread of its own, beyond rpc_threads)
    )
    # the parsed config.json (a dict, as `read_model_config` returns), for a node without the
    # checkpoint directory at all; None: read `model`/config.json on the worker's node
    model_config: dict | None = None
    peer_timeout_s: float = 600.0  # deadline of one FetchExperts stream from a peer
    # also serve Dispatch through shared memory to clients on this node (services/dataplane/shm.py)
    shm: bool = True
    spin_us: float = 0.0  # a shared-memory channel polls for its next request this long before it blocks
    # also serve Dispatch over plain TCP connections beside the gRPC port (services/dataplane/tcp.py)
    socket: bool = True
    # the cluster's data-plane secret (services/dataplane/auth.py): calls without it are refused; None: open
    secret: str | None = field(default=None, repr=False)
    # the Ray namespace the cluster's expert workers are named in: LoadSlots copies only from them
    # (None: any peer; a worker outside Ray)
    namespace: str | None = None


def read_model_config(model_dir: str | Path) -> dict:
    """config.json of `model_dir`, parsed (for `ExpertWorkerConfig.model_config`)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ExpertServer:
    """gRPC server (Expert + grpc.health.v1) for one expert worker."""

    def __init__(
        self,
        cfg: ExpertWorkerConfig,
        host: str = "127.0.0.1",
        known_peers: Callable[[set[str]], set[str]] | None = None,
    ):
        """`known_peers`: given the peers a LoadSlots names, those it may copy from (the Ray actor
        passes worker.ClusterPeers: the cluster's live expert workers); None: any peer."""
        with contextlib.suppress(ModelNotFound):  # (none here: its experts come from peers)
            cfg = dataclasses.replace(cfg, model=ensure_local(cfg.model))  # (a model id's snapshot)
        self.cfg = cfg
        self.host = cfg.host or host
        hf = cfg.model_config if cfg.model_config is not None else read_model_config(cfg.model)
        dtype, model_cfg = parse_dtype(cfg.dtype), ModelConfig.from_hf(hf)
        weight_dtype = check_weight_dtype(cfg.weight_dtype, dtype, cfg.device, model_cfg)
        self.store = SlotStore(model_cfg, cfg.model, dtype, cfg.max_versions, cfg.device,
                               weight_dtype, cfg.keep_fp8_experts, cfg.spare_rows,
                               deterministic=cfg.deterministic)  # fmt: skip
        self.servicer = ExpertServicer(
            self.store,
            peer_timeout_s=cfg.peer_timeout_s,
            max_message_bytes=cfg.max_message_bytes,
            secret=cfg.secret,
            known_peers=known_peers,
            dispatch_streams=cfg.dispatch_streams,
            compute_concurrency=cfg.compute_concurrency,
        )
        # refused calls and connections, every transport's, by reason (Stats carries them)
        self.refusals = auth.Refusals()
        self.servicer.refusals = self.refusals.counts
        self.secret_check = auth.SecretCheck(cfg.secret, self.refusals) if cfg.secret is not None else None
        self.health = HealthServicer()
        self.server: grpc.Server | None = None
        self.address: str | None = None
        self.shm: shm.ShmServer | None = None
        self.socket: tcp.TcpServer | None = None

    def start(self) -> str:
        """Bind and start; returns "host:port"."""
        if self.server is not None:
            return self.address
        server = grpc.server(
            ThreadPoolExecutor(
                self.cfg.rpc_threads + self.cfg.dispatch_streams, thread_name_prefix="expert-rpc"
            ),
            options=wire.grpc_options(self.cfg.max_message_bytes),
            maximum_concurrent_rpcs=self.cfg.max_concurrent_rpcs,
            interceptors=[self.secret_check] if self.secret_check is not None else None,
        )
        add_expert_service(server, self.servicer)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = tls.add_port(server, format_address(self.host, self.cfg.port), self.cfg.secret)
        if port == 0:
            raise RuntimeError(f"could not bind {format_address(self.host, self.cfg.port)}")
        server.start()
        for service in ("", wire.EXPERT_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.server, self.address = server, format_address(self.host, port)
        self.servicer.address = self.address
        if self.cfg.shm:
            try:
                self.shm = shm.ShmServer(
                    self.address,
                    self.servicer.compute_into,
                    status_of,
                    secret=self.cfg.secret,
                    spin_s=self.cfg.spin_us * 1e-6,
                    device=self.store.device,
                    refusals=self.refusals,
                )
            except OSError as e:  # (another process holds the name: clients use gRPC)
                log.warning("no shared-memory data plane on %s: %s", self.address, e)
        if self.cfg.socket:
            try:
                self.socket = tcp.TcpServer(self.host, self.servicer.compute_into, status_of, self.cfg.secret,
                                            refusals=self.refusals)  # fmt: skip
                self.servicer.socket_port = self.socket.port
            except OSError as e:  # (clients use gRPC)
                log.warning("no TCP data plane on %s: %s", self.host, e)
        log.info("expert worker serving %s on %s (%s)", self.cfg.model, self.address, self.cfg.dtype)
        return self.address

    def stop(self, grace: float | None = 1.0) -> None:
        if self.server is None:
            return
        self.health.enter_graceful_shutdown()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        self.server.stop(grace).wait()
        self.servicer.close()
        self.server = None


def main(argv: list[str] | None = None) -> None:
    """Run one expert worker outside Ray (debugging, benchmarks): prints its address, serves
    until killed. `python -m services.experts.server --model DIR [--port P] [--threads N]`."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weight-dtype", default=None, help="hold the experts in bfloat16 (float32 dtype, CPU)")
    ap.add_argument("--keep-fp8-experts", action="store_true", help="FP8 checkpoints: experts held in FP8")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--secret",
        default=os.environ.get("MOE_EXPERT_SECRET"),
        help="refuse calls without this data-plane secret (default: $MOE_EXPERT_SECRET)",
    )
    ap.add_argument(
        "--spin-us", type=float, default=0.0, help="shared memory: poll this long before blocking"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    server = ExpertServer(
        ExpertWorkerConfig(
            model=args.model,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            keep_fp8_experts=args.keep_fp8_experts,
            device=args.device,
            host=args.host,
            port=args.port,
            secret=args.secret,
            spin_us=args.spin_us,
        )
    )
    print(server.start(), flush=True)
    server.server.wait_for_termination()


if __name__ == "__main__":
    main()
