"""Bring the whole cluster up (and down): Ray, Redis, expert workers + balancer, attention
workers, and the Ray Serve router. Used by `moe-cluster up` and by the cluster tests.

    cluster = Cluster.start(ClusterConfig(model="/path/to/ckpt", expert_workers=2))
    ...  # OpenAI API on cluster.url
    cluster.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray
import yaml

from services.balancer.autoscale import AttentionScaleConfig, AutoscaleConfig
from services.dataplane.transport import TRANSPORTS
from services.settings import BALANCER_NAME, NAMESPACE, SharedSettings, attention_worker_name

log = logging.getLogger(__name__)

APP_NAME = "moe-cluster"  # the Serve application


def _setting(default, help: str):
    """A ClusterConfig field; `help` documents it in YAML and as a `moe-cluster up` flag."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ClusterConfig:
    """Everything `moe-cluster up` needs; the same keys in a YAML file (`--config`). Every scalar
    field is also a flag of `moe-cluster up` (max_num_seqs -> --max-num-seqs)."""

    model: str | None = _setting(None, "checkpoint directory (default: generate the tiny preset)")
    served_model_name: str | None = _setting(
        None, "model name in the API (default: the checkpoint dir's name)"
    )
    address: str | None = _setting(None, "Ray cluster address to join (default: start a local one)")
    host: str = _setting("127.0.0.1", "HTTP host of the OpenAI API")
    port: int = _setting(8000, "HTTP port of the OpenAI API")
    attention_workers: int = _setting(1, "attention workers (data parallel)")
    expert_workers: int = _setting(2, "expert workers (the start, when the pool autoscales)")
    min_expert_workers: int | None = _setting(
        None, "autoscaling: fewest expert workers (default: expert_workers)"
    )
    max_expert_workers: int | None = _setting(
        None, "autoscaling: most expert workers (default: expert_workers); min < max turns it on"
    )
    expert_target_utilization: float = _setting(0.6, "autoscaling: busy fraction each expert worker aims at")
    expert_upscale_delay_s: float = _setting(
        30.0, "autoscaling: a larger pool wanted this long before it grows"
    )
    expert_downscale_delay_s: float = _setting(
        120.0, "autoscaling: a smaller pool wanted this long before it shrinks"
    )
    min_attention_workers: int | None = _setting(
        None, "autoscaling: fewest attention workers (default: attention_workers)"
    )
    max_attention_workers: int | None = _setting(
        None, "autoscaling: most attention workers (default: attention_workers); min < max turns it on"
    )
    attention_kv_threshold: float = _setting(
        0.8, "autoscaling: KV cache use that saturates an attention worker"
    )
    attention_queue_threshold: int = _setting(
        5, "autoscaling: waiting requests that saturate an attention worker"
    )
    attention_upscale_delay_s: float = _setting(
        30.0, "autoscaling: a larger attention pool wanted this long before it grows"
    )
    attention_downscale_delay_s: float = _setting(
        120.0, "autoscaling: a smaller attention pool wanted this long before it shrinks (drain, then stop)"
    )
    redundant_experts: int = _setting(0, "extra expert slots per MoE layer (replicas of hot experts)")
    expert_spare_rows: int = _setting(
        0,
        "expert rows per MoE layer each expert worker reserves for a re-plan's moved experts (see docs/experts.md)",
    )
    redis_url: str | None = _setting(None, "external Redis (default: an embedded redis-server)")
    key_prefix: str = _setting("moe", "prefix of every Redis key")
    dtype: str = _setting("float32", "weights and activations: float32, bfloat16, float16")
    weight_dtype: str | None = _setting(
        None, "bfloat16: hold linear and expert weights in bf16 under float32 on CPU (half the memory)"
    )
    keep_fp8_experts: bool = _setting(
        False, "FP8 checkpoints: the expert workers hold the routed experts in FP8 with their block scales"
    )
    keep_fp8_linears: bool = _setting(
        False, "FP8 checkpoints: the attention workers hold the linears in FP8 with their block scales"
    )
    max_num_seqs: int = _setting(64, "sequences per step, per attention worker")
    max_num_batched_tokens: int = _setting(2048, "tokens per step, per attention worker")
    max_model_len: int | None = _setting(None, "context length (default: min(model's, 4096))")
    max_waiting: int = _setting(512, "queued requests per attention worker before HTTP 429")
    kv_cache_gib: float = _setting(2.0, "latent KV cache per attention worker, GiB (at most)")
    kv_cache_dtype: str = _setting(
        "auto", "latent cache rows: auto (the model dtype) or fp8 (FlashMLA's FP8 rows: V3 656 B/token/layer)"
    )
    micro_batches: int = _setting(
        1, "2 = ping-pong micro-batches (pays when experts have their own cores/GPUs)"
    )
    prefix_caching: bool = _setting(
        True, "reuse cached prompt-prefix blocks; send requests to the worker holding their prefix"
    )
    attention_tp: int = _setting(
        1, "tensor-parallel ranks per attention worker (heads split, latent cache replicated)"
    )
    attention_threads: int = _setting(1, "torch threads per attention worker")
    router_replicas: int = _setting(
        2, "Ray Serve replicas of the OpenAI router (a client's retry finds a live one when one dies)"
    )
    expert_secret: str | None = _setting(
        None,
        "the data plane's shared secret: expert calls without it are refused (default: a new random one per up)",
    )
    expert_transport: str = _setting(
        "auto",
        "attention <-> expert data plane, chosen once per pair: auto (shared memory on one node, else TCP, else "
        "gRPC streams), shm, tcp, grpc",
    )
    expert_spin_us: float = _setting(
        0.0,
        "shared-memory data plane: both sides poll this many microseconds for the other's message before they "
        "block (~7 us round trips instead of ~70; pays only where every worker has cores of its own)",
    )
    expert_threads: int = _setting(1, "torch threads per expert worker")
    expert_concurrency: int = _setting(
        1, "Dispatches an expert worker computes at once (each with expert_threads threads; 1: in turn)"
    )
    balancer_period_s: float = _setting(30.0, "seconds between rebalancing checks (0: on demand only)")
    balancer_window_buckets: int = _setting(15, "load window, in buckets")
    balancer_bucket_seconds: float = _setting(2.0, "width of one load bucket")
    balancer_min_gain: float = _setting(0.02, "balancedness gain needed to migrate experts")
    api_key: str | None = _setting(None, "require this bearer token on the API")
    num_cpus: int | None = _setting(None, "logical CPUs of a local Ray cluster (default: max(4, cores))")
    attention_gpus: float = _setting(0.0, "GPUs per attention worker and per TP rank (> 0: computes on CUDA)")
    expert_gpus: float = _setting(0.0, "GPUs per expert worker (> 0: computes on CUDA; 0.5: two per GPU)")
    attention_resources: dict[str, float] = _setting({}, "Ray resources each attention worker needs")
    expert_resources: dict[str, float] = _setting({}, "Ray resources each expert worker needs")
    control_resources: dict[str, float] = _setting(
        {}, "Ray resources each router replica and the balancer need ({head_node: 1}: on a head offering it)"
    )
    namespace: str = _setting(NAMESPACE, "Ray namespace of the cluster's actors")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        return cls.from_dict({**data, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cluster settings: {', '.join(unknown)}")
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.attention_tp < 1:
            raise ValueError("attention_tp must be >= 1")
        if self.attention_workers < 1 or self.expert_workers < 1:
            raise ValueError("need at least one attention worker and one expert worker")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: auto or fp8")
        if self.attention_gpus < 0 or self.expert_gpus < 0:
            raise ValueError("attention_gpus and expert_gpus must be >= 0")
        if self.redundant_experts < 0 or self.expert_spare_rows < 0:
            raise ValueError("redundant_experts and expert_spare_rows must be >= 0")
        if self.expert_concurrency < 1:
            raise ValueError("expert_concurrency must be >= 1")
        if not 0 <= self.expert_spin_us <= 1e6:
            raise ValueError(f"expert_spin_us {self.expert_spin_us}: 0 to 1e6 microseconds")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        self.autoscale(), self.attention_autoscale()  # check the autoscaling bounds
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.expert_transport not in TRANSPORTS:
            raise ValueError(f"expert_transport {self.expert_transport!r}: one of {', '.join(TRANSPORTS)}")
        if self.keep_fp8_linears and self.attention_tp > 1:
            raise ValueError(
                "keep_fp8_linears with attention_tp > 1 (attention tensor parallelism): not supported yet"
            )
        from services.model.config import check_weight_dtype, parse_dtype  # (torch: not at import time)

        for gpus in (self.attention_gpus, self.expert_gpus):
            check_weight_dtype(self.weight_dtype, parse_dtype(self.dtype), "cuda" if gpus > 0 else "cpu")
        shared = self.shared(None)  # checks the shared settings
        if self.balancer_window_buckets * shared.bucket_seconds > shared.ttl_seconds:
            raise ValueError(
                f"the load window ({self.balancer_window_buckets} x {shared.bucket_seconds}s) is longer than "
                f"the load buckets live ({shared.ttl_seconds}s)"
            )

    def autoscale(self) -> AutoscaleConfig | None:
        """The expert pool's autoscaling (balancer/autoscale.py), or None with min == max."""
        lo, hi = (
            self.min_expert_workers or self.expert_workers,
            self.max_expert_workers or self.expert_workers,
        )
        cfg = AutoscaleConfig(lo, hi, self.expert_target_utilization, self.expert_upscale_delay_s,
                              self.expert_downscale_delay_s)  # fmt: skip
        if not lo <= self.expert_workers <= hi:
            raise ValueError(
                f"expert_workers {self.expert_workers} outside [{lo}, {hi}] (min/max_expert_workers)"
            )
        return cfg if cfg.enabled else None

    def attention_autoscale(self) -> AttentionScaleConfig:
        """The attention pool's autoscaling (balancer/autoscale.py; enabled when min < max)."""
        lo = self.min_attention_workers or self.attention_workers
        hi = self.max_attention_workers or self.attention_workers
        if not lo <= self.attention_workers <= hi:
            raise ValueError(
                f"attention_workers {self.attention_workers} outside [{lo}, {hi}] (min/max_attention_workers)"
            )
        return AttentionScaleConfig(lo, hi, self.attention_kv_threshold, self.attention_queue_threshold,
                                    self.attention_upscale_delay_s, self.attention_downscale_delay_s)  # fmt: skip

    def shared(self, redis_url: str | None, secret: str | None = None) -> SharedSettings:
        """The settings every service of this cluster shares (with the Redis actually used and the
        data-plane secret: `expert_secret`, else the one given, made by `Cluster.start`)."""
        return SharedSettings(namespace=self.namespace, redis_url=redis_url, key_prefix=self.key_prefix,
                              bucket_seconds=self.balancer_bucket_seconds,
                              secret=self.expert_secret or secret)  # fmt: skip


def check_gpus(cfg: ClusterConfig, available: float, autoscaling: bool) -> None:
    """The GPUs the workers ask for (attention_gpus / expert_gpus) against the Ray cluster's: on a
    Ray cluster this process started, too few is an error (the workers would wait forever);
    on a joined cluster a warning (an autoscaler may add GPU nodes)."""
    needed = (
        cfg.attention_workers * cfg.attention_tp * cfg.attention_gpus + cfg.expert_workers * cfg.expert_gpus
    )
    if needed <= available + 1e-9:
        return
    msg = (f"the workers ask for {needed:g} GPUs (attention_gpus={cfg.attention_gpus:g}, expert_gpus="
           f"{cfg.expert_gpus:g}) and the Ray cluster has {available:g}")  # fmt: skip
    if not autoscaling:
        raise ValueError(msg + ": set attention_gpus / expert_gpus to 0 to compute on CPU")
    log.warning("%s; the workers wait until GPU nodes join", msg)


@dataclass
class Backend:
    """The Ray actors behind the router: the balancer (owning the expert workers) and the
    attention workers, all named in `cfg.namespace`."""

    model_dir: str
    balancer: Any
    attention: dict[str, Any]
    max_model_len: int
    placement_version: int


def _data_plane_secret(cfg: ClusterConfig, reuse: bool) -> str:
    """`expert_secret`, else (re-deploying beside a running balancer) the running cluster's, else a
    new random one."""
    import secrets

    if cfg.expert_secret:
        return cfg.expert_secret
    if reuse:
        try:
            running = ray.get(ray.get_actor(BALANCER_NAME, namespace=cfg.namespace).data_plane_secret.remote(),
                              timeout=30)  # fmt: skip
        except (ValueError, ray.exceptions.RayError):  # no balancer running yet
            running = None
        if running:
            return running
    return secrets.token_urlsafe(32)


def start_backend(
    cfg: ClusterConfig,
    model_dir: str,
    redis_url: str,
    reuse: bool = False,
    step=log.info,
    loopback: bool = False,
) -> Backend:
    """Start (or, with `reuse`, find already running: `serve deploy` / KubeRay re-deploys) the
    balancer + expert workers and the attention workers.

    Lifetimes: every actor is detached (owned by Ray itself, so none dies with the process that
    started it or with another service) and named in the namespace. The balancer and the
    attention workers restart in place (`max_restarts=-1`) and re-attach by name; expert workers
    are not restarted in place: the balancer re-plans a dead worker's experts onto the others and
    starts a fresh worker under a new name. `loopback`: the expert workers listen on 127.0.0.1
    only (a local run: every process on this machine)."""
    shared = cfg.shared(redis_url, _data_plane_secret(cfg, reuse))
    lifetime = {"lifetime": "detached", "max_restarts": -1, "get_if_exists": reuse}
    created: list = []  # what this call started, stopped again if the start fails
    try:
        return _start_backend(cfg, model_dir, shared, lifetime, created, step, loopback)
    except BaseException:
        if not reuse:
            _stop_actors(created)
        raise


def _stop_actors(actors: list) -> None:
    """Best effort: shut down and kill these actors (a balancer stops its expert workers)."""
    for actor in reversed(actors):
        with contextlib.suppress(Exception):
            ray.get(actor.shutdown.remote(), timeout=30)
        with contextlib.suppress(Exception):
            ray.kill(actor)


def _start_backend(cfg: ClusterConfig, model_dir: str, shared: SharedSettings, lifetime: dict, created: list,
                   step, loopback: bool) -> Backend:  # fmt: skip
    from services.attention.worker import AttentionWorker, AttentionWorkerConfig
    from services.balancer.actor import Balancer
    from services.balancer.attention_pool import AttentionScaling
    from services.balancer.service import BalancerConfig
    from services.engine.engine import EngineConfig

    engine = EngineConfig(
        model=model_dir,
        dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
        keep_fp8_linears=cfg.keep_fp8_linears,
        device="cuda" if cfg.attention_gpus > 0 else "cpu",
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        max_waiting=cfg.max_waiting,
        kv_cache_gib=cfg.kv_cache_gib,
        kv_cache_dtype=cfg.kv_cache_dtype,
        micro_batches=cfg.micro_batches,
        prefix_caching=cfg.prefix_caching,
        num_threads=cfg.attention_threads,
    )
    template = AttentionWorkerConfig(engine=engine, worker_id="", tp=cfg.attention_tp, shared=shared,
                                     gpus=cfg.attention_gpus, expert_transport=cfg.expert_transport,
                                     expert_spin_us=cfg.expert_spin_us)  # fmt: skip
    step(f"starting {cfg.expert_workers} expert workers and loading the placement")
    balancer = Balancer.options(
        name=BALANCER_NAME, namespace=shared.namespace, resources=cfg.control_resources or None, **lifetime
    ).remote(
        BalancerConfig(
            model=model_dir,
            expert_workers=cfg.expert_workers,
            redundant_experts=cfg.redundant_experts,
            shared=shared,
            period_s=cfg.balancer_period_s,
            window_buckets=cfg.balancer_window_buckets,
            min_gain=cfg.balancer_min_gain,
            expert_dtype=cfg.dtype,
            expert_weight_dtype=cfg.weight_dtype,
            expert_keep_fp8=cfg.keep_fp8_experts,
            expert_spare_rows=cfg.expert_spare_rows,
            expert_threads=cfg.expert_threads,
            expert_concurrency=cfg.expert_concurrency,
            expert_resources=cfg.expert_resources,
            expert_gpus=cfg.expert_gpus,
            expert_shm=cfg.expert_transport in ("auto", "shm"),  # (grpc: no shared-memory listener at all)
            expert_spin_us=cfg.expert_spin_us,
            autoscale=cfg.autoscale(),
            attention=AttentionScaling(
                cfg.attention_autoscale(), template, cfg.attention_resources, cfg.attention_gpus
            ),  # fmt: skip
            # a local run (this process started Ray: one machine): expert ports on loopback only
            expert_host="127.0.0.1" if loopback else None,
        )
    )
    created.append(balancer)
    info = ray.get(balancer.start.remote())

    step(f"starting {cfg.attention_workers} attention workers")
    attention = {}
    for i in range(cfg.attention_workers):
        name = attention_worker_name(i)
        attention[name] = AttentionWorker.options(
            name=name, namespace=shared.namespace, resources=cfg.attention_resources or None,
            num_gpus=cfg.attention_gpus, **lifetime,
        ).remote(dataclasses.replace(template, worker_id=name), info["placement"], info["addresses"])  # fmt: skip
        created.append(attention[name])
    ready = ray.get([a.ready.remote() for a in attention.values()])
    ray.get(balancer.register_attention.remote(list(attention)))
    return Backend(model_dir, balancer, attention, ready[0]["max_model_len"], info["placement"]["version"])


def router_app(cfg: ClusterConfig, backend: Backend):
    """The Serve application of the OpenAI router: `router_replicas` replicas, each needing
    `control_resources` (none: anywhere, as the Router deployment's own 0 CPUs)."""
    from services.router.app import Router

    options = {"num_cpus": 0} | ({"resources": cfg.control_resources} if cfg.control_resources else {})
    return Router.options(num_replicas=cfg.router_replicas, ray_actor_options=options).bind(
        router_config(cfg, backend)
    )


def router_config(cfg: ClusterConfig, backend: Backend):
    from services.router.core import RouterConfig

    return RouterConfig(
        model_dir=backend.model_dir,
        served_model_name=cfg.served_model_name or Path(backend.model_dir).name,
        attention_workers=list(backend.attention),
        namespace=cfg.namespace,
        balancer=BALANCER_NAME,
        api_key=cfg.api_key,
        max_model_len=backend.max_model_len,
        prefix_caching=cfg.prefix_caching,
    )


def resolve_model(cfg: ClusterConfig) -> str:
    from services.presets import default_model_dir

    return str(Path(cfg.model).resolve()) if cfg.model else str(default_model_dir("tiny"))


@dataclass
class Cluster:
    cfg: ClusterConfig
    model_dir: str
    url: str
    redis: Any  # EmbeddedRedis or None
    redis_url: str
    balancer: Any
    attention: dict[str, Any]
    started_ray: bool

    @classmethod
    def start(cls, cfg: ClusterConfig, progress=None) -> Cluster:
        from ray import serve

        from services.redis_store import EmbeddedRedis

        step = progress or (lambda msg: log.info(msg))
        model_dir = resolve_model(cfg)

        step("starting Ray")
        started_ray = not ray.is_initialized()
        if started_ray:
            if cfg.address:
                ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False)
            else:
                ray.init(address="local", num_cpus=cfg.num_cpus or max(4, os.cpu_count() or 1), namespace=cfg.namespace,
                         include_dashboard=False, log_to_driver=False)  # fmt: skip
        redis = None
        try:
            check_gpus(cfg, ray.cluster_resources().get("GPU", 0.0), autoscaling=bool(cfg.address))
            redis_url = cfg.redis_url
            if not redis_url and cfg.address:
                log.warning("joining a Ray cluster with an embedded Redis on 127.0.0.1: attention workers on "
                            "other machines cannot report loads (no rebalancing); pass --redis-url")  # fmt: skip
            if not redis_url:
                step("starting embedded Redis")
                redis = EmbeddedRedis.start()
                redis_url = redis.url
            backend = start_backend(
                cfg, model_dir, redis_url, step=step, loopback=started_ray and not cfg.address
            )

            step(f"starting the OpenAI API on http://{cfg.host}:{cfg.port}")
            serve.start(http_options={"host": cfg.host, "port": cfg.port}, detached=False)
            serve.run(
                router_app(cfg, backend),
                name=APP_NAME,
                route_prefix="/",
                blocking=False,
            )
            url = f"http://{cfg.host}:{cfg.port}"
            cluster = cls(
                cfg, model_dir, url, redis, redis_url, backend.balancer, backend.attention, started_ray
            )
            cluster.wait_ready()
        except BaseException:  # a failed or interrupted start (Ctrl-C) leaves nothing running behind
            if redis is not None:
                redis.stop()
            if started_ray:
                ray.shutdown()
            raise
        log.info("cluster up: %s (placement v%d)", url, backend.placement_version)
        return cluster

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:  # (the standard library: a user's install has no httpx)
                with urllib.request.urlopen(f"{self.url}/ready", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (OSError, http.client.HTTPException):  # (not yet listening, an HTTP error, cut off)
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}/ready did not answer 200 within {timeout}s")
            time.sleep(0.2)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Refuse new requests (HTTP 503) and wait, at most `timeout_s`, until the attention
        workers have finished every request they hold; True if they did."""
        from ray import serve

        deadline = time.monotonic() + timeout_s
        try:
            handle, drained = serve.get_app_handle(APP_NAME), set()
            while len(drained) < self.cfg.router_replicas and time.monotonic() < deadline:  # (every replica:
                drained.add(handle.drain.remote().result(timeout_s=timeout_s))  # a call reaches one of them)
            while time.monotonic() < deadline:
                busy = 0
                for actor in self._attention_workers().values():
                    try:
                        s = ray.get(actor.stats.remote(), timeout=10)
                        busy += s["running"] + s["waiting"]
                    except Exception:  # a dead worker holds nothing (its requests moved)
                        pass
                if not busy:
                    return True
                time.sleep(0.1)
        except Exception as e:  # the app or a worker is gone already: nothing left to wait for
            log.warning("drain: %s", e)
        return False

    def _attention_workers(self) -> dict[str, Any]:
        """The attention workers now (the balancer's list: the pool may have grown), else those
        this cluster started with."""
        with contextlib.suppress(Exception):
            pool = ray.get(self.balancer.attention_workers.remote(), timeout=10)
            names = [*pool["serving"], *pool["draining"]]
            return {n: self.attention.get(n) or ray.get_actor(n, namespace=self.cfg.namespace) for n in names}
        return self.attention

    def stop(self, timeout: float = 60.0, drain_s: float = 30.0) -> None:
        """Drain (bounded by `drain_s`), then stop the app, the workers, Redis and (if this
        process started it) Ray. The graceful part runs under a deadline: after Ctrl-C, Ray's own
        processes may already be gone."""
        if drain_s > 0 and not self.drain(drain_s):
            log.warning("requests still running after %.0fs of draining; stopping anyway", drain_s)
        done = threading.Event()
        graceful = threading.Thread(target=self._stop_services, args=(done,), daemon=True)
        graceful.start()
        graceful.join(timeout)
        if not done.is_set():
            log.warning("graceful shutdown did not finish in %.0fs; stopping Ray", timeout)
        if self.redis is not None:
            self.redis.stop()
        if self.started_ray:
            ray.shutdown()

    def _stop_services(self, done: threading.Event) -> None:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        for actor in self._attention_workers().values():
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            ray.get(self.balancer.shutdown.remote(), timeout=30)
        with contextlib.suppress(Exception):
            ray.kill(self.balancer)
        kill_named_actors(self.cfg.namespace)  # detached: whatever of ours is left (the balancer was down?)
        done.set()


def kill_named_actors(namespace: str) -> None:
    """Kill this cluster's detached actors (balancer, attention and expert workers) in `namespace`."""
    with contextlib.suppress(Exception):
        for info in ray.util.list_named_actors(all_namespaces=True):
            if info["namespace"] == namespace and info["name"].startswith("moe-"):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(info["name"], namespace=info["namespace"]))


def connect(address: str = "auto", namespace: str = NAMESPACE):
    """Attach to a running cluster; returns the balancer handle."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    return ray.get_actor(BALANCER_NAME, namespace=namespace)
