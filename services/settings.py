"""Settings every service of one cluster must agree on, in one place.

The launcher builds one `SharedSettings` from the cluster config and hands the same object to
the balancer and the attention workers (the router gets its namespace), so that load counts
written by attention workers land where the balancer reads them and every actor is found under
the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

NAMESPACE = "moe-cluster"
BALANCER_NAME = "moe-balancer"


@dataclass(frozen=True)
class SharedSettings:
    namespace: str = NAMESPACE  # Ray namespace of every named actor
    redis_url: str | None = None  # load counts and the persisted placement; None: no Redis
    key_prefix: str = "moe"  # Redis keys: {prefix}:load:{bucket}, {prefix}:placement
    bucket_seconds: float = 2.0  # width of one load-count time bucket
    ttl_seconds: int = 600  # a load bucket expires this long after its last write
    # the data plane's shared secret (services/dataplane/auth.py): every expert call carries it; None: open
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.bucket_seconds <= 0 or self.ttl_seconds <= 0:
            raise ValueError("bucket_seconds and ttl_seconds must be > 0")


def attention_worker_name(index: int) -> str:
    return f"moe-attn-{index}"


def expert_worker_name(worker_id: str) -> str:
    return f"moe-{worker_id}"


EXPERT_WORKER_NAME = re.compile(r"^moe-(expert-(\d+))$")  # expert_worker_name's: worker id, index
