"""``RemotePolicy``: the actor's ``Policy`` over a rollout server's Generate RPC.

Back-off rules. ``RESOURCE_EXHAUSTED`` (the server's queue is full) is retried after the
server's ``retry-after-ms`` hint plus up to 25% jitter, for as long as the episode allows: the
server is up, only busy. ``UNAVAILABLE`` (restarting, or gone) is retried with exponential
backoff for ``unavailable_seconds`` at most, then the turn raises ``PolicyError`` and the episode
fails cleanly (the buffer's ``failedGroupPolicy`` handles its group). A restarted server has no
cache for the conversation; it prefills it from the prompt, which is always the whole
conversation.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Hashable, Sequence

import grpc

from stoker.channels import channel_options
from stoker.conversation.policy import PolicyError, Sampled
from stoker.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("stoker.actor")

RETRY_AFTER_KEY = "retry-after-ms"
UNAVAILABLE_SECONDS = 30.0
TURN_TIMEOUT_SECONDS = 600.0
END_SESSION_TIMEOUT_SECONDS = 2.0


class RemotePolicy:
    """Turns go to ``address``; sessions are named ``<actor_id>/<episode session>`` so they are
    unique across every actor the server serves. ``pin_weights``: ``weightSync:
    between-episodes``."""

    def __init__(
        self,
        address: str,
        *,
        actor_id: str,
        pin_weights: bool = False,
        unavailable_seconds: float = UNAVAILABLE_SECONDS,
        turn_timeout_seconds: float = TURN_TIMEOUT_SECONDS,
        seed: int | None = None,
    ):
        self.address = address
        self.actor_id = actor_id
        self.pin_weights = pin_weights
        self.unavailable_seconds = unavailable_seconds
        self.turn_timeout_seconds = turn_timeout_seconds
        self.version = -1  # the newest version seen in an answer (logs)
        self.backoffs = 0  # RESOURCE_EXHAUSTED answers waited out
        self.reconnects = 0  # UNAVAILABLE answers retried
        self._rng = random.Random(seed)
        self._channel: grpc.aio.Channel | None = None
        self._stub: rollout_pb2_grpc.RolloutStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _rollout(self) -> rollout_pb2_grpc.RolloutStub:
        loop = asyncio.get_running_loop()
        if self._stub is None or loop is not self._loop:  # an aio channel belongs to one event loop
            self._loop = loop
            self._channel = grpc.aio.insecure_channel(self.address, options=channel_options())
            self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        return self._stub

    def _session(self, session: Hashable) -> str:
        return "" if session is None else f"{self.actor_id}/{session}"

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        session: Hashable = None,
        temperature: float | None = None,
    ) -> Sampled:
        """One turn at the job's sampling temperature, or greedy (``temperature=0``: evaluation
        rounds). The server samples training turns at the temperature the trainer recomputes, so
        no other override is accepted."""
        if temperature not in (None, 0.0):
            raise ValueError(f"temperature {temperature}: a rollout server samples at the job's temperature, or greedily (0)")
        request = rollout_pb2.GenerateRequest(
            prompt_ids=list(prompt), max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
            session=self._session(session), pin_weights=self.pin_weights, greedy=temperature == 0.0,
        )
        loop = asyncio.get_running_loop()
        give_up_at: float | None = None
        delay = 0.05
        while True:
            try:
                reply = await self._rollout().Generate(request, timeout=self.turn_timeout_seconds)
                break
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.backoffs += 1
                    wait = retry_after_seconds(exc) * (1 + 0.25 * self._rng.random())
                    await asyncio.sleep(wait)  # the server's own hint: it is up, only saturated
                    continue
                # CANCELLED: a server stopping cancels the turns in flight (its GOAWAY); the turn
                # was never answered, so it is sent again like one that found the server down.
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    give_up_at = give_up_at or loop.time() + self.unavailable_seconds
                    if loop.time() < give_up_at:
                        self.reconnects += 1
                        await asyncio.sleep(delay * (1 + 0.25 * self._rng.random()))  # backoff on a down server
                        delay = min(delay * 2, 2.0)
                        continue
                    raise PolicyError(
                        f"rollout server {self.address} unavailable for {self.unavailable_seconds:g} s: {exc.details()}"
                    ) from None
                raise PolicyError(f"rollout server {self.address}: {code.name}: {exc.details()}") from None
        versions = list(reply.policy_versions)
        if len(reply.token_ids) == 0 or len(versions) != len(reply.token_ids) or len(set(versions)) != 1:
            raise PolicyError(f"rollout server {self.address} answered a turn of mixed or missing versions {versions}")
        self.version = max(self.version, versions[0])
        return Sampled(list(reply.token_ids), list(reply.logprobs), bool(reply.finished), versions[0])

    async def end_session(self, session: Hashable) -> None:
        """Best effort: a server that is down has forgotten the session anyway (and forgets
        idle ones itself)."""
        if session is None:
            return
        try:
            await self._rollout().EndSession(
                rollout_pb2.EndSessionRequest(session=self._session(session)), timeout=END_SESSION_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("EndSession %s: %s", session, exc.code().name)

    async def server_stats(self) -> rollout_pb2.RolloutStats:
        return await self._rollout().Stats(rollout_pb2.RolloutStatsRequest(), timeout=10.0)

    async def close(self) -> None:
        if self._channel is not None and self._loop is asyncio.get_running_loop():
            await self._channel.close()
        self._channel = self._stub = None


def retry_after_seconds(exc: grpc.aio.AioRpcError, default: float = 0.2) -> float:
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(int(value), 1) / 1000
            except ValueError:
                break
    return default
