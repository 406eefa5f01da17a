"""Secrets stay out of reprs, logs and command lines; the embedded Redis has a password of its own
(issue #52). Fast: no Ray, one embedded redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from services.cli import build_parser, secrets_from_env
from services.cluster import Cluster, ClusterConfig
from services.dataplane.remote_experts import DispatchConfig
from services.experts.server import ExpertWorkerConfig
from services.redis_store import EmbeddedRedis, connect
from services.router.core import RouterConfig
from services.settings import RouterSettings, SharedSettings

KEY, SECRET, PASSWORD = "sk-key-3f9a1c", "data-plane-77e2b0", "redis-pw-41d8c9"
URL = f"redis://:{PASSWORD}@10.0.0.10:6380/0"


def assert_hidden(obj) -> None:
    text = repr(obj) + str(obj)
    for secret in (KEY, SECRET, PASSWORD):
        assert secret not in text, (secret, text)


def test_config_reprs_hold_no_secret():
    shared = SharedSettings(redis_url=URL, secret=SECRET)
    assert_hidden(shared)
    assert_hidden(RouterSettings(api_key=KEY))
    cfg = ClusterConfig(api_key=KEY, expert_secret=SECRET, redis_url=URL)
    assert (cfg.api_key, cfg.expert_secret, cfg.redis_url) == (KEY, SECRET, URL)  # (kept, only not shown)
    assert_hidden(cfg)
    assert_hidden(Cluster(cfg, "/m", "http://127.0.0.1:8000", None, URL, None, {}, False))
    assert_hidden(ExpertWorkerConfig(model="/m", secret=SECRET))
    assert_hidden(DispatchConfig(secret=SECRET))


def test_router_config_repr_holds_no_api_key():
    assert_hidden(RouterConfig("/m", "m", ["w"], api_key=KEY))


def test_embedded_redis_has_a_password_never_on_its_command_line():
    server = EmbeddedRedis.start()
    try:
        assert server.password and len(server.password) >= 32
        assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        assert server.password not in repr(server) + str(server)
        argv = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().split(b"\0")
        assert server.password.encode() not in b" ".join(argv), argv
        assert server.password not in " ".join(server.process.args), server.process.args
        client = connect(server.url)
        assert client.ping()
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://127.0.0.1:{server.port}/0").set("moe:placement", "{}")  # a stranger
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://:guess@127.0.0.1:{server.port}/0").ping()
    finally:
        server.stop()


def test_up_takes_secrets_from_the_environment_not_only_from_flags(tmp_path):
    env = {"MOE_API_KEY": KEY, "MOE_EXPERT_SECRET": SECRET, "MOE_REDIS_URL": URL}
    cfg = secrets_from_env(ClusterConfig(), env)
    assert (cfg.api_key, cfg.expert_secret, cfg.redis_url) == (KEY, SECRET, URL)
    # a flag, or the YAML file, wins over the environment
    flags = build_parser().parse_args(["up", "--api-key", "from-flag"])
    assert flags.api_key == "from-flag"
    assert secrets_from_env(ClusterConfig(api_key="from-flag"), env).api_key == "from-flag"
    yaml = tmp_path / "c.yaml"
    yaml.write_text("router: {api_key: from-yaml}\n")
    assert secrets_from_env(ClusterConfig.from_yaml(yaml), env).api_key == "from-yaml"
    base = ClusterConfig()
    assert secrets_from_env(base, {}) is base  # (nothing in the environment: as it was)
