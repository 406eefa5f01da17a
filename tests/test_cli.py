"""The command line and the cluster's settings: `moe-cluster up` flags and YAML keys come from the
settings dataclasses (services/settings.py) ClusterConfig is made of, and every key of before the
sections (#51) still works."""

import dataclasses

import pytest
import yaml

from services.cli import build_parser, up_flags
from services.cluster import ClusterConfig, router_config
from services.settings import AttentionSettings, ExpertSettings, RouterSettings

# Every flat key of ClusterConfig before it was made of sections (#51): YAML keys, Serve `args`,
# and `moe-cluster up --<key>` for all but the dict ones
FLAT_KEYS_BEFORE_SECTIONS = {
    "address", "api_key", "attention_downscale_delay_s", "attention_gpus", "attention_kv_threshold",
    "attention_queue_threshold", "attention_resources", "attention_threads", "attention_tp",
    "attention_upscale_delay_s", "attention_workers", "balancer_bucket_seconds", "balancer_min_gain",
    "balancer_period_s", "balancer_window_buckets", "control_resources", "dtype", "expert_concurrency",
    "expert_downscale_delay_s", "expert_gpus", "expert_resources", "expert_secret", "expert_spare_rows",
    "expert_spin_us", "expert_target_utilization", "expert_threads", "expert_transport",
    "expert_upscale_delay_s", "expert_workers", "host", "keep_fp8_experts", "keep_fp8_linears", "key_prefix",
    "kv_cache_dtype", "kv_cache_gib", "max_attention_workers", "max_expert_workers", "max_model_len",
    "max_num_batched_tokens", "max_num_seqs", "max_waiting", "micro_batches", "min_attention_workers",
    "min_expert_workers", "model", "namespace", "num_cpus", "port", "prefix_caching", "redis_url",
    "redundant_experts", "router_replicas", "served_model_name", "weight_dtype",
}  # fmt: skip
DICT_KEYS = {"attention_resources", "expert_resources", "control_resources"}  # YAML-only


def test_up_flags_are_the_scalar_cluster_settings():
    keys = set(ClusterConfig.settings())
    assert keys >= FLAT_KEYS_BEFORE_SECTIONS  # no key lost
    assert set(up_flags()) == keys - DICT_KEYS
    sections = {"shared", "attention", "experts", "balancer", "router"}
    assert sections <= {f.name for f in dataclasses.fields(ClusterConfig)}  # (they hold the rest)
    args = build_parser().parse_args(
        ["up", "--max-num-seqs", "8", "--balancer-min-gain", "0.5", "--redis-url", "r"]
    )
    assert (args.max_num_seqs, args.balancer_min_gain, args.redis_url, args.port) == (8, 0.5, "r", None)
    kind, help_ = up_flags()["attention_tp"]
    assert kind is int and help_ == ClusterConfig.settings()["attention_tp"].help
    assert ClusterConfig.settings()["attention_tp"].owner is AttentionSettings


def test_flat_keys_sections_and_nested_dicts_build_the_same_config():
    flat = ClusterConfig(attention_tp=2, expert_workers=3, port=9000, redis_url="redis://r", model="m")
    nested = ClusterConfig(attention={"tp": 2}, experts=ExpertSettings(workers=3), router={"port": 9000},
                           shared={"redis_url": "redis://r"}, model="m")  # fmt: skip
    assert flat == nested
    assert (flat.attention.tp, flat.experts.workers, flat.router.port) == (2, 3, 9000)
    assert (flat.attention_tp, flat.expert_workers, flat.redis_url) == (2, 3, "redis://r")  # flat reads
    moved = dataclasses.replace(flat, attention_tp=4, router_replicas=1)  # flat keys over the sections
    assert (moved.attention.tp, moved.router.replicas, moved.experts.workers) == (4, 1, 3)
    with pytest.raises(AttributeError, match="attention.tp"):
        flat.attention_tp = 3  # (would shadow the section's value)
    with pytest.raises(ValueError, match="unknown cluster settings: attention.nope, nope"):
        ClusterConfig(nope=1, attention={"nope": 1})
    with pytest.raises(ValueError, match="given twice"):
        ClusterConfig(attention_tp=2, attention={"tp": 3})


def test_yaml_takes_flat_keys_and_sections_and_flags_override_either(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        yaml.safe_dump({"expert_workers": 4, "attention": {"tp": 2, "workers": 2}, "max_num_seqs": 8})
    )
    cfg = ClusterConfig.from_yaml(path, attention_tp=1, expert_workers=None)  # None: the flag not given
    assert (cfg.attention.tp, cfg.attention.workers, cfg.attention.max_num_seqs, cfg.experts.workers) == (
        1,
        2,
        8,
        4,
    )
    path.write_text(yaml.safe_dump({"router": {"replicas": 0}}))
    with pytest.raises(ValueError, match="router_replicas"):
        ClusterConfig.from_yaml(path)


def test_each_section_validates_its_settings():
    for settings, message in [
        ({"attention_tp": 0}, "attention_tp"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"expert_concurrency": 0}, "expert_concurrency"),
        ({"attention_workers": 3, "max_attention_workers": 2}, "min .3. <= max .2."),
        ({"expert_workers": 5, "max_expert_workers": 4, "min_expert_workers": 1}, "expert_workers 5 outside"),
        ({"expert_target_utilization": 1.5}, "expert_target_utilization"),
        ({"expert_transport": "pigeon"}, "expert_transport"),
        ({"expert_spin_us": -1}, "expert_spin_us"),
        ({"balancer_window_buckets": 1000}, "load window"),
        ({"port": 0}, "port"),
    ]:
        with pytest.raises(ValueError, match=message):
            ClusterConfig.from_dict(settings)


def test_every_setting_reaches_its_service(tiny_model):
    """The services' configs are built from the sections: every setting named like a field of one
    goes to it as it is, and each section's settings all land somewhere."""
    from services.attention.worker import AttentionWorkerConfig
    from services.balancer.attention_pool import AttentionScaling
    from services.balancer.autoscale import AttentionScaleConfig, AutoscaleConfig
    from services.balancer.service import BalancerConfig
    from services.cluster import Backend
    from services.engine.engine import EngineConfig
    from services.experts.server import ExpertWorkerConfig
    from services.router.core import RouterConfig

    def names(*classes):
        return {f.name for cls in classes for f in dataclasses.fields(cls)}

    used = names(EngineConfig, AttentionWorkerConfig, AttentionScaleConfig) | {"workers", "resources"}
    assert names(AttentionSettings) <= used
    used = names(ExpertWorkerConfig, AutoscaleConfig) | {"workers", "redundant_experts", "gpus", "resources"}
    assert names(ExpertSettings) <= used
    assert names(RouterSettings) <= names(RouterConfig) | {"host", "port", "replicas"}

    cfg = ClusterConfig.from_dict({
        "attention_tp": 2, "attention_threads": 3, "max_num_seqs": 8, "kv_cache_gib": 1.5, "prefix_caching": False,
        "min_attention_workers": 1, "max_attention_workers": 3, "attention_kv_threshold": 0.5,
        "attention_resources": {"attention_node": 1}, "weight_dtype": "bfloat16", "expert_transport": "grpc",
        "expert_spin_us": 5.0, "expert_threads": 4, "expert_concurrency": 2, "expert_spare_rows": 7,
        "min_expert_workers": 1, "max_expert_workers": 4, "expert_target_utilization": 0.3,
        "balancer_period_s": 7, "served_model_name": "x", "api_key": "k",
    })  # fmt: skip
    shared = dataclasses.replace(cfg.shared, redis_url="redis://r", secret="s")
    worker = AttentionWorkerConfig.from_settings(cfg.attention, shared, str(tiny_model))
    engine = worker.engine
    assert (engine.max_num_seqs, engine.kv_cache_gib, engine.num_threads, engine.prefix_caching) == (
        8,
        1.5,
        3,
        False,
    )
    assert (engine.weight_dtype, engine.device, worker.tp, worker.shared) == ("bfloat16", "cpu", 2, shared)
    assert (worker.expert_transport, worker.expert_spin_us) == ("grpc", 5.0)
    pool = AttentionScaling.from_settings(cfg.attention, worker)
    assert (pool.scale.min_workers, pool.scale.max_workers, pool.scale.kv_threshold) == (1, 3, 0.5)
    assert pool.bundle == {"attention_node": 1.0}
    balancer = BalancerConfig(
        model=str(tiny_model), experts=cfg.experts, settings=cfg.balancer, shared=shared
    )
    assert balancer.period_s == 7 and balancer.autoscale == AutoscaleConfig(1, 4, target_utilization=0.3)
    expert = balancer.expert_worker_config()
    assert (expert.num_threads, expert.compute_concurrency, expert.spare_rows) == (4, 2, 7)
    assert (expert.weight_dtype, expert.spin_us, expert.shm, expert.secret) == ("bfloat16", 5.0, False, "s")
    router = router_config(cfg, Backend(str(tiny_model), None, {"moe-attn-0": None}, 4096, 1))
    assert (router.served_model_name, router.api_key, router.prefix_caching) == ("x", "k", False)


def test_init_model_offers_every_preset():
    from services.presets import PRESETS

    init = build_parser()._subparsers._group_actions[0].choices["init-model"]
    (preset,) = [a for a in init._actions if a.dest == "preset"]
    assert sorted(preset.choices) == sorted(PRESETS)


def test_gpu_settings_are_flags_and_checked():
    args = build_parser().parse_args(["up", "--attention-gpus", "1", "--expert-gpus", "0.5"])
    assert (args.attention_gpus, args.expert_gpus) == (1.0, 0.5)
    assert ClusterConfig.from_dict({"expert_gpus": 0.5, "attention_gpus": 1}).expert_gpus == 0.5
    with pytest.raises(ValueError, match="expert_gpus"):
        ClusterConfig.from_dict({"expert_gpus": -1})


def test_too_few_gpus_is_an_error_on_a_local_ray_and_a_warning_on_a_joined_one(caplog):
    from services.cluster import check_gpus

    cfg = ClusterConfig.from_dict({"attention_gpus": 1, "expert_workers": 4, "expert_gpus": 0.5})
    check_gpus(cfg, 3.0, autoscaling=False)  # 1 + 4 x 0.5 = 3: fits
    with pytest.raises(ValueError, match="ask for 3 GPUs .* has 0"):
        check_gpus(cfg, 0.0, autoscaling=False)
    check_gpus(cfg, 1.0, autoscaling=True)
    assert "wait until GPU nodes join" in caplog.text
    check_gpus(ClusterConfig(), 0.0, autoscaling=False)  # the CPU default needs none
