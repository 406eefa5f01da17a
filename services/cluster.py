"""Bring the whole cluster up (and down): Ray, Redis, expert workers + balancer, attention
workers, and the Ray Serve router. Used by `moe-cluster up` and by the cluster tests.

    cluster = Cluster.start(ClusterConfig(model="/path/to/ckpt", expert_workers=2))
    ...  # OpenAI API on cluster.url
    cluster.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray
import yaml

from services.ray_control import check_ray_auth, join_ray, loopback_ray
from services.settings import (
    BALANCER_NAME,
    NAMESPACE,
    AttentionSettings,
    BalancerSettings,
    ExpertSettings,
    RouterSettings,
    SharedSettings,
    attention_worker_name,
    build_config,
    flat_key,
    setting,
    user_settings,
)

log = logging.getLogger(__name__)

APP_NAME = "moe-cluster"  # the Serve application
# a fenced (hung, SIGSTOPped) worker is killed 1 s after Ray's SIGTERM, not 5 s: a stopped process
# cannot act on SIGTERM, and its dispatch calls hold their steps until it is gone (deploy/ray-up-*:
# RAY_kill_worker_timeout_milliseconds)
RAY_SYSTEM_CONFIG = {"kill_worker_timeout_milliseconds": 1000}


def _section(cls: type) -> Any:
    """A ClusterConfig field holding one service's settings (services/settings.py)."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(init=False)
class ClusterConfig:
    """Everything `moe-cluster up` needs: the launcher's own settings below and one settings
    object per service (services/settings.py). Every setting has a flat key, the same in a YAML
    file (`--config`), in a Serve app's `args` and, for scalars, as a flag of `moe-cluster up`
    (max_num_seqs -> --max-num-seqs; `ClusterConfig.settings()` lists them). A YAML file may
    also nest settings by section (`attention: {tp: 2}`, the field names of the section).

    Built from flat keys, sections or both: `ClusterConfig(attention_tp=2)`,
    `ClusterConfig(attention=AttentionSettings(tp=2))`, `dataclasses.replace(cfg, attention_tp=2)`;
    `cfg.attention_tp` reads `cfg.attention.tp`."""

    model: str | None = setting(None, "checkpoint directory (default: generate the tiny preset)")
    address: str | None = setting(None, "Ray cluster address to join (default: start a local one)")
    num_cpus: int | None = setting(None, "logical CPUs of a local Ray cluster (default: max(4, cores))")
    allow_unauthenticated_ray: bool = setting(False, "join a Ray cluster without Ray's token auth")
    control_resources: dict[str, float] = setting(
        {}, "Ray resources each router replica and the balancer need ({head_node: 1}: on a head offering it)"
    )
    shared: SharedSettings = _section(SharedSettings)
    attention: AttentionSettings = _section(AttentionSettings)
    experts: ExpertSettings = _section(ExpertSettings)
    balancer: BalancerSettings = _section(BalancerSettings)
    router: RouterSettings = _section(RouterSettings)

    def __init__(self, **settings: Any) -> None:
        catalog, given, bases, unknown = self.settings(), {}, {}, []

        def put(where: tuple[str | None, str], value: Any, name: str) -> None:
            if where in given:
                raise ValueError(f"cluster setting {name} given twice (flat and in its section)")
            given[where] = value

        for key, value in settings.items():
            cls = _SECTIONS.get(key)
            if cls is not None and isinstance(value, cls):
                bases[key] = value
            elif cls is not None and isinstance(value, Mapping):
                names = {f.name for f in user_settings(cls)}
                for name, v in value.items():
                    if name in names:
                        put((key, name), v, f"{key}.{name}")
                    else:
                        unknown.append(f"{key}.{name}")
            elif key in catalog:
                s = catalog[key]
                put((s.section, s.name), value, key)
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"unknown cluster settings: {', '.join(sorted(unknown))}")
        for f in fields(self):
            cls = f.metadata.get("section")
            if cls is None:
                value = given.get((None, f.name), f.default if f.default_factory is dataclasses.MISSING
                                  else f.default_factory())  # fmt: skip
            else:
                changes = {name: v for (where, name), v in given.items() if where == f.name}
                value = dataclasses.replace(bases.get(f.name) or cls(), **changes)
            object.__setattr__(self, f.name, value)

    def __getattr__(self, name: str) -> Any:
        """A setting by its flat key: `cfg.attention_tp` is `cfg.attention.tp`."""
        s = None if name.startswith("_") else self.settings().get(name)
        if s is None or s.section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, s.section), s.name)

    def __setattr__(self, name: str, value: Any) -> None:
        s = self.settings().get(name)
        if s is not None and s.section is not None:
            raise AttributeError(f"{name} is {s.section}.{s.name}: dataclasses.replace(cfg, {name}=...)")
        object.__setattr__(self, name, value)

    @staticmethod
    def settings() -> dict[str, Setting]:
        """Every setting by flat key, in order: the launcher's, then each section's."""
        return _catalog()

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> ClusterConfig:
        """The settings in a YAML file, with `overrides` (flat keys; None: not given) over them."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        cfg = cls(**data)
        flags = {k: v for k, v in overrides.items() if v is not None}
        if flags:  # (over a key of the file, flat or nested)
            cfg = dataclasses.replace(cfg, **flags)
        cfg.validate()
        return cfg

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Each section checks its own settings (services/settings.py)."""
        self.shared.validate()
        for section in (self.attention, self.experts, self.balancer, self.router):
            section.validate(self.shared)


_SECTIONS = {f.name: f.metadata["section"] for f in fields(ClusterConfig) if "section" in f.metadata}


@dataclass(frozen=True)
class Setting:
    """One user setting of ClusterConfig."""

    key: str  # flat: the YAML key, the flag `--{key with -}`
    section: str | None  # the ClusterConfig field holding it (None: ClusterConfig's own)
    field: dataclasses.Field
    owner: type  # the dataclass declaring it

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def help(self) -> str:
        return self.field.metadata["help"]


@functools.cache
def _catalog() -> dict[str, Setting]:
    found = [Setting(flat_key(f), None, f, ClusterConfig) for f in user_settings(ClusterConfig)]
    for section, cls in _SECTIONS.items():
        found += [Setting(flat_key(f), section, f, cls) for f in user_settings(cls)]
    catalog = {s.key: s for s in found}
    clashes = sorted({s.key for s in found if catalog[s.key] is not s} | (set(catalog) & set(_SECTIONS)))
    if clashes:
        raise RuntimeError(f"cluster settings under the same flat key: {clashes}")
    return catalog


def check_gpus(cfg: ClusterConfig, available: float, autoscaling: bool) -> None:
    """The GPUs the workers ask for (attention_gpus / expert_gpus) against the Ray cluster's: on a
    Ray cluster this process started, too few is an error (the workers would wait forever);
    on a joined cluster a warning (an autoscaler may add GPU nodes)."""
    attention, experts = cfg.attention, cfg.experts
    needed = attention.workers * attention.tp * attention.gpus + experts.workers * experts.gpus
    if needed <= available + 1e-9:
        return
    msg = (f"the workers ask for {needed:g} GPUs (attention_gpus={attention.gpus:g}, expert_gpus="
           f"{experts.gpus:g}) and the Ray cluster has {available:g}")  # fmt: skip
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

    if cfg.shared.secret:
        return cfg.shared.secret
    if reuse:
        try:
            running = ray.get(ray.get_actor(BALANCER_NAME, namespace=cfg.shared.namespace).data_plane_secret.remote(),
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
    # the shared settings with the Redis actually used and the data-plane secret
    shared = dataclasses.replace(cfg.shared, redis_url=redis_url, secret=_data_plane_secret(cfg, reuse))
    created: list = []  # what this call started, stopped again if the start fails
    try:
        return _start_backend(cfg, model_dir, shared, reuse, created, step, loopback)
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


def _start_backend(cfg: ClusterConfig, model_dir: str, shared: SharedSettings, reuse: bool, created: list,
                   step, loopback: bool) -> Backend:  # fmt: skip
    from services.attention.worker import AttentionWorkerConfig
    from services.balancer.actor import Balancer
    from services.balancer.attention_pool import AttentionScaling, start_attention_worker
    from services.balancer.service import BalancerConfig

    if shared.speculative_tokens:  # (refused here, before any worker starts, as each engine would)
        from services.engine.speculative import check_speculation
        from services.model.config import ModelConfig

        check_speculation(ModelConfig.from_dir(model_dir), shared.speculative_tokens)
    worker = AttentionWorkerConfig.from_settings(cfg.attention, shared, model_dir)
    attention_pool = AttentionScaling.from_settings(cfg.attention, worker)
    step(f"starting {cfg.experts.workers} expert workers and loading the placement")
    balancer = Balancer.options(
        name=BALANCER_NAME, namespace=shared.namespace, resources=cfg.control_resources or None,
        lifetime="detached", max_restarts=-1, get_if_exists=reuse,
    ).remote(
        BalancerConfig(model=model_dir, experts=cfg.experts, settings=cfg.balancer, shared=shared,
                       attention=attention_pool,
                       # a local run (this process started Ray: one machine): expert ports on loopback only
                       expert_host="127.0.0.1" if loopback else None)
    )  # fmt: skip
    created.append(balancer)
    info = ray.get(balancer.start.remote())

    step(f"starting {cfg.attention.workers} attention workers")
    attention = {}
    for i in range(cfg.attention.workers):
        name = attention_worker_name(i)
        attention[name] = start_attention_worker(attention_pool, name, info["placement"], info["addresses"],
                                                 get_if_exists=reuse)  # fmt: skip
        created.append(attention[name])
    ready = ray.get([a.ready.remote() for a in attention.values()])
    ray.get(balancer.register_attention.remote(list(attention)))
    return Backend(model_dir, balancer, attention, ready[0]["max_model_len"], info["placement"]["version"])


def router_app(cfg: ClusterConfig, backend: Backend):
    """The Serve application of the OpenAI router: `router_replicas` replicas, each needing
    `control_resources` (none: anywhere, as the Router deployment's own 0 CPUs)."""
    from services.router.app import Router

    options = {"num_cpus": 0} | ({"resources": cfg.control_resources} if cfg.control_resources else {})
    return Router.options(num_replicas=cfg.router.replicas, ray_actor_options=options).bind(
        router_config(cfg, backend)
    )


def router_config(cfg: ClusterConfig, backend: Backend):
    """The router's config: the router settings named like its fields, and what the backend has."""
    from services.router.core import RouterConfig

    return build_config(
        RouterConfig, cfg.router,
        served_model_name=cfg.router.served_model_name or Path(backend.model_dir).name,
        model_dir=backend.model_dir, attention_workers=list(backend.attention), namespace=cfg.shared.namespace,
        balancer=BALANCER_NAME, max_model_len=backend.max_model_len,
        prefix_caching=cfg.attention.prefix_caching,  # (affinity routing to the worker caching a prefix)
    )  # fmt: skip


def resolve_model(cfg: ClusterConfig) -> str:
    """The checkpoint directory: `model` as a directory, or a Hugging Face id through this node's
    cache (services/hf_models.py; the CLI resolves ids before, with --revision), or the tiny preset."""
    from services.hf_models import resolve_model as resolve
    from services.presets import default_model_dir

    return resolve(cfg.model).path if cfg.model else str(default_model_dir("tiny"))


@dataclass
class Cluster:
    cfg: ClusterConfig
    model_dir: str
    url: str
    redis: Any  # EmbeddedRedis or None
    redis_url: str = field(repr=False)  # (holds the Redis password)
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
            if cfg.address:  # (its GCS must require Ray's token unless told otherwise)
                check_ray_auth(cfg.address, cfg.allow_unauthenticated_ray)
                join_ray(cfg.address, cfg.shared.namespace)
            else:
                with loopback_ray(cfg.allow_unauthenticated_ray):  # (Ray's ports on 127.0.0.1, its token)
                    ray.init(address="local", num_cpus=cfg.num_cpus or max(4, os.cpu_count() or 1),
                             namespace=cfg.shared.namespace, include_dashboard=False, log_to_driver=False,
                             _system_config=RAY_SYSTEM_CONFIG)  # fmt: skip
        redis = None
        try:
            check_gpus(cfg, ray.cluster_resources().get("GPU", 0.0), autoscaling=bool(cfg.address))
            redis_url = cfg.shared.redis_url
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

            host, port = cfg.router.host, cfg.router.port
            step(f"starting the OpenAI API on http://{host}:{port}")
            serve.start(http_options={"host": host, "port": port}, detached=False)
            serve.run(
                router_app(cfg, backend),
                name=APP_NAME,
                route_prefix="/",
                blocking=False,
            )
            url = f"http://{host}:{port}"
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
            while len(drained) < self.cfg.router.replicas and time.monotonic() < deadline:  # (every replica:
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
            namespace = self.cfg.shared.namespace
            return {n: self.attention.get(n) or ray.get_actor(n, namespace=namespace) for n in names}
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
        # detached: whatever of ours is left (the balancer was down?)
        kill_named_actors(self.cfg.shared.namespace)
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
        join_ray(address, namespace)
    return ray.get_actor(BALANCER_NAME, namespace=namespace)
