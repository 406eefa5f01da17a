"""Flush routed-token counts per (MoE layer, logical expert) to Redis, off the step path.

The step loop calls `add(counts)` (a tensor add under a lock, microseconds); a background thread
writes the accumulated counts into the current time bucket every `flush_seconds` with one
pipelined round trip. Redis being slow or down never stalls a step: counts stay pending (one
fixed-size tensor, so memory is bounded) and are flushed when Redis is back; counts pending
for longer than `max_pending_seconds` are dropped and added to `dropped_tokens`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis
import torch

from services.redis_store import connect, current_bucket, write_loads
from services.settings import SharedSettings

log = logging.getLogger(__name__)


@dataclass
class LoadReporterConfig:
    shared: SharedSettings  # redis_url (required), key_prefix, bucket_seconds, ttl_seconds
    flush_seconds: float = 1.0
    max_pending_seconds: float = 120.0


class LoadReporter:
    def __init__(self, cfg: LoadReporterConfig, num_moe_layers: int, num_experts: int):
        if not cfg.shared.redis_url:
            raise ValueError("LoadReporter needs SharedSettings.redis_url")
        self.cfg, self.shared = cfg, cfg.shared
        self._client = connect(cfg.shared.redis_url)
        self._pending = torch.zeros(num_moe_layers, num_experts, dtype=torch.long)
        self._pending_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.flushed_tokens = 0
        self._in_flight = 0  # counts taken by a flush and not yet written (or put back)
        self.dropped_tokens = 0
        self.failed_flushes = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="load-reporter", daemon=True)
        self._thread.start()

    def add(self, counts: torch.Tensor) -> None:
        with self._lock:
            self._pending += counts
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    def flush(self) -> bool:
        """Write pending counts now; True on success (or nothing to write)."""
        with self._lock:
            counts, since = self._pending.clone(), self._pending_since
            self._pending.zero_()
            self._pending_since = None
            self._in_flight = int(counts.sum())
        if since is None or not bool(counts.any()):
            return True
        try:
            shared = self.shared
            write_loads(self._client, shared.key_prefix, current_bucket(shared.bucket_seconds), counts,
                        shared.ttl_seconds)  # fmt: skip
            with self._lock:
                self.flushed_tokens += int(counts.sum())
                self._in_flight = 0
            self.last_error = None
            return True
        except (redis.RedisError, OSError) as e:
            self.failed_flushes += 1
            self.last_error = str(e)
            with self._lock:
                if time.monotonic() - since > self.cfg.max_pending_seconds:
                    self.dropped_tokens += int(counts.sum())
                else:
                    self._pending += counts
                    self._pending_since = min(since, self._pending_since or since)
                self._in_flight = 0
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.flush_seconds):
            self.flush()

    def stats(self) -> dict:
        with self._lock:
            unflushed = int(self._pending.sum()) + self._in_flight
        return {
            "flushed_tokens": self.flushed_tokens,
            "unflushed_tokens": unflushed,  # counted, not yet in Redis
            "dropped_tokens": self.dropped_tokens,
            "failed_flushes": self.failed_flushes,
            "redis_error": self.last_error,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
