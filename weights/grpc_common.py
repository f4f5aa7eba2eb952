"""What every gRPC server and client of the weight channel shares: the message size limits, the
chunk size of a streamed reply, and the bearer-token check (the single-blob ``WeightPublisher``,
each learner process's ``ShardServer`` and each rollout server's ``WeightRelay`` serve
``stoker.v1.Weights`` alike)."""

from __future__ import annotations

from typing import Any

import grpc

DEFAULT_CHUNK_BYTES = 1 << 20
# Room for one chunk plus framing, and for large subscribers' Latest calls.
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class BearerAuth(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith("/grpc.health."):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") != self._expected:
            return self._deny
        return continuation(handler_call_details)
