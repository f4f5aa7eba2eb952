"""The rollout server over real gRPC on loopback with a real JAX sampler: many actors' episodes at
once keep TiTO and per-token versions while the learner publishes; backpressure; a restart."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.actor.episode import FAILED, EpisodeLimits, run_group
from stoker.conversation.policy import PolicyError
from stoker.actor.environments import options_json
from stoker.actor.sandbox import SandboxConfig, inline_factory
from stoker.conversation.tokenization import text_interface
from stoker.model.model import init_model
from stoker.weights.channel import WeightPublisher, WeightSubscriber
from stoker.rollout.client import RemotePolicy
from stoker.rollout.server import SERVICE
from stoker.spec import RLJobSpec

from stoker.v1 import rollout_pb2, rollout_pb2_grpc

from .conftest import CONFIG, MAX_BATCH, ServerFactory, make_engine, teacher_forced, weights

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

STOP = 3
TURNS = 4
NEW_TOKENS = 5  # > segment_tokens (2): every turn spans several batching segments


class Conversation:
    """A scripted multi-turn episode: the environment's reply to a turn is a few fixed ids."""

    def __init__(self, index: int):
        self.ids = [1 + index % 7, 2 + index % 5, 4]
        self.sampled: list[tuple[int, int, float, int]] = []  # (position, id, log-prob, version)

    def add(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        for token, logprob in zip(token_ids, logprobs, strict=True):
            self.sampled.append((len(self.ids), token, logprob, version))
            self.ids.append(token)

    def reply(self, turn: int) -> None:
        self.ids += [5 + turn, 6]


async def _play(policy: RemotePolicy, conv: Conversation, session: str, turns: range) -> None:
    for turn in turns:
        sampled = await policy.generate(conv.ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[STOP], session=session)
        assert len(sampled.token_ids) == NEW_TOKENS or sampled.finished
        conv.add(sampled.token_ids, sampled.logprobs, sampled.version)
        conv.reply(turn)


def _assert_tito(conversations: list[Conversation], versions: set[int]) -> set[int]:
    """Every sampled id's recorded log-prob is the model's teacher-forced one under the version the
    token reports; returns the versions seen."""
    seen: set[int] = set()
    for version in versions:
        recomputed = teacher_forced(version, [c.ids for c in conversations])
        for conv, row in zip(conversations, recomputed, strict=True):
            mine = [(p, lp) for p, _, lp, v in conv.sampled if v == version]
            if mine:
                seen.add(version)
                positions = np.array([p for p, _ in mine])
                np.testing.assert_allclose(row[positions - 1], [lp for _, lp in mine], atol=2e-4)
    return seen


async def test_concurrent_actors_keep_tito_and_versions_while_weights_advance(
    serve: ServerFactory, tmp_path: Path
) -> None:
    publisher = WeightPublisher(directory=tmp_path / "weights")
    server = serve(weights=WeightSubscriber(directory=tmp_path / "weights"), weight_poll_seconds=0.02)
    address = f"127.0.0.1:{server.port}"
    # Three actors; the third pins each episode to the weights it started with (between-episodes).
    actors = [RemotePolicy(address, actor_id=f"actor-{i}", pin_weights=i == 2, seed=i) for i in range(3)]
    episodes = [(actors[i % 3], Conversation(i), f"episode-{i // 3}") for i in range(16)]  # ids repeat across actors

    await asyncio.gather(*(_play(p, c, s, range(2)) for p, c, s in episodes))
    publisher.publish(1, weights(1))  # mid-episode: every session is alive, between turns
    while (await actors[0].server_stats()).policy_version != 1:
        await asyncio.sleep(0.02)  # the server's weight follower polls the channel

    async def publish_during_turns() -> None:
        await asyncio.to_thread(publisher.publish, 2, weights(2))

    await asyncio.gather(*(_play(p, c, s, range(2, TURNS)) for p, c, s in episodes), publish_during_turns())
    for policy, _, session in episodes:
        await policy.end_session(session)

    conversations = [c for _, c, _ in episodes]
    assert _assert_tito(conversations, {0, 1, 2}) >= {0, 1}
    for policy, conv, _ in episodes:
        by_turn = [v for _, _, _, v in conv.sampled]
        if policy.pin_weights:
            assert set(by_turn) == {0}  # pinned: the whole episode on its first version
        else:
            assert by_turn == sorted(by_turn) and by_turn[0] == 0 and by_turn[-1] >= 1
    stats = await actors[0].server_stats()
    assert stats.ready and stats.requests_total == 16 * TURNS and stats.rejected_total == 0
    assert stats.policy_version == 2 and stats.kv_cache_bytes_total > 0
    # Every session ended (applied between segments): only the newest version is still held.
    while stats.kv_cache_bytes_used:
        await asyncio.sleep(0.01)
        stats = await actors[0].server_stats()
    assert list(stats.live_versions) == [2]
    for policy in actors:
        await policy.close()
    publisher.close()


async def test_backpressure_answers_retry_after_and_the_client_backs_off(serve: ServerFactory) -> None:
    engine = make_engine(max_queue=1)
    server = serve(engine, started=False, metrics_port=0)  # gRPC up, engine not running yet
    address = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = rollout_pb2_grpc.RolloutStub(channel)
        request = rollout_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=3, session="waiting")
        waiting = asyncio.ensure_future(stub.Generate(request))
        while engine.stats().queue_depth < 1:
            await asyncio.sleep(0.01)  # until the first call holds the only queue place
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(rollout_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=3, session="refused"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(refused.value.trailing_metadata() or ())
        assert 50 <= int(hint["retry-after-ms"]) <= 5000

        policy = RemotePolicy(address, actor_id="patient", seed=0)
        patient = asyncio.ensure_future(policy.generate([1, 2, 4], max_new_tokens=3, stop_token_ids=[], session="e"))
        while policy.backoffs < 1 and not patient.done():
            await asyncio.sleep(0.01)  # until it was refused at least once
        assert not patient.done()
        server.start()  # the engine drains the queue; the client's retry gets in
        sampled = await patient
        assert len(sampled.token_ids) == 3 and sampled.version == 0
        assert len((await waiting).token_ids) == 3
        [recomputed] = teacher_forced(0, [[1, 2, 4, *sampled.token_ids]])
        np.testing.assert_allclose(recomputed[2:], sampled.logprobs, atol=2e-4)
        status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        stats = await policy.server_stats()
        assert stats.rejected_total >= 2 and stats.max_batch == MAX_BATCH
        await policy.close()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert "stoker_rollout_rejected_total" in metrics and "stoker_rollout_queue_depth 0.0" in metrics


async def test_restart_mid_episode_retries_then_fails_the_episode_cleanly(serve: ServerFactory) -> None:
    first = serve()
    address = f"127.0.0.1:{first.port}"
    policy = RemotePolicy(address, actor_id="a", unavailable_seconds=20.0, seed=0)
    conv = Conversation(0)
    await _play(policy, conv, "e", range(1))
    first.stop(grace=0)

    # The server comes back on the same address while the actor is retrying its next turn; the new
    # server has no cache for the session and prefills the whole conversation.
    turn = asyncio.ensure_future(_play(policy, conv, "e", range(1, 3)))
    while policy.reconnects < 1 and not turn.done():
        await asyncio.sleep(0.01)  # until the actor has met the down server
    second = serve(port=first.port)
    await turn
    assert _assert_tito([conv], {0}) == {0}

    # Down for good: after its bounded retries each episode fails cleanly, and the group is whole
    # (the buffer masks or discards it by failedGroupPolicy).
    second.stop(grace=0)
    policy.unavailable_seconds = 0.3
    spec = RLJobSpec()
    sandbox = SandboxConfig("frozenlake", options_json(spec.environment.frozenlake), step_timeout_seconds=10.0)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=1, max_tokens=128)
    group = await run_group(policy, inline_factory(sandbox), text_interface(spec), "1", 2, limits=limits)
    assert [e.status for e in group] == [FAILED, FAILED]
    assert all(f"rollout server {address} unavailable" in e.status_reason for e in group)
    with pytest.raises(PolicyError):
        await policy.generate([1], max_new_tokens=1, stop_token_ids=[], session="x")
    await policy.close()


async def test_greedy_turns_are_the_argmax_and_record_the_temperature_one_logprob(serve: ServerFactory) -> None:
    """Evaluation rounds play greedily through the server too (GreedyPolicy over RemotePolicy):
    every id is the teacher-forced argmax, its log-prob the tau = 1 one; no other override."""
    from stoker.actor.evaluation import GreedyPolicy

    server = serve()
    policy = RemotePolicy(f"127.0.0.1:{server.port}", actor_id="eval")
    greedy = GreedyPolicy(policy)
    conversations = [Conversation(i) for i in range(3)]
    for conv in conversations:
        for turn in range(2):
            sampled = await greedy.generate(conv.ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[STOP], session=f"e{id(conv)}")
            conv.add(sampled.token_ids, sampled.logprobs, sampled.version)
            conv.reply(turn)
    recomputed = teacher_forced(0, [c.ids for c in conversations])
    model = init_model(CONFIG, seed=0)
    for conv, row in zip(conversations, recomputed, strict=True):
        ids = jnp.asarray([conv.ids])
        logits = np.asarray(model(ids, jnp.arange(len(conv.ids))[None], jnp.ones_like(ids)))[0]
        positions = np.array([p for p, _, _, _ in conv.sampled])
        assert [t for _, t, _, _ in conv.sampled] == list(logits[positions - 1].argmax(-1))
        np.testing.assert_allclose(row[positions - 1], [lp for _, _, lp, _ in conv.sampled], atol=2e-4)
    with pytest.raises(ValueError, match="job's temperature"):
        await policy.generate([1, 2], max_new_tokens=2, stop_token_ids=[STOP], temperature=0.7)
    await policy.close()
