"""The command line: `moe-cluster up` flags come from ClusterConfig's fields."""

from dataclasses import fields

from services.cli import build_parser, up_flags
from services.cluster import ClusterConfig


def test_up_flags_are_the_scalar_cluster_settings():
    dict_fields = {"attention_resources", "expert_resources", "control_resources"}  # YAML-only
    assert set(up_flags()) == {f.name for f in fields(ClusterConfig)} - dict_fields
    args = build_parser().parse_args(
        ["up", "--max-num-seqs", "8", "--balancer-min-gain", "0.5", "--redis-url", "r"]
    )
    assert (args.max_num_seqs, args.balancer_min_gain, args.redis_url, args.port) == (8, 0.5, "r", None)


def test_init_model_offers_every_preset():
    from services.presets import PRESETS

    init = build_parser()._subparsers._group_actions[0].choices["init-model"]
    (preset,) = [a for a in init._actions if a.dest == "preset"]
    assert sorted(preset.choices) == sorted(PRESETS)


def test_gpu_settings_are_flags_and_checked():
    import pytest

    args = build_parser().parse_args(["up", "--attention-gpus", "1", "--expert-gpus", "0.5"])
    assert (args.attention_gpus, args.expert_gpus) == (1.0, 0.5)
    assert ClusterConfig.from_dict({"expert_gpus": 0.5, "attention_gpus": 1}).expert_gpus == 0.5
    with pytest.raises(ValueError, match="expert_gpus"):
        ClusterConfig.from_dict({"expert_gpus": -1})


def test_too_few_gpus_is_an_error_on_a_local_ray_and_a_warning_on_a_joined_one(caplog):
    import pytest

    from services.cluster import check_gpus

    cfg = ClusterConfig.from_dict({"attention_gpus": 1, "expert_workers": 4, "expert_gpus": 0.5})
    check_gpus(cfg, 3.0, autoscaling=False)  # 1 + 4 x 0.5 = 3: fits
    with pytest.raises(ValueError, match="ask for 3 GPUs .* has 0"):
        check_gpus(cfg, 0.0, autoscaling=False)
    check_gpus(cfg, 1.0, autoscaling=True)
    assert "wait until GPU nodes join" in caplog.text
    check_gpus(ClusterConfig(), 0.0, autoscaling=False)  # the CPU default needs none
