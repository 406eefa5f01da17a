"""The data plane's shared secret: only the cluster's own processes may call an expert worker.

Every service of a cluster gets the same secret (`SharedSettings.secret`: made at `moe-cluster up`
unless given). Clients send it as gRPC metadata on every call (`with_secret` wraps a channel);
an expert worker's server refuses a call without it, before any work, with UNAUTHENTICATED, and
counts the refusals by reason (`SecretCheck.refusals`, a `Refusals` that the TCP and shared-memory
servers count into as well: the worker's Stats carries them, the router's /metrics shows them as
moe_data_plane_refused_total{transport,reason}). The grpc.health.v1 service stays open: it tells
whether a worker serves and nothing else. The shared-memory transport carries the same secret in
its handshake (services/dataplane/shm.py). The comparison is constant-time. With the secret the
gRPC port and the TCP data plane are mutual TLS as well (tls.py): a stranger is cut in the
handshake, before any call of its is read; this check is the second lock.
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading

import grpc

log = logging.getLogger(__name__)

METADATA_KEY = "x-moe-cluster-secret"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def matches(secret: str, given: str | bytes | None) -> bool:
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode()
    return hmac.compare_digest(secret.encode(), given)


class Refusals:
    """Refused calls and connections of one expert worker, by (transport, reason): what strangers
    (or a misconfigured cluster) tried. Thread-safe.

    transport: "grpc", "tcp", "shm"; reason: "no_secret", "wrong_secret" (the secret check),
    "tls" (the TCP data plane's TLS handshake failed: no or another cluster's certificate; gRPC's
    own handshake failures happen inside grpc and are not counted), "handshake_timeout", "busy"
    (too many connections or handshakes at once), "bad_hello", "other_user" (shm: a process of
    another user), "unsealed" (shm: a buffer whose size was not sealed)."""

    def __init__(self):
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, transport: str, reason: str) -> None:
        with self._lock:
            self._counts[transport, reason] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def total(self, transport: str | None = None) -> int:
        with self._lock:
            return sum(n for (t, _), n in self._counts.items() if transport in (None, t))


class SecretCheck(grpc.ServerInterceptor):
    """Refuses every call (but health checks) that does not carry the cluster's secret, counted
    into `refusals` (transport "grpc")."""

    def __init__(self, secret: str, refusals: Refusals | None = None):
        if not secret:
            raise ValueError("the data-plane secret must not be empty")
        self.secret = secret
        self.refusals = refusals if refusals is not None else Refusals()

    @property
    def refused(self) -> int:
        """Calls refused so far."""
        return self.refusals.total("grpc")

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        given = next(
            (v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), None
        )
        if matches(self.secret, given):
            return continuation(handler_call_details)
        self.refusals.add("grpc", "no_secret" if given is None else "wrong_secret")
        log.warning(
            "refused %s: %s", method, "no cluster secret" if given is None else "wrong cluster secret"
        )
        return _refusal(continuation(handler_call_details))


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""
    if handler is None:
        return None

    def abort(request, context):
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "this expert worker serves its cluster only (no or wrong secret)"
        )

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip


class _AddSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: str):
        self.metadata = ((METADATA_KEY, secret),)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def with_secret(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """`channel`, sending `secret` with every call (unchanged when secret is None)."""
    return channel if secret is None else grpc.intercept_channel(channel, _AddSecret(secret))


def metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `secret` (for a call made without an intercepted channel)."""
    return None if secret is None else ((METADATA_KEY, secret),)
