"""The actors' rollout client against a real gRPC server over loopback that answers like a
stopping one (no JAX: the servicer is scripted)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from stoker.rollout.client import RemotePolicy
from stoker.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.asyncio


class CancelledOnce(rollout_pb2_grpc.RolloutServicer):
    """Cancels the first turn as a server shutting down does, answers the next."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: rollout_pb2.GenerateRequest, context: Any) -> rollout_pb2.GenerateResponse:
        self.calls += 1
        if self.calls == 1:
            await context.abort(grpc.StatusCode.CANCELLED, "Cancelling all calls")
        return rollout_pb2.GenerateResponse(token_ids=[7, 8], logprobs=[-0.5, -0.25], policy_versions=[3, 3], finished=True)


async def test_a_turn_the_stopping_server_cancels_is_sent_again() -> None:
    servicer = CancelledOnce()
    server = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    policy = RemotePolicy(f"127.0.0.1:{port}", actor_id="a", unavailable_seconds=20.0, seed=0)
    try:
        sampled = await policy.generate([1, 2], max_new_tokens=2, stop_token_ids=[], session="e")
        assert (sampled.token_ids, sampled.version, servicer.calls) == ([7, 8], 3, 2)
        assert policy.reconnects == 1
    finally:
        await policy.close()
        await server.stop(0)
