"""Entry point for `serve deploy` / `serve run` and KubeRay's RayService:

    applications:
      - name: moe-cluster
        import_path: services.serve:app
        args: {model: /models/deepseek-v3, expert_workers: 8, redis_url: redis://redis:6379/0, ...}

`args` takes the keys of `moe-cluster up --config` (ClusterConfig). The balancer, expert workers
and attention workers start as detached named actors (found again on a re-deploy), then the
router is returned as the Serve application. Host and port come from Serve's own `http_options`.

Secrets need not sit in the Serve config (which `serve status` prints and a RayService CR holds in
plain text): when `redis_url` / `api_key` are not in `args`, they are read from the environment
variables MOE_REDIS_URL / MOE_API_KEY of the node that builds the app (e.g. from a K8s Secret).
"""

import os
from collections.abc import Mapping

from services.cluster import ClusterConfig, resolve_model, router_app, start_backend

SECRET_ENV = {"redis_url": "MOE_REDIS_URL", "api_key": "MOE_API_KEY", "expert_secret": "MOE_EXPERT_SECRET"}


def app_config(args: Mapping, environ: Mapping[str, str] = os.environ) -> ClusterConfig:
    """The cluster settings of a Serve app: `args`, plus secrets from `environ` where `args`
    leaves them out."""
    settings = dict(args)
    for key, env in SECRET_ENV.items():
        if not settings.get(key) and environ.get(env):
            settings[key] = environ[env]
    cfg = ClusterConfig.from_dict(settings)
    if not cfg.redis_url:
        raise ValueError(
            "serve deploy needs redis_url (or MOE_REDIS_URL): an external Redis every node can reach"
        )
    return cfg


def app(args: dict):
    cfg = app_config(args)
    backend = start_backend(cfg, resolve_model(cfg), cfg.redis_url, reuse=True)
    return router_app(cfg, backend)
