"""Every setting of a cluster, one dataclass per service, and the settings they must agree on.

`ClusterConfig` (services/cluster.py) is made of these sections: `shared` (SharedSettings),
`attention`, `experts`, `balancer` and `router`. A field made with `setting(default, help)` is a
user setting: a YAML key of `moe-cluster up --config` and of the Serve app's `args`, and, when
it is a scalar, a flag of `moe-cluster up` with `help` as its help. Its flat key is `key=`, else
the field's name (`AttentionSettings.tp` is `attention_tp`: `--attention-tp`, `attention_tp: 2`);
a YAML file may also nest it under its section (`attention: {tp: 2}`).

Each service's config is built from its settings object: it holds it (the balancer's
`BalancerConfig`), or `build_config` hands it every setting named like one of its fields, as it is
(`AttentionSettings.max_num_seqs` -> `EngineConfig.max_num_seqs`). So a setting the service's
config has is one field here, and it reaches the command line, the YAML keys and the service.
Each section's `validate` checks its own fields (with the shared settings, which some checks need).

The launcher hands one `SharedSettings` (with the Redis actually used and the data-plane secret)
to the balancer and the attention workers (the router gets its namespace), so that load counts
written by attention workers land where the balancer reads them, every actor is found under the
same names, both ends of the data plane agree on its dtype and transport, and the expert pool
serves the MTP module's experts exactly when the attention workers speculate.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = (
    4  # draft tokens per step at most (the chained MTP module's acceptance falls per position)
)

NAMESPACE = "moe-cluster"
BALANCER_NAME = "moe-balancer"


def setting(default: Any, help: str, key: str | None = None, repr: bool = True) -> Any:
    """A user setting (see the module's doc): `help` documents it in YAML and as a `moe-cluster
    up` flag; `key` is its flat key (default: the field's name)."""
    metadata = {"help": help, "key": key}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata, repr=repr)
    return field(default=default, metadata=metadata, repr=repr)


def user_settings(cls) -> list[dataclasses.Field]:
    """The fields of a settings dataclass made with `setting` (the others are internal)."""
    return [f for f in fields(cls) if "help" in f.metadata]


def flat_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def build_config(target: type, *settings: Any, **given: Any) -> Any:
    """`target(...)` with every field of the settings objects named like one of its fields, and
    `given` (which wins): how a service's config is made from its settings."""
    names = {f.name for f in fields(target) if f.init}
    picked: dict[str, Any] = {}
    for obj in settings:
        for f in fields(obj):
            if f.name in names and f.name not in given:
                if f.name in picked:
                    raise TypeError(f"{target.__name__}.{f.name}: in more than one settings object")
                picked[f.name] = getattr(obj, f.name)
    return target(**picked, **given)


def _bounds(workers: int, lo: int | None, hi: int | None, what: str, key: str) -> tuple[int, int]:
    """A pool's autoscaling bounds (default: its start size), checked."""
    lo, hi = lo or workers, hi or workers
    if not 1 <= lo <= hi:
        raise ValueError(f"{what}: need 1 <= min ({lo}) <= max ({hi})")
    if not lo <= workers <= hi:
        raise ValueError(f"{key} {workers} outside [{lo}, {hi}] (min/max_{key})")
    return lo, hi


def _check_delays(*delays: float) -> None:
    if min(delays) < 0:
        raise ValueError("autoscaling delays must be >= 0")


def _check_weight_dtype(shared: SharedSettings, gpus: float) -> None:
    from services.model.config import check_weight_dtype, parse_dtype  # (torch: not at import time)

    check_weight_dtype(shared.weight_dtype, parse_dtype(shared.dtype), "cuda" if gpus > 0 else "cpu")


@dataclass(frozen=True)
class SharedSettings:
    """What every service of the cluster must agree on: names, Redis, the data plane."""

    namespace: str = setting(NAMESPACE, "Ray namespace of the cluster's actors")
    # load counts and the persisted placement (the launcher's: the Redis it uses); None: no Redis
    redis_url: str | None = setting(
        None,
        "external Redis, redis://:PASSWORD@HOST:PORT/0 (default: an embedded redis-server; env MOE_REDIS_URL)",
        repr=False,  # (holds a password)
    )
    # Redis keys: {prefix}:load:{bucket}, {prefix}:placement
    key_prefix: str = setting("moe", "prefix of every Redis key")
    bucket_seconds: float = setting(2.0, "width of one load bucket", key="balancer_bucket_seconds")
    ttl_seconds: int = 600  # a load bucket expires this long after its last write
    # the data plane's shared secret (services/dataplane/auth.py): every expert call carries it; None: open
    secret: str | None = setting(
        None,
        "the data plane's shared secret: expert calls without it are refused (default: a new random one per up; "
        "env MOE_EXPERT_SECRET)",
        key="expert_secret",
        repr=False,
    )
    # the hidden states that cross the data plane are in `dtype`: both ends compute in it
    dtype: str = setting("float32", "weights and activations: float32, bfloat16, float16")
    weight_dtype: str | None = setting(
        None, "bfloat16: hold linear and expert weights in bf16 under float32 on CPU (half the memory)"
    )
    # batch-invariant kernels (services/model/kernels/deterministic.py): both ends compute with them
    deterministic: bool = setting(
        False,
        "batch-invariant kernels: a greedy request's tokens do not depend on the batch, the prompt's chunking or "
        "the expert workers (CPU, DeepSeek-V3 layers)",
    )
    transport: str = setting(
        "auto",
        "attention <-> expert data plane, chosen once per pair: auto (shared memory on one node, else TCP, else "
        "gRPC streams), shm, tcp, grpc",
        key="expert_transport",
    )
    spin_us: float = setting(
        0.0,
        "shared-memory data plane: both sides poll this many microseconds for the other's message before they "
        "block (~7 us round trips instead of ~70; pays only where every worker has cores of its own)",
        key="expert_spin_us",
    )
    # speculative decoding (issue #54): the attention workers draft with the MTP module, and the expert
    # workers serve its MoE layer's routed experts like the others' (placed, counted, re-placed)
    speculative_tokens: int = setting(
        0,
        "speculative decoding: tokens the checkpoint's MTP module drafts per step (0: off; 1 to 4, the module "
        "chained past 1)",
    )
    speculative_disable_by_batch_size: int = setting(
        0,
        "speculative decoding off for a step when more than N sequences run (vLLM's disable_by_batch_size; 0: "
        "auto, measured per batch size)",
    )

    def __post_init__(self):
        if self.bucket_seconds <= 0 or self.ttl_seconds <= 0:
            raise ValueError("bucket_seconds and ttl_seconds must be > 0")

    def validate(self) -> None:
        from services.dataplane.transport import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ValueError(f"expert_transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"expert_spin_us {self.spin_us}: 0 to 1e6 microseconds")
        if self.speculative_tokens < 0:  # (its upper bound: the engine's check_speculation, run at start)
            raise ValueError(
                f"speculative_tokens: {self.speculative_tokens}: 0 (off) or more draft tokens per step"
            )
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError(f"speculative_disable_by_batch_size: {self.speculative_disable_by_batch_size}: >= 0 "
                             "(0: auto)")  # fmt: skip


@dataclass(frozen=True)
class AttentionSettings:
    """The attention workers (services/attention/worker.py): each one's engine, and their pool.
    Settings named like a field of EngineConfig, AttentionWorkerConfig or AttentionScaleConfig go
    to it."""

    workers: int = setting(1, "attention workers (data parallel)", key="attention_workers")
    min_workers: int | None = setting(
        None,
        "autoscaling: fewest attention workers (default: attention_workers)",
        key="min_attention_workers",
    )
    max_workers: int | None = setting(
        None,
        "autoscaling: most attention workers (default: attention_workers); min < max turns it on",
        key="max_attention_workers",
    )
    kv_threshold: float = setting(
        0.8, "autoscaling: KV cache use that saturates an attention worker", key="attention_kv_threshold"
    )
    queue_threshold: int = setting(
        5, "autoscaling: waiting requests that saturate an attention worker", key="attention_queue_threshold"
    )
    upscale_delay_s: float = setting(
        30.0,
        "autoscaling: a larger attention pool wanted this long before it grows",
        key="attention_upscale_delay_s",
    )
    downscale_delay_s: float = setting(
        120.0,
        "autoscaling: a smaller attention pool wanted this long before it shrinks (drain, then stop)",
        key="attention_downscale_delay_s",
    )
    tp: int = setting(
        1,
        "tensor-parallel ranks per attention worker (heads split, latent cache replicated)",
        key="attention_tp",
    )
    num_threads: int = setting(1, "torch threads per attention worker", key="attention_threads")
    gpus: float = setting(
        0.0, "GPUs per attention worker and per TP rank (> 0: computes on CUDA)", key="attention_gpus"
    )
    resources: dict[str, float] = setting(
        {}, "Ray resources each attention worker needs", key="attention_resources"
    )
    keep_fp8_linears: bool = setting(
        False, "FP8 checkpoints: the attention workers hold the linears in FP8 with their block scales"
    )
    max_num_seqs: int = setting(64, "sequences per step, per attention worker")
    max_num_batched_tokens: int = setting(2048, "tokens per step, per attention worker")
    max_model_len: int | None = setting(None, "context length (default: min(model's, 4096))")
    max_waiting: int = setting(512, "queued requests per attention worker before HTTP 429")
    kv_cache_gib: float = setting(2.0, "latent KV cache per attention worker, GiB (at most)")
    kv_cache_dtype: str = setting(
        "auto", "latent cache rows: auto (the model dtype) or fp8 (FlashMLA's FP8 rows: V3 656 B/token/layer)"
    )
    micro_batches: int = setting(
        1, "2 = ping-pong micro-batches (pays when experts have their own cores/GPUs)"
    )
    prefix_caching: bool = setting(
        True, "reuse cached prompt-prefix blocks; send requests to the worker holding their prefix"
    )

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"

    def bounds(self) -> tuple[int, int]:
        """The pool's (min, max) workers: autoscaled when min < max."""
        return _bounds(
            self.workers, self.min_workers, self.max_workers, "attention workers", "attention_workers"
        )

    def validate(self, shared: SharedSettings) -> None:
        if self.workers < 1:
            raise ValueError("need at least one attention worker")
        if self.tp < 1:
            raise ValueError("attention_tp must be >= 1")
        if self.gpus < 0:
            raise ValueError("attention_gpus must be >= 0")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: auto or fp8")
        if self.keep_fp8_linears and self.tp > 1:
            raise ValueError(
                "keep_fp8_linears with attention_tp > 1 (attention tensor parallelism): not supported yet"
            )
        self.bounds()
        if not 0.0 < self.kv_threshold <= 1.0 or self.queue_threshold < 1:
            raise ValueError("attention autoscaling: kv_threshold in (0, 1] and queue_threshold >= 1")
        _check_delays(self.upscale_delay_s, self.downscale_delay_s)
        _check_weight_dtype(shared, self.gpus)


@dataclass(frozen=True)
class ExpertSettings:
    """The expert workers (services/experts/server.py) and their pool, which the balancer owns
    (BalancerConfig holds this). Settings named like a field of ExpertWorkerConfig or of
    AutoscaleConfig go to it."""

    workers: int = setting(2, "expert workers (the start, when the pool autoscales)", key="expert_workers")
    min_workers: int | None = setting(
        None, "autoscaling: fewest expert workers (default: expert_workers)", key="min_expert_workers"
    )
    max_workers: int | None = setting(
        None,
        "autoscaling: most expert workers (default: expert_workers); min < max turns it on",
        key="max_expert_workers",
    )
    target_utilization: float = setting(
        0.6, "autoscaling: busy fraction each expert worker aims at", key="expert_target_utilization"
    )
    upscale_delay_s: float = setting(
        30.0, "autoscaling: a larger pool wanted this long before it grows", key="expert_upscale_delay_s"
    )
    downscale_delay_s: float = setting(
        120.0,
        "autoscaling: a smaller pool wanted this long before it shrinks",
        key="expert_downscale_delay_s",
    )
    redundant_experts: int = setting(0, "extra expert slots per MoE layer (replicas of hot experts)")
    spare_rows: int = setting(
        0,
        "expert rows per MoE layer each expert worker reserves for a re-plan's moved experts (see docs/experts.md)",
        key="expert_spare_rows",
    )
    keep_fp8_experts: bool = setting(
        False, "FP8 checkpoints: the expert workers hold the routed experts in FP8 with their block scales"
    )
    num_threads: int = setting(1, "torch threads per expert worker", key="expert_threads")
    compute_concurrency: int = setting(
        1,
        "Dispatches an expert worker computes at once (each with expert_threads threads; 1: in turn)",
        key="expert_concurrency",
    )
    gpus: float = setting(
        0.0, "GPUs per expert worker (> 0: computes on CUDA; 0.5: two per GPU)", key="expert_gpus"
    )
    resources: dict[str, float] = setting(
        {}, "Ray resources each expert worker needs", key="expert_resources"
    )

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"

    def bounds(self) -> tuple[int, int]:
        """The pool's (min, max) workers: autoscaled when min < max."""
        return _bounds(self.workers, self.min_workers, self.max_workers, "expert workers", "expert_workers")

    def validate(self, shared: SharedSettings) -> None:
        if self.workers < 1:
            raise ValueError("need at least one expert worker")
        if self.gpus < 0:
            raise ValueError("expert_gpus must be >= 0")
        if self.redundant_experts < 0 or self.spare_rows < 0:
            raise ValueError("redundant_experts and expert_spare_rows must be >= 0")
        if self.compute_concurrency < 1:
            raise ValueError("expert_concurrency must be >= 1")
        self.bounds()
        if not 0.0 < self.target_utilization <= 1.0:
            raise ValueError(f"expert_target_utilization {self.target_utilization} not in (0, 1]")
        _check_delays(self.upscale_delay_s, self.downscale_delay_s)
        _check_weight_dtype(shared, self.gpus)


@dataclass(frozen=True)
class BalancerSettings:
    """The balancer's re-placement (services/balancer/service.py), held by its BalancerConfig."""

    period_s: float = setting(
        30.0, "seconds between rebalancing checks (0: on demand only)", key="balancer_period_s"
    )
    window_buckets: int = setting(15, "load window, in buckets", key="balancer_window_buckets")
    min_gain: float = setting(0.02, "balancedness gain needed to migrate experts", key="balancer_min_gain")

    def validate(self, shared: SharedSettings) -> None:
        if self.window_buckets * shared.bucket_seconds > shared.ttl_seconds:
            raise ValueError(
                f"the load window ({self.window_buckets} x {shared.bucket_seconds}s) is longer than "
                f"the load buckets live ({shared.ttl_seconds}s)"
            )


@dataclass(frozen=True)
class RouterSettings:
    """The OpenAI router (services/router/) and its HTTP endpoint. Settings named like a field of
    RouterConfig go to it."""

    served_model_name: str | None = setting(
        None,
        "model name in the API (default: the checkpoint dir's name); several, comma-separated: all answered",
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template (or its file) in place of the checkpoint's tokenizer config's"
    )
    host: str = setting("127.0.0.1", "HTTP host of the OpenAI API")
    port: int = setting(8000, "HTTP port of the OpenAI API")
    api_key: str | None = setting(None, "require this bearer token on the API (env MOE_API_KEY)", repr=False)
    replicas: int = setting(
        2,
        "Ray Serve replicas of the OpenAI router (a client's retry finds a live one when one dies)",
        key="router_replicas",
    )

    def validate(self, shared: SharedSettings) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if self.replicas < 1:
            raise ValueError("router_replicas must be >= 1")


def attention_worker_name(index: int) -> str:
    return f"moe-attn-{index}"


def expert_worker_name(worker_id: str) -> str:
    return f"moe-{worker_id}"


EXPERT_WORKER_NAME = re.compile(r"^moe-(expert-(\d+))$")  # expert_worker_name's: worker id, index
