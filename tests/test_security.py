"""Secrets stay out of reprs, logs and command lines; the embedded Redis has a password of its own
(issue #52). Fast: no Ray, one embedded redis-server."""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

import psutil
import pytest
import ray
import redis

from services.cli import build_parser, secrets_from_env
from services.cluster import Cluster, ClusterConfig
from services.dataplane.remote_experts import DispatchConfig
from services.experts.server import ExpertWorkerConfig
from services.redis_store import EmbeddedRedis, connect
from services.router.core import RouterConfig
from services.settings import RouterSettings, SharedSettings

from .fakes import RemoteCall

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


# ---- Ray's own control plane (#52: Ray closed by default) -------------------------------------
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening(procs) -> dict[str, set[tuple[str, int]]]:
    """Process name -> the (address, port) its TCP listeners are bound to."""
    found: dict[str, set[tuple[str, int]]] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.setdefault(p.name(), set()).add((c.laddr.ip, c.laddr.port))
    return found


def _refuses_without_rays_token(port: int) -> bool:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


@pytest.mark.cluster
def test_a_local_run_binds_every_ray_port_to_loopback_and_requires_rays_token(tiny_model, monkeypatch):
    from ray._private.services import canonicalize_bootstrap_address_or_die

    from services.ray_control import gcs_requires_token, ray_token_file
    from tests.clusters import tiny_cluster

    if ray.is_initialized():  # (this test starts its own Ray: a driver an earlier test left connected goes)
        ray.shutdown()
    # (Ray's token file as this process has it: Ray loads a token once per process, so a test in a
    # process that ran Ray before cannot switch it to another file)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    with tiny_cluster(tiny_model, num_cpus=4):
        me = psutil.Process()
        listening = _listening([me, *me.children(recursive=True)])
        gcs = ray.get_runtime_context().gcs_address
        assert gcs_requires_token(gcs)  # (a call without Ray's token: refused)
        assert canonicalize_bootstrap_address_or_die(gcs).startswith("127.0.0.1:")
        exposed = {
            (name, port) for name, bound in listening.items() for ip, port in bound if ip not in LOOPBACK
        }
        # Ray Serve binds each replica's inter-deployment gRPC server to [::] whatever the node's
        # address (ray/serve/_private/replica.py): it is the one exception, and it takes Ray's token
        replicas = {(name, port) for name, port in exposed if name.startswith("ray::ServeReplica")}
        assert all(_refuses_without_rays_token(port) for _, port in replicas), replicas
    assert {"gcs_server", "raylet"} <= set(listening), listening
    assert not exposed - replicas, f"listening beyond loopback: {exposed - replicas}"
    token = ray_token_file()
    assert token is None or (oct(token.stat().st_mode & 0o777) == "0o600" and token.read_text().strip())
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") is None  # (this process got its own back)


class _FakeGcs:
    """A gRPC server where a Ray GCS would be: answers every call (a GCS without token
    authentication) or refuses each one without Ray's token UNAUTHENTICATED (one with it)."""

    def __init__(self, requires_token: bool):
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        def handle(request, context):
            if requires_token and not any(k == "authorization" for k, _ in context.invocation_metadata()):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
            return b""

        class Any(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.unary_unary_rpc_method_handler(handle)

        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((Any(),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self):
        self.server.stop(0)


def test_up_address_refuses_a_ray_cluster_without_token_auth_unless_told(monkeypatch, caplog, tmp_path):
    from services.ray_control import check_ray_auth

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    open_gcs, closed_gcs = _FakeGcs(requires_token=False), _FakeGcs(requires_token=True)
    try:
        cfg = ClusterConfig(address=open_gcs.address, model=str(tmp_path))  # (a directory: nothing loaded)
        with pytest.raises(PermissionError, match="--allow-unauthenticated-ray"):
            Cluster.start(cfg)  # (refused before Ray is even joined)
        assert not ray.is_initialized()
        assert "RAY_AUTH_MODE" not in os.environ
        flags = build_parser().parse_args(
            ["up", "--address", open_gcs.address, "--allow-unauthenticated-ray"]
        )
        assert flags.allow_unauthenticated_ray is True
        assert ClusterConfig(allow_unauthenticated_ray=True).allow_unauthenticated_ray
        assert check_ray_auth(open_gcs.address, allow_unauthenticated=True) is False  # (told: a warning)
        assert "does not require Ray's token" in caplog.text
        # a cluster that requires Ray's token is joined with it (Ray sends it only when told so)
        assert check_ray_auth(closed_gcs.address) is True
        assert os.environ["RAY_AUTH_MODE"] == "token"
    finally:
        open_gcs.stop()
        closed_gcs.stop()
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        ray._raylet.Config.initialize("")  # (this process's Ray back to the mode of its environment)


DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RAY_TOKEN = "~/.ray/moe-cluster-token"


@pytest.mark.parametrize("name", ["ray-up-onprem.yaml", "ray-up-aws-gpu.yaml"])
def test_ray_up_starts_every_node_with_rays_token_made_on_the_head(name, tmp_path):
    import subprocess

    import yaml

    raw = yaml.safe_load((DEPLOY / name).read_text())
    assert raw["cluster_synced_files"] == [RAY_TOKEN]  # (head -> every worker node, by Ray's autoscaler)
    env = "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.ray/moe-cluster-token"
    starts = [
        c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"] if "ray start" in c
    ]
    assert len(starts) == 2 and all(env in c and c.index(env) < c.index("ray start") for c in starts), starts
    assert all("RAY_kill_worker_timeout_milliseconds=1000" in c for c in starts)  # (a fenced worker: 1 s)
    assert any("RAY_AUTH_MODE=token" in c and ".bashrc" in c for c in raw["setup_commands"])  # (`ray exec`)
    # the head's command makes the token once, 0600, and prints nothing
    (make,) = raw["head_setup_commands"]
    home = tmp_path / "home"
    home.mkdir()
    # as Ray's SSH command runner sends it: in parentheses, quoted for the remote shell, run by bash -c
    wrapped = f"bash -c {shlex.quote(f'export OMP_NUM_THREADS=1 && ({make})')}"
    for _ in range(2):
        run = subprocess.run(["sh", "-c", wrapped], env={**os.environ, "HOME": str(home)}, capture_output=True,
                             text=True, check=True)  # fmt: skip
        assert run.stdout == run.stderr == ""
        token = (home / ".ray" / "moe-cluster-token").read_text()
        assert len(token) == 64 and int(token, 16) >= 0
        assert oct((home / ".ray" / "moe-cluster-token").stat().st_mode & 0o777) == "0o600"
        if _ == 0:
            first = token
    assert token == first  # (kept across `ray up`: the workers' copies stay valid)
    script = (DEPLOY / "start-head.sh").read_text()
    assert 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$HOME/.ray/moe-cluster-token"' in script


def test_kuberay_runs_with_rays_token_and_admits_only_its_pods_to_rays_ports():
    import yaml

    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay-rayservice.yaml").read_text()) if d]
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = service["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token"}  # (the operator's Secret -> RAY_AUTH_TOKEN on every pod)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:  # the policy covers every Ray pod
        labels = group["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        env = {e["name"] for c in group["template"]["spec"]["containers"] for e in c.get("env", [])}
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & env  # (KubeRay sets them; a copy here would clash)
    rules = policy["spec"]["ingress"]
    everyone = [r for r in rules if "from" not in r]
    assert everyone and {p["port"] for r in everyone for p in r["ports"]} == {8000}  # only the API is open
    peers = [r for r in rules if "from" in r and "ports" not in r]  # every port: the Ray pods themselves
    assert [p["podSelector"]["matchLabels"] for r in peers for p in r["from"]] == [
        policy["spec"]["podSelector"]["matchLabels"]
    ]
    operator = [r for r in rules if "from" in r and "ports" in r]
    assert {p["port"] for r in operator for p in r["ports"]} <= {8000, 8265, 52365}


# ---- the expert data plane: strangers refused in the TLS handshake (#52: mutual TLS) ----------
@pytest.fixture
def expert_server(tiny_model):
    from services.experts.server import ExpertServer

    srv = ExpertServer(ExpertWorkerConfig(model=str(tiny_model), secret=SECRET, shm=False))
    srv.start()
    yield srv
    srv.stop(0)


def _stranger_channel(address: str):
    """A TLS client that trusts the worker's certificate (it is public) but has no key of the
    cluster's: it cannot present the client certificate."""
    import grpc

    from services.dataplane import tls

    credentials = grpc.ssl_channel_credentials(root_certificates=tls.identity(SECRET).cert_pem)
    return grpc.secure_channel(
        address, credentials, options=[("grpc.ssl_target_name_override", tls.EXPERT_NAME)]
    )


def test_a_grpc_stranger_is_refused_in_the_tls_handshake_before_its_message_is_read(expert_server):
    import grpc

    from services.rpc import wire

    big = b"\0" * (32 << 20)  # (a LoadSlots body of 32 MiB, no secret: read and parsed before mutual TLS)
    with _stranger_channel(expert_server.address) as channel, pytest.raises(grpc.RpcError) as e:
        channel.unary_unary(f"/{wire.EXPERT_SERVICE}/LoadSlots")(big, timeout=20)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value  # (the handshake, not the secret check)
    assert expert_server.secret_check.refused == 0  # (the call never reached the server's handlers)
    # the cluster's own client (its certificate, its secret) is served
    from services.experts.client import ExpertClient

    ours = ExpertClient(expert_server.address, secret=SECRET)
    assert ours.stats().socket_port == expert_server.socket.port
    ours.close()


def test_a_tcp_stranger_is_refused_in_the_tls_handshake_before_its_hello_is_read(expert_server):
    import socket
    import ssl

    from services.dataplane import tcp

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (trusts anything, presents nothing)
    raw = socket.create_connection(("127.0.0.1", expert_server.socket.port), timeout=10)
    got = b""
    with contextlib.suppress(OSError):  # (ssl.SSLError: the worker's alert, or a reset)
        sock = ctx.wrap_socket(raw, server_hostname="x")
        sock.sendall(tcp._HELLO.pack(tcp.MAGIC, 7) + b"a-guess")
        got = sock.recv(64)
    raw.close()
    assert got == b"", got  # (no ACK: the hello was never read, nothing answered it)
    with pytest.raises(OSError):
        tcp.TcpChannel.connect("127.0.0.1", expert_server.socket.port, "another-cluster", timeout_s=5.0)
    ours = tcp.TcpChannel.connect("127.0.0.1", expert_server.socket.port, SECRET, timeout_s=5.0)
    ours.close()


# ---- refusals exported (#52) --------------------------------------------------------------------
@pytest.fixture
def expert_server_shm(tiny_model):
    from services.experts.server import ExpertServer

    srv = ExpertServer(ExpertWorkerConfig(model=str(tiny_model), secret=SECRET))
    srv.start()
    yield srv
    srv.stop(0)


def _refusals(srv) -> dict[tuple[str, str], int]:
    from services.experts.client import ExpertClient

    ours = ExpertClient(srv.address, secret=SECRET)
    try:
        return {(r.transport, r.reason): r.count for r in ours.stats().refused}
    finally:
        ours.close()


def _wait_for(condition, timeout_s: float = 10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_refused_calls_are_counted_by_transport_and_reason_in_stats(expert_server_shm):
    import socket
    import ssl

    import grpc

    from services.dataplane import auth, shm, tls
    from services.rpc import expert_pb2, expert_pb2_grpc

    srv = expert_server_shm
    assert _refusals(srv) == {}
    # gRPC: the cluster's certificate (past mutual TLS) without the secret, then with a wrong one
    with tls.channel(srv.address, SECRET) as channel:
        for secret in (None, "a-guess"):
            stub = expert_pb2_grpc.ExpertStub(auth.with_secret(channel, secret))
            with pytest.raises(grpc.RpcError):
                stub.Stats(expert_pb2.StatsRequest(), timeout=10)
    # TCP: no certificate (refused in the TLS handshake)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", srv.socket.port), timeout=10) as raw,
    ):
        ctx.wrap_socket(raw, server_hostname="x").recv(1)
    # shared memory: a wrong secret
    with pytest.raises(OSError):
        shm.ShmChannel.connect(srv.address, secret="a-guess")
    want = {
        ("grpc", "no_secret"): 1,
        ("grpc", "wrong_secret"): 1,
        ("tcp", "tls"): 1,
        ("shm", "wrong_secret"): 1,
    }
    _wait_for(lambda: _refusals(srv) == want)  # (the TCP and shm refusals end on their own threads)
    assert srv.secret_check.refused == 2 and srv.socket.refused == 1 and srv.shm.refused == 1


def test_a_tcp_handshake_cut_by_the_deadline_is_counted_as_such(monkeypatch):
    import socket

    from services.dataplane import tcp, tls

    monkeypatch.setattr(tcp, "HANDSHAKE_S", 0.3)
    srv = tcp.TcpServer("127.0.0.1", lambda *a: 0.0, lambda e: None, secret=SECRET)
    try:
        raw = socket.create_connection(("127.0.0.1", srv.port))
        sock = tcp._client_context(SECRET).wrap_socket(raw, server_hostname=tls.EXPERT_NAME)  # (then silent)
        _wait_for(lambda: srv.refusals.counts() == {("tcp", "handshake_timeout"): 1})
        sock.close()
        assert srv.refused == 1
    finally:
        srv.close()


def test_router_metrics_show_the_expert_workers_refusals(expert_server_shm, tmp_path, monkeypatch):
    import grpc

    from services.dataplane import tls
    from services.rpc import expert_pb2, expert_pb2_grpc

    srv = expert_server_shm
    with tls.channel(srv.address, SECRET) as channel, pytest.raises(grpc.RpcError):  # (no secret)
        expert_pb2_grpc.ExpertStub(channel).Stats(expert_pb2.StatsRequest(), timeout=10)
    status = {"workers": [{"id": "expert-0", "state": "serving", "address": srv.address}]}
    with router_client(tmp_path, monkeypatch, balancer=FakeBalancer(status, SECRET)) as client:
        text = client.get("/metrics").text
    assert 'moe_data_plane_refused_total{reason="no_secret",transport="grpc"} 1.0' in text, text[-2000:]


# ---- the router in process (no Ray), as tests/test_router_http.py drives it --------------------
class FakeBalancer:
    """Where the balancer's actor handle would be: its status and the data-plane secret."""

    def __init__(self, status: dict, secret: str):
        async def value(v):
            return v

        self.status = RemoteCall(lambda: value(status))
        self.data_plane_secret = RemoteCall(lambda: value(secret))


class FakeWorker:
    """Where an attention worker's handle would be: records each request (prompt, params) and
    streams `answer(prompt, params)`'s RequestOutputs."""

    def __init__(self, answer):
        import asyncio

        self.requests: list[tuple[list[int], dict]] = []

        async def generate(prompt, params, request_id, resumed, owner):
            self.requests.append((list(prompt), dict(params)))
            for item in answer(list(prompt), dict(params), request_id):
                future = asyncio.get_running_loop().create_future()
                future.set_result(item)
                yield future

        async def no_stats():
            raise RuntimeError("no stats here")

        self.generate = RemoteCall(generate)
        self.stats = RemoteCall(no_stats)
        self.abort = RemoteCall(lambda *_: None)
        self.keepalive = RemoteCall(lambda *_: None)


@contextlib.contextmanager
def router_client(tmp_path, monkeypatch, worker=None, balancer=None, **cfg):
    """A starlette TestClient on the router's FastAPI app: a RouterCore on a tokenizer-only model,
    `worker` where the attention worker would be, `balancer` where the balancer would be."""
    import types

    from starlette.testclient import TestClient

    from services.presets import write_tokenizer
    from services.router import app as router_app

    write_tokenizer(tmp_path, 1024)
    worker = worker or FakeWorker(lambda *a: [])
    monkeypatch.setattr(
        router_app.ray,
        "get_actor",
        lambda name, namespace=None: balancer if name == "moe-balancer" else worker,
    )
    cls = router_app.Router.func_or_class.__mro__[1]  # (the class under Serve's ingress wrapper)
    instance = cls.__new__(cls)
    instance.__init__(RouterConfig(str(tmp_path), "tiny", ["moe-attn-0"], balancer="moe-balancer" if balancer else None,
                                   max_model_len=1 << 16, **cfg))  # fmt: skip
    monkeypatch.setattr(
        router_app.serve, "get_replica_context", lambda: types.SimpleNamespace(servable_object=instance)
    )
    with TestClient(router_app.app, raise_server_exceptions=False) as client:
        client.router = instance
        yield client


# ---- a budget on each answer; prompt logprobs once per prompt (#52) -----------------------------
AUTH = {"Authorization": "Bearer k"}


def _answer(prompt: list[int], params: dict, request_id: str):
    """One generated token with its logprobs, and the prompt's logprobs when asked for."""
    from services.engine.outputs import RequestOutput
    from services.engine.sampling import TokenLogprobs

    plps = None
    if params.get("prompt_logprobs") is not None:
        plps = [None] + [TokenLogprobs(-1.0 - i, [(t, -1.0 - i)], rank=1) for i, t in enumerate(prompt[1:])]
    lps = (
        [TokenLogprobs(-0.5, [(7, -0.5)] * (params.get("logprobs") or 0))]
        if params.get("logprobs") is not None
        else []
    )
    return [RequestOutput(request_id, token_ids=[7], logprobs=lps, text="x", finished=True, finish_reason="length",
                          num_prompt_tokens=len(prompt), num_output_tokens=1, prompt_logprobs=plps)]  # fmt: skip


def test_an_answer_over_the_logprob_budget_is_a_400_naming_the_limit(tmp_path, monkeypatch):
    from services.router.protocol import MAX_LOGPROB_ENTRIES

    worker = FakeWorker(_answer)
    with router_client(tmp_path, monkeypatch, worker, api_key="k") as client:
        # 256 prompts x n=16 with echo + logprobs=20: ~7M entries from a ~100 KB body
        big = {
            "model": "tiny",
            "prompt": [[5] * 64] * 256,
            "n": 16,
            "echo": True,
            "logprobs": 20,
            "max_tokens": 16,
        }
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": True,
                "top_logprobs": 20, "max_tokens": 1 << 14}  # fmt: skip
        for path, body, param in (("/v1/completions", big, "logprobs"), ("/v1/chat/completions", chat, "top_logprobs"),
                                  ("/v1/completions", {**big, "logprobs": None, "echo": False, "prompt_logprobs": 20},
                                   "prompt_logprobs")):  # fmt: skip
            r = client.post(path, json=body, headers=AUTH)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert "max_logprob_entries" in err["message"] and str(MAX_LOGPROB_ENTRIES) in err["message"], err
            assert err["param"] == param
        assert worker.requests == []  # (refused before any generation)
        ok = client.post("/v1/completions", json={**big, "prompt": [[5] * 64] * 4, "n": 2}, headers=AUTH)
        assert ok.status_code == 200, ok.text
        assert len(worker.requests) == 8


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_computed_once_per_prompt_and_every_choice_carries_them(
    tmp_path, monkeypatch, stream
):
    import json

    worker = FakeWorker(_answer)
    prompts = [[3, 4, 5, 6], [9, 10, 11]]
    body = {"model": "tiny", "prompt": prompts, "n": 3, "echo": True, "logprobs": 1, "prompt_logprobs": 2,
            "max_tokens": 1, "stream": stream}  # fmt: skip
    with router_client(tmp_path, monkeypatch, worker, api_key="k") as client:
        r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    asked = [params["prompt_logprobs"] for _, params in worker.requests]
    assert len(asked) == 6 and sorted(asked, key=str) == [2, 2, None, None, None, None]  # (one per prompt)
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        firsts = {}
        for c in chunks:
            for choice in c["choices"]:
                firsts.setdefault(choice["index"], choice)
        choices = [firsts[i] for i in range(6)]
    else:
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice in choices:
        prompt = prompts[choice["index"] // 3]
        assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None
        assert choice["prompt_logprobs"][1][str(prompt[1])]["logprob"] == -1.0
        echoed = choice["logprobs"]["token_logprobs"]  # (echo: the prompt's logprobs first)
        assert echoed[: len(prompt)] == [None] + [-1.0 - i for i in range(len(prompt) - 1)], echoed


# ---- chat templating and tokenisation off the event loop (#52) ---------------------------------
def test_large_chat_inputs_are_templated_and_tokenized_off_the_event_loop(tmp_path, monkeypatch):
    import asyncio
    import time

    import httpx

    from services.router import app as router_app

    worker = FakeWorker(_answer)
    with router_client(tmp_path, monkeypatch, worker, api_key="k") as client:
        tokenizer = client.router.core.tokenizer
        real_template, real_encode = tokenizer.apply_chat_template, tokenizer.encode

        def slow(real):
            def call(*args, **kwargs):
                time.sleep(0.6)  # (as megabytes of text would take)
                return real(*args, **kwargs)

            return call

        monkeypatch.setattr(tokenizer, "apply_chat_template", slow(real_template))
        monkeypatch.setattr(tokenizer, "encode", slow(real_encode))
        text = "word " * 10_000  # (50,000 characters)
        bodies = [("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                            "max_tokens": 1}),
                  ("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1}),
                  ("/tokenize", {"messages": [{"role": "user", "content": text}]})]  # fmt: skip

        async def answered(http, path: str, body: dict) -> None:
            """`body` to `path` while a ticker runs on the same event loop: it must keep ticking."""
            ticks, done = [], asyncio.Event()

            async def ticker():
                while not done.is_set():
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.01)

            async def request():
                try:
                    return await http.post(path, json=body, headers=AUTH, timeout=30)
                finally:
                    done.set()

            reply, _ = await asyncio.gather(request(), ticker())
            assert reply.status_code == 200, (path, reply.text)
            gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
            assert len(ticks) > 1, f"{path}: the event loop did not run while it was answered"
            assert ticks[-1] - ticks[0] >= 0.6 and max(gaps) < 0.3, (path, max(gaps))

        async def main():
            transport = httpx.ASGITransport(app=router_app.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
                for path, body in bodies:
                    await answered(http, path, body)

        asyncio.run(main())


# ---- the balancer validates what it reads from Redis (#52) -------------------------------------
@pytest.fixture
def embedded_redis():
    server = EmbeddedRedis.start()
    yield server
    server.stop()


def _balancer_on(redis_url: str, model_dir):
    import dataclasses

    from services.balancer.service import BalancerConfig, BalancerCore
    from services.settings import SharedSettings

    shared = dataclasses.replace(SharedSettings(), redis_url=redis_url)
    return BalancerCore(BalancerConfig(model=str(model_dir), shared=shared))


def test_the_balancer_ignores_a_malformed_placement_in_redis(embedded_redis, tiny_model, caplog):
    import json

    from services.dataplane.placement import Placement

    core = _balancer_on(embedded_redis.url, tiny_model)
    m, client = core.model_cfg, connect(embedded_redis.url)
    good = Placement.round_robin(
        m.num_moe_layers, m.n_routed_experts, ("w0", "w1"), m.n_routed_experts
    ).to_dict()
    rows = good["phy2log"]
    garbage = [
        b"not json {",
        b"[" * 100_000,  # (deeper than the JSON parser recurses)
        json.dumps("a string"),
        json.dumps({"version": 1}),
        json.dumps({**good, "version": "1"}),
        json.dumps({**good, "version": 10**30}),
        json.dumps({**good, "version": -1}),
        json.dumps({**good, "version": True}),
        json.dumps({**good, "phy2log": rows[:-1]}),  # (a layer short)
        json.dumps({**good, "phy2log": [rows[0][:-1]] + rows[1:]}),  # (ragged)
        json.dumps({**good, "phy2log": [[10**6] * len(rows[0])] * len(rows)}),  # (no such expert)
        json.dumps({**good, "phy2log": [[0] * len(rows[0])] * len(rows)}),  # (experts with no slot)
        json.dumps({**good, "phy2log": [[[0]] * len(rows[0])] * len(rows)}),
        json.dumps({**good, "workers": []}),
        json.dumps({**good, "workers": ["w0", "w0"]}),
        json.dumps({**good, "workers": [1, 2]}),
        json.dumps({**good, "workers": ["a", "b", "c"] * 7}),  # (does not divide the slots)
        b"x" * (17 << 20),  # (too large to read)
    ]
    for raw in garbage:
        client.set("moe:placement", raw)
        caplog.clear()
        assert core._persisted() is None, raw[:80]
        assert "placement" in caplog.text, raw[:80]  # (logged)
    client.set("moe:placement", json.dumps(good))
    persisted = core._persisted()
    assert persisted is not None and persisted.to_dict() == good


def test_the_balancer_skips_malformed_load_entries_in_redis(embedded_redis, tiny_model, caplog):
    from services.redis_store import current_bucket, load_key

    core = _balancer_on(embedded_redis.url, tiny_model)
    m, client = core.model_cfg, connect(embedded_redis.url)
    bucket = current_bucket(core.shared.bucket_seconds)
    key = load_key(core.shared.key_prefix, bucket)
    client.hset(key, mapping={"0:1": 5, "0:2": 7, "x:y": 3, "0": 1, "1:2:3": 1, "0:3": "lots", "0:4": -9,
                              "0:5": "9" * 5000, "0:6": 2**63, f"{m.num_moe_layers + 5}:1": 4})  # fmt: skip
    client.set(load_key(core.shared.key_prefix, bucket - 1), "not a hash")
    loads = core.read_loads()
    assert loads is not None and loads.shape == (m.num_moe_layers, m.n_routed_experts)
    assert loads[0, 1] == 5 and loads[0, 2] == 7 and int(loads.sum()) == 12  # (the good entries count)
    assert "ignored 8 malformed load entries" in caplog.text
    assert core._loads() is loads
