"""Ray's own control plane, closed by default: a local run's Ray on loopback with its token
required; a joined cluster (`--address`) checked to require Ray's token authentication first
(refused otherwise unless `allow_unauthenticated_ray`). docs/deploy.md, "Securing it"."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import ray

log = logging.getLogger(__name__)


def ray_token_file(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Ray's token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; None: RAY_AUTH_TOKEN holds
    it), made (a random token, mode 0600) if missing, narrowed to 0600 (Ray writes 0644)."""
    import secrets

    if environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))  # (as `ray get-auth-token --generate`; never logged)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            log.warning("%s could be read by other users: mode narrowed to 0600", path)
            path.chmod(0o600)
    return path


def gcs_requires_token(gcs_address: str, timeout_s: float = 10.0) -> bool:
    """Whether the GCS at "host:port" refuses a call without Ray's token (ConnectionError: none there)."""
    import grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/CheckAlive")(b"", timeout=timeout_s)
            return False
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise ConnectionError(f"no Ray GCS answers at {gcs_address}: {e.code().name}") from None


def _gcs_address(address: str) -> str:
    """The "host:port" `address` names ("auto": this machine's cluster), loopback kept as it is."""
    from ray._private.services import get_ray_address_from_environment

    found = get_ray_address_from_environment(address, None) if address in (None, "auto") else address
    if not found or ":" not in found:
        raise ConnectionError(f"no running Ray cluster found at {address!r}")
    return found


def check_ray_auth(address: str, allow_unauthenticated: bool = False) -> bool:
    """Before joining the Ray cluster at `address`: True if its GCS requires Ray's token (this process
    then sends it: RAY_AUTH_MODE=token), else PermissionError unless `allow_unauthenticated`."""
    if not address.startswith("ray://") and gcs_requires_token(_gcs_address(address)):  # (ray://: no GCS)
        return _ray_token_mode()
    msg = (f"the Ray cluster at {address} does not require Ray's token authentication: anyone who reaches "
           "its ports can run code there and read this cluster's secrets (docs/deploy.md, 'Securing it'). "
           "Start it with RAY_AUTH_MODE=token and a token on every node")  # fmt: skip
    if not allow_unauthenticated:
        raise PermissionError(msg + ", or pass --allow-unauthenticated-ray")
    log.warning("%s (joining anyway: --allow-unauthenticated-ray)", msg)
    return False


def _ray_token_mode() -> bool:  # (this process, and the Ray processes it starts, use Ray's token)
    os.environ["RAY_AUTH_MODE"] = "token"
    ray._raylet.Config.initialize("")  # (Ray reads its mode once: again, as its _enable_token_auth does)
    return True


@contextlib.contextmanager
def _single_machine_ray():
    """Ray's single-machine mode (as on macOS): node address 127.0.0.1, a Ray started inside binds to it."""
    from ray._private import ray_constants as rc

    saved = os.environ.get(rc.ENABLE_RAY_CLUSTERS_ENV_VAR, ""), rc.ENABLE_RAY_CLUSTER
    os.environ[rc.ENABLE_RAY_CLUSTERS_ENV_VAR], rc.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:  # (the Ray processes started inside keep it; this one gets its own setting back)
        os.environ[rc.ENABLE_RAY_CLUSTERS_ENV_VAR], rc.ENABLE_RAY_CLUSTER = saved
        if not saved[0]:
            del os.environ[rc.ENABLE_RAY_CLUSTERS_ENV_VAR]


@contextlib.contextmanager
def loopback_ray(allow_unauthenticated: bool = False):
    """A local Ray started inside: its ports on 127.0.0.1, its token required (unless allowed and disabled)."""
    if not (allow_unauthenticated and os.environ.get("RAY_AUTH_MODE") == "disabled"):
        ray_token_file()
        _ray_token_mode()
    with _single_machine_ray():
        yield


def join_ray(address: str, namespace: str) -> None:
    """ray.init(address=...); a cluster on loopback (a local `moe-cluster up`) from loopback too."""
    from ray._common.network_utils import is_localhost, parse_address

    local = not address.startswith("ray://") and is_localhost(parse_address(_gcs_address(address))[0])
    with _single_machine_ray() if local else contextlib.nullcontext():
        ray.init(address=address, namespace=namespace, log_to_driver=False)


def actor_state(actor) -> str:
    """Ray's word on `actor`: its state in the GCS's actor table (ALIVE, RESTARTING, DEAD, ...),
    read without calling the actor (a hung one would not answer)."""
    from ray._private.state import actors

    try:
        return actors(actor._actor_id.hex())["State"]
    except Exception as e:  # noqa: BLE001 (the GCS restarting: not proven either way)
        return f"unknown ({type(e).__name__})"
