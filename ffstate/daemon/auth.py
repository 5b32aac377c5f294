"""The token check on every call to the daemon's gRPC port, and its health checks, at a cost that does not depend on
what a caller without the token does.

gRPC's synchronous server gives each call a thread of its pool (``max_pushes + 16`` of them) and, for a method that
takes one request, waits on that thread for the request before its handler runs. A refusal that waited for it, or a
health check that did, would let a caller with no token hold every thread with calls that never send a message,
and every RPC of the job would then queue behind them. Both are answered here without reading anything: the
refusal by a request-streaming handler that aborts at once, ``Check`` by one that answers SERVING (the daemon
serves its one service whenever it answers at all). ``Watch`` is gRPC's own handler, which waits for its request:
it needs the token.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2

from ffstate import wire

log = logging.getLogger("ffstate.daemon")

HEALTH = "/grpc.health.v1.Health/"
LOG_EVERY = 1.0  # seconds between logged refusals (the rest are counted)


def _deny(requests: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong ffstate token (metadata '{wire.TOKEN_KEY}')")


def _serving(requests: Any, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED, before any handler runs and without reading the request, for a call without the job's token;
    a health ``Check`` passes without one (answered without reading its request; ``Watch``, gRPC's own, needs it)."""

    def __init__(self, token: str, on_refuse: Callable[[str], None] = lambda status: None):
        self._token, self._on_refuse = token, on_refuse
        # Request-streaming handlers whatever the method's kind: the request is never waited for.
        self._deny = {"unary_stream": grpc.stream_stream_rpc_method_handler(_deny)}
        self._refused = grpc.stream_unary_rpc_method_handler(_deny)
        self._check = grpc.stream_unary_rpc_method_handler(
            _serving, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        self._lock = threading.Lock()
        self._logged, self._quiet = 0.0, 0

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if details.method == HEALTH + "Check":
            return self._check
        meta = dict(details.invocation_metadata or ())  # Watch too: gRPC's own handler waits for its request
        if hmac.compare_digest(str(meta.get(wire.TOKEN_KEY, "")).encode(), self._token.encode()):
            return continuation(details)
        self._note(details.method)
        method = wire.METHODS.get(details.method.rsplit("/", 1)[-1])
        return self._deny.get(method.kind if method else "", self._refused)

    def _note(self, method: str) -> None:
        """Counts the refusal; logs one line a second at most, with how many were not."""
        self._on_refuse("UNAUTHENTICATED")
        now = time.monotonic()
        with self._lock:
            if now - self._logged < LOG_EVERY:
                self._quiet += 1
                return
            quiet, self._logged, self._quiet = self._quiet, now, 0
        more = f" (and {quiet} more calls since)" if quiet else ""
        log.warning("refused %s: missing or wrong token%s", method[:200], more)
