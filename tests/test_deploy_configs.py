"""The files in deploy/: Ray's own validation of the `ray up` configs, our schemas for the app settings
(ClusterConfig, Serve's ServeDeploySchema), a structural lint of the Kubernetes manifests and the
Dockerfile, the consistency between them (resources the app asks for are offered by the machines,
one image and Ray version everywhere, Redis and model wired the same way), and the head's start
script run for real (secrets, password-protected Redis, the generated app config)."""

import contextlib
import copy
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import ray
import redis
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from services import serve as serve_app
from services.cluster import ClusterConfig
from services.net import free_port

DEPLOY = Path(__file__).parent.parent / "deploy"
RAY_UP = sorted(DEPLOY.glob("ray-up-*.yaml"))
ROLES = ("attention_node", "expert_node")
SECRETS = {"MOE_REDIS_URL": "redis://:secret@moe-redis:6379/0", "MOE_API_KEY": "key"}


def load(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


def load_all(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def cluster_config() -> ClusterConfig:
    return ClusterConfig.from_yaml(DEPLOY / "cluster.yaml")


def rayservice() -> dict:
    (doc,) = [d for d in load_all("kuberay-rayservice.yaml") if d["kind"] == "RayService"]
    return doc


def serve_configs() -> dict[str, ServeDeploySchema]:
    return {
        "serve.yaml": ServeDeploySchema.model_validate(load("serve.yaml")),
        "kuberay serveConfigV2": ServeDeploySchema.model_validate(
            yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
        ),
    }


def start_resources(params: dict) -> dict[str, float]:
    """KubeRay's rayStartParams.resources ('"{\\"expert_node\\": 2}"') -> {"expert_node": 2}."""
    raw = params.get("resources")
    return json.loads(raw.strip('"').replace('\\"', '"')) if raw else {}


def capacity(offers: list[tuple[dict[str, float], int]], wants: dict[str, float]) -> int:
    """Workers asking for `wants` that fit on machines [(resources, count)]."""
    total = 0
    for resources, count in offers:
        if all(k in resources for k in wants):
            total += count * int(min(resources[k] // v for k, v in wants.items()))
    return total


# --------------------------------------------------------------------------------------------------
# `ray up` files: Ray's own validation, roles and capacity
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_ray_up_configs_pass_rays_validation(path):
    raw = yaml.safe_load(path.read_text())
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    commands = " ".join(raw["head_start_ray_commands"] + raw["worker_start_ray_commands"])
    for script in re.findall(r"deploy/([\w.-]+)", commands):  # every file a command names exists
        assert (DEPLOY / script).is_file(), script
    assert "start-head.sh" in " ".join(raw["head_start_ray_commands"])


@pytest.mark.parametrize("script", sorted(DEPLOY.glob("*.sh")), ids=lambda p: p.name)
def test_scripts_are_valid_posix_sh(script):
    subprocess.run(["sh", "-n", str(script)], check=True)
    assert script.read_text().startswith("#!/bin/sh\n")


def test_onprem_provider_takes_a_single_node_type():
    """Why deploy/ray-up-onprem.yaml has no node types: Ray's local provider refuses them."""
    raw = load("ray-up-onprem.yaml")
    assert raw["provider"]["type"] == "local" and "available_node_types" not in raw
    from click import ClickException  # (what Ray's config check raises)

    with pytest.raises(ClickException, match="available_node_types"):
        prepare_config({**raw, "available_node_types": {"experts": {"resources": {}, "node_config": {}}}})


def node_resources(ip: str, *flags: str, roles: Path = DEPLOY / "node-roles") -> dict[str, float]:
    """What deploy/node-resources.sh prints on a machine with this IP (flags: `--head`)."""
    out = subprocess.run(
        ["sh", str(DEPLOY / "node-resources.sh"), *flags, str(roles)],
        env={**os.environ, "MOE_NODE_IPS": f"203.0.113.9 {ip}"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_onprem_roles_fit_the_app():
    raw = load("ray-up-onprem.yaml")
    head, workers = raw["provider"]["head_ip"], raw["provider"]["worker_ips"]
    assert raw["min_workers"] == raw["max_workers"] == len(workers)
    assert node_resources("198.51.100.7") == {"expert_node": 1}  # unlisted machine: one expert worker
    assert not set(node_resources(head)) & set(ROLES)  # the head has no worker role
    machines = [node_resources(ip) for ip in workers]
    assert all(len(set(m) & set(ROLES)) == 1 for m in machines)  # one role per machine
    cfg = cluster_config()
    offers = [(m, 1) for m in machines]
    assert capacity(offers, cfg.attention_resources) >= cfg.attention_workers
    assert capacity(offers, cfg.expert_resources) == cfg.expert_workers  # every expert machine filled
    expert_sizes = {m["expert_node"] for m in machines if "expert_node" in m}
    assert len(expert_sizes) == 1  # the same workers per node: EPLB's hierarchical policy applies


def test_cloud_node_types_fit_the_app():
    raw = load("ray-up-aws-gpu.yaml")
    types = raw["available_node_types"]
    assert not set(types[raw["head_node_type"]]["resources"]) & set(ROLES)
    roles = {name: set(t["resources"]) & set(ROLES) for name, t in types.items()}
    assert sorted(r for rs in roles.values() for r in rs) == sorted(ROLES)  # one node type per role
    (app,) = re.findall(r"start-head\.sh \S+/([\w.-]+\.yaml)", " ".join(raw["head_start_ray_commands"]))
    assert app == "cluster-gpu.yaml"
    cfg = ClusterConfig.from_yaml(DEPLOY / app)
    assert cfg.attention_gpus > 0 and cfg.expert_gpus > 0  # GPU machines: the workers compute on them
    attention = {**cfg.attention_resources, "GPU": cfg.attention_gpus}
    experts = {**cfg.expert_resources, "GPU": cfg.expert_gpus}
    offers = [(t["resources"], t.get("min_workers", 0)) for t in types.values()]
    assert capacity(offers, attention) >= cfg.attention_workers
    assert capacity(offers, experts) == cfg.expert_workers
    most = [(t["resources"], t.get("max_workers", 0)) for t in types.values()]
    assert capacity(most, experts) > cfg.expert_workers  # room to scale the pool
    for t in types.values():  # no GPU idle for want of a role unit, no role unit without a GPU
        role = set(t["resources"]) & set(ROLES)
        if role:
            wants = attention if "attention_node" in role else experts
            assert t["resources"]["GPU"] == capacity([(t["resources"], 1)], wants) * wants["GPU"]
    assert raw["docker"]["image"] == image_of_manifests()


# --------------------------------------------------------------------------------------------------
# App settings: ClusterConfig and Serve configs
# --------------------------------------------------------------------------------------------------


def test_cluster_yaml_is_valid_cluster_config():
    cfg = cluster_config()
    assert cfg.address == "auto" and cfg.host == "0.0.0.0"
    assert set(cfg.attention_resources) == {"attention_node"} and set(cfg.expert_resources) == {"expert_node"}
    assert cfg.redis_url is None and cfg.api_key is None  # secrets come from start-head.sh


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-gpu.yaml"])
def test_cluster_yaml_nested_by_section_is_the_same_config(name, tmp_path):
    """The flat keys of the deploy files, nested under their sections (`attention: {tp: 1}`), give
    the same ClusterConfig."""
    flat = load(name)
    settings, nested = ClusterConfig.settings(), {}
    for key, value in flat.items():
        s = settings[key]
        if s.section is None:
            nested[key] = value
        else:
            nested.setdefault(s.section, {})[s.name] = value
    assert set(nested) & {"attention", "experts", "balancer", "router"}
    (tmp_path / name).write_text(yaml.safe_dump(nested))
    assert ClusterConfig.from_yaml(tmp_path / name) == ClusterConfig.from_yaml(DEPLOY / name)


@pytest.mark.parametrize("name", ["serve.yaml", "kuberay serveConfigV2"])
def test_serve_configs_build_the_app(name):
    schema = serve_configs()[name]
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    builder = getattr(serve_app, attr)
    assert module == serve_app.__name__ and len(inspect.signature(builder).parameters) == 1
    cfg = serve_app.app_config(app.args, environ=SECRETS)
    assert cfg.redis_url  # from args or MOE_REDIS_URL
    # the same app everywhere: the Serve configs agree with deploy/cluster.yaml
    base = cluster_config()
    for key, value in app.args.items():
        if key != "redis_url":
            assert value == getattr(base, key), key


def test_kuberay_app_takes_secrets_from_the_environment():
    (app,) = serve_configs()["kuberay serveConfigV2"].applications
    assert "redis_url" not in app.args and "api_key" not in app.args
    cfg = serve_app.app_config(app.args, environ=SECRETS)
    assert cfg.redis_url == SECRETS["MOE_REDIS_URL"] and cfg.api_key == "key"
    with pytest.raises(ValueError, match="redis_url"):
        serve_app.app_config(app.args, environ={})
    explicit = serve_app.app_config({**app.args, "api_key": "from-args"}, environ=SECRETS)
    assert explicit.api_key == "from-args"  # args win over the environment


# --------------------------------------------------------------------------------------------------
# Kubernetes manifests
# --------------------------------------------------------------------------------------------------

API_VERSIONS = {
    "RayService": "ray.io/v1",
    "Deployment": "apps/v1",
    "Service": "v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "PersistentVolumeClaim": "v1",
    "StatefulSet": "apps/v1",
}
MANIFESTS = sorted(DEPLOY.glob("kuberay-*.yaml"))


def pod_templates() -> dict[str, dict]:
    """Pod templates of the RayService by group ("head", "attention", "experts")."""
    spec = rayservice()["spec"]["rayClusterConfig"]
    pods = {"head": spec["headGroupSpec"]}
    pods.update({g["groupName"]: g for g in spec["workerGroupSpecs"]})
    return pods


def image_of_manifests() -> str:
    (image,) = {c["image"] for g in pod_templates().values() for c in g["template"]["spec"]["containers"]}
    return image


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_are_well_formed(path):
    docs = load_all(path.name)
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") == API_VERSIONS[doc.get("kind")], doc.get("kind")
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert isinstance(doc.get("spec"), dict)


def test_rayservice_groups_offer_what_the_app_asks_for():
    (app,) = serve_configs()["kuberay serveConfigV2"].applications
    cfg = serve_app.app_config(app.args, environ=SECRETS)
    groups = pod_templates()
    offers = {name: start_resources(g["rayStartParams"]) for name, g in groups.items()}
    assert not set(offers["head"]) & set(ROLES)
    assert offers["attention"].keys() & set(ROLES) == {"attention_node"}
    assert offers["experts"].keys() & set(ROLES) == {"expert_node"}
    running = [(offers[n], g.get("minReplicas", g.get("replicas", 1))) for n, g in groups.items()]
    assert capacity(running, cfg.attention_resources) >= cfg.attention_workers
    assert capacity(running, cfg.expert_resources) == cfg.expert_workers
    most = [(offers[n], g.get("maxReplicas", 1)) for n, g in groups.items()]
    assert capacity(most, cfg.expert_resources) > cfg.expert_workers  # the autoscaler can add pods
    assert rayservice()["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_rayservice_pods_share_image_model_secrets_and_redis():
    (app,) = serve_configs()["kuberay serveConfigV2"].applications
    (pvc,) = load_all("kuberay-models-pvc.yaml")
    redis_docs = {d["kind"]: d for d in load_all("kuberay-redis.yaml")}
    redis_service, redis_policy = redis_docs["Service"], redis_docs["NetworkPolicy"]
    redis_secret = redis_docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"][0]
    image_of_manifests()  # one image for every pod
    for name, group in pod_templates().items():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        labels = group["template"]["metadata"]["labels"]
        # Redis admits the pod
        assert (
            redis_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items()
            <= labels.items()
        )
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get("serve") == 8000, name
        if name == "head":
            assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        (model_mount,) = [m for path, m in mounts.items() if app.args["model"].startswith(path + "/")]
        assert model_mount["readOnly"] is True
        assert volumes[model_mount["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        env = {e["name"]: e for e in container["env"]}
        # the Redis URL points at the Service of kuberay-redis.yaml, with the password of its Secret
        url = urlparse(env["MOE_REDIS_URL"]["value"].replace("$(MOE_REDIS_PASSWORD)", "pw"))
        assert (url.scheme, url.hostname, url.port, url.password) == (
            "redis",
            redis_service["metadata"]["name"],
            redis_service["spec"]["ports"][0]["port"],
            "pw",
        )
        assert env["MOE_REDIS_PASSWORD"]["valueFrom"] == redis_secret["valueFrom"]
        assert list(env).index("MOE_REDIS_PASSWORD") < list(env).index("MOE_REDIS_URL")  # $(VAR) needs order
        # KubeRay refuses a head pod with these when gcsFaultToleranceOptions is set (it sets them itself)
        assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS", "REDIS_USERNAME"} & set(env), name
        assert (
            env["MOE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"]
            == redis_secret["valueFrom"]["secretKeyRef"]["name"]
        )


def test_redis_deployment_and_service_select_each_other():
    docs = {d["kind"]: d for d in load_all("kuberay-redis.yaml")}
    deployment, service = docs["Deployment"], docs["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert docs["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert "--requirepass" in container["args"]


def test_dockerfile_installs_the_project_on_rays_py311_image():
    text = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M).group(1)
    assert version == ray.__version__ == rayservice()["spec"]["rayClusterConfig"]["rayVersion"]
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", text, re.M).group(1)
    assert base.startswith("rayproject/ray:${RAY_VERSION}-py311")
    assert re.search(r"^FROM \$\{RAY_IMAGE\}$", text, re.M)
    for src in re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, re.M):
        assert (DEPLOY.parent / src).exists(), src
    assert "pip install --no-cache-dir -c /tmp/ray-constraint.txt ." in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("**") + 1 :][:2] == ["!pyproject.toml", "!README.md"]  # .venv stays out


# --------------------------------------------------------------------------------------------------
# The head's start script, for real
# --------------------------------------------------------------------------------------------------


def test_start_head_script_runs_redis_with_a_password_and_writes_the_app_config(tmp_path):
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "MOE_REDIS_PORT": str(port), "MOE_START_APP": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    state = home / ".moe-cluster"
    try:
        subprocess.run(["sh", str(DEPLOY / "start-head.sh"), str(DEPLOY / "cluster.yaml")], env=env,
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        assert not (state / "app.pid").exists()  # MOE_START_APP=0: Redis and config only
        assert oct(state.stat().st_mode & 0o777) == "0o700"
        assert oct((state / "api-key").stat().st_mode & 0o777) == "0o600"
        cfg = ClusterConfig.from_yaml(state / "cluster.yaml")
        assert cfg.api_key == (state / "api-key").read_text().strip()
        assert cfg.expert_workers == cluster_config().expert_workers
        assert urlparse(cfg.redis_url).port == port
        url = urlparse(cfg.redis_url)
        assert _ping(redis.Redis(host="127.0.0.1", port=port, password=url.password))
        with pytest.raises(redis.AuthenticationError):  # no password: refused
            redis.Redis(host="127.0.0.1", port=port).ping()
        assert _ping(redis.Redis.from_url(cfg.redis_url))  # the URL the app gets, on the head's IP
    finally:
        for name in ("redis.pid", "watchdog.pid"):  # only what the script started
            pidfile = state / name
            if pidfile.exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pidfile.read_text()), signal.SIGTERM)


def _ping(client: redis.Redis, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.ping()
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_rayservice_gcs_keeps_its_tables_in_a_redis_of_its_own():
    """GCS fault tolerance: the GCS's Redis is deploy/kuberay-gcs-redis.yaml's, not the app's (which
    may lose its data): persistent (append-only file on a PVC, fsync every second), no eviction, no
    idle timeout, a password from the Secret, reachable from the head pod only
    (tests/faults/test_gcs_restart.py shows what GCS fault tolerance buys on one machine)."""
    spec = rayservice()["spec"]["rayClusterConfig"]
    ft = spec["gcsFaultToleranceOptions"]
    docs = {d["kind"]: d for d in load_all("kuberay-gcs-redis.yaml")}
    statefulset, service, policy = docs["StatefulSet"], docs["Service"], docs["NetworkPolicy"]
    app_service = {d["kind"]: d for d in load_all("kuberay-redis.yaml")}["Service"]
    host, port = ft["redisAddress"].split(":")
    assert host == service["metadata"]["name"] != app_service["metadata"]["name"]
    assert int(port) == service["spec"]["ports"][0]["port"]
    env = {e["name"]: e for e in pod_templates()["head"]["template"]["spec"]["containers"][0]["env"]}
    assert host not in env["MOE_REDIS_URL"]["value"]  # the app keeps its own Redis
    # selectors
    pod = statefulset["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert statefulset["spec"]["replicas"] == 1 and statefulset["spec"]["serviceName"] == host
    for selector in (statefulset["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     policy["spec"]["podSelector"]["matchLabels"]):  # fmt: skip
        assert selector.items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    # the password: the Secret key the RayService hands the GCS
    redis_env = {e["name"]: e for e in container["env"]}
    args = container["args"]
    (var,) = re.fullmatch(r"\$\((\w+)\)", args[args.index("--requirepass") + 1]).groups()
    assert redis_env[var]["valueFrom"] == ft["redisPassword"]["valueFrom"]
    secret = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] == "moe-cluster" and secret["key"] != "redis-password"  # not the app's password
    # persistence and no eviction
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "everysec"
    assert options["--maxmemory-policy"] == "noeviction" and options["--maxmemory"] == "0"
    assert options["--timeout"] == "0"  # Redis never drops the GCS's idle connection
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == options["--dir"]
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        and claim["spec"]["resources"]["requests"]["storage"]
    )
    # only the head (and KubeRay's Redis cleanup Job, built from the head's template) may connect
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    head_labels = pod_templates()["head"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= head_labels.items()
    (node_type,) = peer["podSelector"]["matchExpressions"]
    assert node_type["key"] == "ray.io/node-type" and node_type["operator"] == "In"
    assert set(node_type["values"]) == {"head", "redis-cleanup"}


# --------------------------------------------------------------------------------------------------
# The front door: router replicas and the balancer on the head, in every shipped setup
# --------------------------------------------------------------------------------------------------


def _control_fits(cfg: ClusterConfig, head: dict[str, float], workers: list[dict[str, float]]) -> None:
    """The head offers control_resources for every router replica and the balancer, plus one for a
    rolling update's extra replica; no worker machine offers any of it."""
    assert cfg.control_resources, "the router replicas and the balancer would go anywhere"
    units = cfg.router_replicas + 2  # replicas + the balancer + a rolling update's new replica
    for key, amount in cfg.control_resources.items():
        assert head.get(key, 0) >= units * amount, (key, head, cfg.router_replicas)
    for worker in workers:
        assert not set(worker) & set(cfg.control_resources), worker


def test_onprem_head_holds_the_front_door(tmp_path):
    raw = load("ray-up-onprem.yaml")
    (flags,) = re.findall(r"node-resources\.sh((?: --[\w-]+)*) ", " ".join(raw["head_start_ray_commands"]))
    (worker_flags,) = re.findall(
        r"node-resources\.sh((?: --[\w-]+)*) ", " ".join(raw["worker_start_ray_commands"])
    )
    head = node_resources(raw["provider"]["head_ip"], *flags.split())
    workers = [node_resources(ip, *worker_flags.split()) for ip in raw["provider"]["worker_ips"]]
    _control_fits(cluster_config(), head, workers + [node_resources("198.51.100.7", *worker_flags.split())])
    # deploy/ray-up-this-machine.sh's one machine: a roles line with both worker roles, and the head's units
    roles = tmp_path / "node-roles"
    roles.write_text('192.0.2.1 {"attention_node":1,"expert_node":3}\n')
    assert node_resources("192.0.2.1", *flags.split(), roles=roles) == {
        "head_node": 4, "attention_node": 1, "expert_node": 3}  # fmt: skip


def test_cloud_head_holds_the_front_door():
    raw = load("ray-up-aws-gpu.yaml")
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]["resources"]  # `ray up` hands them to the head's `ray start`
    workers = [t["resources"] for name, t in types.items() if name != raw["head_node_type"]]
    _control_fits(ClusterConfig.from_yaml(DEPLOY / "cluster-gpu.yaml"), head, workers)


def test_kuberay_head_holds_the_front_door():
    (app,) = serve_configs()["kuberay serveConfigV2"].applications
    cfg = serve_app.app_config(app.args, environ=SECRETS)
    groups = {name: start_resources(g["rayStartParams"]) for name, g in pod_templates().items()}
    _control_fits(cfg, groups.pop("head"), list(groups.values()))
