"""Which requests an attention worker is computing for callers that are still there.

A router replica that dies takes its HTTP connections with it, but the generations it started on
attention workers would run on to their last token for nobody. Each replica (an *owner*) renews a
lease on every attention worker every `router.RouterConfig.keepalive_s`; a request carries its
owner's id; a worker aborts the requests of an owner whose lease has lapsed. Pure bookkeeping,
driven by the actor (worker.py) with a monotonic clock.
"""

from __future__ import annotations


class OwnerLeases:
    """owner -> last renewal, and the requests each owner has running here."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}
        self._requests: dict[str, set[str]] = {}

    def renew(self, owner: str, now: float) -> None:
        self._seen[owner] = now

    def renew_all(self, now: float) -> None:
        """Every owner's lease renewed (grace after the caller's own clock stalled)."""
        for owner in self._seen:
            self._seen[owner] = now

    def start(self, owner: str, request_id: str, now: float) -> None:
        """A request of `owner` starts (its arrival renews the lease)."""
        self.renew(owner, now)
        self._requests.setdefault(owner, set()).add(request_id)

    def end(self, owner: str, request_id: str) -> None:
        running = self._requests.get(owner)
        if running is not None:
            running.discard(request_id)
            if not running:
                del self._requests[owner]

    def lapsed(self, now: float) -> list[str]:
        """The requests of owners not heard from for `timeout_s` (forgotten here: abort them once);
        owners with nothing running are forgotten too."""
        orphans = []
        for owner, seen in list(self._seen.items()):
            if now - seen <= self.timeout_s:
                continue
            orphans += sorted(self._requests.pop(owner, ()))
            del self._seen[owner]
        return orphans

    def running(self) -> dict[str, int]:
        return {owner: len(ids) for owner, ids in self._requests.items()}
