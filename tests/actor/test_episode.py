"""Episodes are strictly token-in-token-out; masks, log-probs and versions line up."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import FAILED, OK, TIMEOUT, TRUNCATED, EpisodeLimits, run_episode, run_group
from stoker.actor.frozenlake import FrozenLake, FrozenLakeConfig
from stoker.conversation.policy import Sampled
from stoker.actor import policy as policy_module
from stoker.actor.policy import BatchedSampler, ScriptedPolicy
from stoker.actor.sandbox import InlineEnvironment, inline_factory
from stoker.conversation.tokenization import TextInterface
from stoker.trajectory import array_problem, from_proto, to_proto

LIMITS = EpisodeLimits(max_turns=10, max_new_tokens=4, max_tokens=512, episode_seconds=30)


class RecordingEnv:
    """Wraps an environment and records every observation text it returns."""

    def __init__(self, inner: InlineEnvironment):
        self.inner = inner
        self.observations: list[str] = []
        self.actions: list[str] = []

    async def reset(self, task_id: str, seed: int) -> Observation:
        obs = await self.inner.reset(task_id, seed)
        self.observations.append(obs.text)
        return obs

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        result = await self.inner.step(action)
        self.observations.append(result.observation.text)
        return result

    async def close(self) -> None:
        await self.inner.close()


class RecordingPolicy:
    """A scripted policy that remembers each prompt it saw and each answer it gave."""

    def __init__(self, answers: list[list[int]], logprobs: list[float], versions: list[int]):
        self.answers, self.logprobs, self.versions = answers, logprobs, versions
        self.prompts: list[list[int]] = []
        self.outputs: list[Sampled] = []

    async def end_session(self, session: object) -> None:
        pass

    async def generate(self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: object = None) -> Sampled:
        turn = len(self.prompts)
        self.prompts.append(list(prompt))
        ids = self.answers[turn % len(self.answers)][:max_new_tokens]
        out = Sampled(ids, [self.logprobs[turn % len(self.logprobs)]] * len(ids), True, self.versions[turn])
        self.outputs.append(out)
        return out


def lake_env() -> RecordingEnv:
    return RecordingEnv(InlineEnvironment(FrozenLake(FrozenLakeConfig())))


@pytest.mark.asyncio
async def test_trajectory_is_exactly_context_plus_sampled_ids(lake: TextInterface) -> None:
    vocab = lake.tokenizer.get_vocab()
    # Answers that do NOT survive decode -> re-encode: specials and <unk> vanish from the text,
    # and "H down" is two ids. Token-in-token-out keeps every sampled id as it was.
    answers = [[vocab["<unk>"], vocab["<bos>"], vocab["H"], vocab["down"]], [vocab["down"]]]
    policy = RecordingPolicy(answers, [-0.25, -1.5], versions=[3] * 10)
    env = lake_env()
    episode = await run_episode(policy, env, lake, "1", seed=0, limits=LIMITS)

    expected: list[int] = list(lake.bos_ids)
    mask: list[int] = [0] * len(expected)
    for turn, sampled in enumerate(policy.outputs):
        context = lake.encode(env.observations[turn]) + list(lake.prompt_ids)
        expected += context
        mask += [0] * len(context)
        assert policy.prompts[turn] == expected  # the model saw exactly the trajectory so far
        expected += sampled.token_ids
        mask += [1] * len(sampled.token_ids)
    assert episode.token_ids.tolist() == expected
    assert episode.loss_mask.tolist() == mask
    assert answers[0] == episode.token_ids[np.flatnonzero(episode.loss_mask)][:4].tolist()
    sampled_lp = np.concatenate([s.logprobs for s in policy.outputs])
    np.testing.assert_array_equal(episode.logprobs[episode.loss_mask == 1], sampled_lp.astype(np.float32))
    assert (episode.logprobs[episode.loss_mask == 0] == 0).all()
    assert (episode.policy_versions[episode.loss_mask == 0] == -1).all()
    assert (episode.policy_versions[episode.loss_mask == 1] == 3).all()
    assert env.actions[0] == "H down"  # the environment got the decoded text, specials dropped
    assert array_problem(to_proto(episode)) is None
    back = from_proto(to_proto(episode))
    assert back.token_ids.tolist() == expected and back.loss_mask.tolist() == mask


@pytest.mark.asyncio
async def test_final_observation_is_not_appended(lake: TextInterface, lake_expert) -> None:  # type: ignore[no-untyped-def]
    policy = ScriptedPolicy(lake_expert)
    episode = await run_episode(policy, lake_env(), lake, "1", seed=0, limits=LIMITS)
    assert episode.status == OK and episode.metrics["success"] == 1.0
    assert episode.loss_mask[-1] == 1  # ends on the model's winning move


@pytest.mark.asyncio
async def test_versions_follow_a_mid_episode_weight_update(lake: TextInterface) -> None:
    vocab = lake.tokenizer.get_vocab()
    policy = RecordingPolicy([[vocab["up"]]], [-0.1], versions=[0, 0, 1, 1, 2, 2, 2, 2, 2, 2])
    episode = await run_episode(policy, lake_env(), lake, "1", seed=0, limits=EpisodeLimits(max_turns=6))
    assert episode.status == TRUNCATED and episode.num_turns == 6
    assert episode.policy_versions[episode.loss_mask == 1].tolist() == [0, 0, 1, 1, 2, 2]
    assert episode.oldest_version() == 0


class FakeSampler:
    """A deterministic stand-in for the JAX sampler: answers 'up' then '<eot>' for each prompt."""

    keeps_sessions = False
    min_batch = 1

    def __init__(self, up: int, eot: int):
        self.up, self.eot = up, eot
        self.version = 0
        self.batches: list[int] = []

    def load_weights(self, flat: dict[str, np.ndarray], version: int) -> None:
        self.version = version

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: Sequence[int] = (), sessions=None):  # type: ignore[no-untyped-def]
        from stoker.rollout.sampling import Generation

        assert sessions is None  # this sampler keeps no conversations
        self.batches.append(len(prompts))
        return [Generation([self.up], [-0.7], True, self.version) for _ in prompts]


@pytest.mark.asyncio
async def test_batched_sampler_batches_concurrent_episodes_and_records_versions(lake: TextInterface, lake_config) -> None:  # type: ignore[no-untyped-def]
    vocab = lake.tokenizer.get_vocab()
    fake = FakeSampler(vocab["up"], vocab["<eot>"])
    policy = BatchedSampler(fake, max_batch=64)
    limits = EpisodeLimits(max_turns=4)

    async def update_after_first_turn() -> None:
        while policy.stats.calls < 1:
            await asyncio.sleep(0)
        await policy.load_weights({}, 7)

    group, _ = await asyncio.gather(
        run_group(policy, inline_factory(lake_config), lake, "3", 8, limits=limits), update_after_first_turn()
    )
    await policy.close()
    assert len(group) == 8 and len({e.group_id for e in group}) == 1
    assert policy.stats.requests == 32 and policy.stats.calls < policy.stats.requests
    assert max(fake.batches) > 1  # concurrent turns shared sampler calls
    # Which turns fall before the update depends on how episodes interleave; what must hold is
    # that each token carries the version it was sampled with: 0 until the swap, 7 after it, and
    # the swap lands before every episode's last turn (calls after the second see version 7).
    first_turn_versions = set()
    for episode in group:
        versions = episode.policy_versions[episode.loss_mask == 1].tolist()
        assert set(versions) <= {0, 7} and versions[-1] == 7 and versions == sorted(versions)
        first_turn_versions.add(versions[0])
    assert 0 in first_turn_versions  # the episodes of the first call sampled with version 0


class SizeRecordingSampler:
    """Answers one token per prompt and records each call's rows; prompts batch by length bucket."""

    keeps_sessions = False
    version = 0
    buckets = (16, 64, 256)

    def __init__(self, min_batch: int):
        self.min_batch = min_batch
        self.calls: list[int] = []

    def load_weights(self, flat: dict[str, np.ndarray], version: int) -> None:
        pass

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: Sequence[int] = (), sessions=None):  # type: ignore[no-untyped-def]
        from stoker.rollout.sampling import Generation

        self.calls.append(len(prompts))
        return [Generation([1], [-0.5], True, 0) for _ in prompts]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("waiting", "prompt_len", "min_batch", "expected"),
    [
        (3, 10, 4, [3]),  # padded to 4 rows anyway: one call, not 2 + 1
        (4, 10, 4, [4]),
        (7, 10, 4, [7]),  # padded to 8: one call costs less than 4 + 3, and a group's turn waits for one
        (9, 10, 4, [8, 1]),
        (11, 10, 4, [8, 3]),  # 11 padded to 16 would compute 5 idle rows; 3 pad to 4
        (11, 10, 16, [11]),
        (40, 10, 4, [32, 8]),  # at most 32 rows per call
        (12, 200, 4, [8, 4]),  # 256-token prefills: at most 2048 tokens per call
    ],
)
async def test_batched_sampler_call_sizes(waiting: int, prompt_len: int, min_batch: int, expected: list[int]) -> None:
    sampler = SizeRecordingSampler(min_batch)
    policy = BatchedSampler(sampler)
    # All requests are queued before the first call starts (the worker task runs after them).
    await asyncio.gather(
        *(policy.generate([1] * prompt_len, max_new_tokens=1, stop_token_ids=()) for _ in range(waiting))
    )
    await policy.close()
    assert sampler.calls == expected



@pytest.mark.asyncio
async def test_a_long_running_sampler_keeps_only_its_newest_call_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor makes millions of sampler calls in a long run; its statistics must not grow with them."""
    monkeypatch.setattr(policy_module, "CALL_SIZES_KEPT", 8)
    policy = BatchedSampler(SizeRecordingSampler(1))
    for rows in [1, 2, 4, 8] * 5:  # one call each, of ``rows`` rows (powers of two are never split)
        await asyncio.gather(*(policy.generate([1] * 4, max_new_tokens=1, stop_token_ids=()) for _ in range(rows)))
    await policy.close()
    assert list(policy.stats.sizes) == [1, 2, 4, 8] * 2  # the newest 8 calls
    assert policy.stats.calls == 20 and policy.stats.requests == 75


@pytest.mark.asyncio
async def test_group_runs_g_episodes_with_distinct_seeds(lake: TextInterface, lake_config, lake_expert) -> None:  # type: ignore[no-untyped-def]
    slippery = lake_config.__class__(
        "frozenlake", '{"slippery": true, "size": 4, "holeProbability": 0.0}', step_timeout_seconds=5.0
    )
    group = await run_group(
        ScriptedPolicy(lake_expert), inline_factory(slippery), lake, "5", 6, limits=LIMITS, group_id="g1"
    )
    assert [e.group_id for e in group] == ["g1"] * 6 and all(e.group_size == 6 for e in group)
    assert len({e.episode_id for e in group}) == 6
    # On a slippery lake the seeds make the episodes differ.
    assert len({tuple(e.token_ids.tolist()) for e in group}) > 1


@pytest.mark.asyncio
async def test_wrong_policy_fails_frozenlake(lake: TextInterface, lake_config) -> None:  # type: ignore[no-untyped-def]
    vocab = lake.tokenizer.get_vocab()
    group = await run_group(
        ScriptedPolicy(lambda _: [vocab["up"]]), inline_factory(lake_config), lake, "1", 2, limits=LIMITS
    )
    for episode in group:
        assert episode.metrics["success"] == 0.0 and episode.status == TRUNCATED
        assert episode.num_turns == LIMITS.max_turns


@pytest.mark.asyncio
async def test_episode_wall_clock_limit_ends_with_timeout(lake: TextInterface) -> None:
    never = asyncio.Event()

    class Stuck:
        version = 0

        async def end_session(self, session: object) -> None:
            pass

        async def generate(self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: object = None) -> Sampled:
            await never.wait()
            raise AssertionError("unreachable")

    limits = EpisodeLimits(max_turns=4, episode_seconds=0.2)
    episode = await run_episode(Stuck(), lake_env(), lake, "1", seed=0, limits=limits)
    assert episode.status == TIMEOUT and "0.2 s" in episode.status_reason
    assert array_problem(to_proto(episode)) is None  # still submittable


@pytest.mark.asyncio
async def test_context_limit_truncates(lake: TextInterface, lake_expert) -> None:  # type: ignore[no-untyped-def]
    limits = EpisodeLimits(max_turns=10, max_new_tokens=4, max_tokens=70)
    episode = await run_episode(ScriptedPolicy(lake_expert), lake_env(), lake, "1", seed=0, limits=limits)
    assert episode.status == TRUNCATED and "context limit" in episode.status_reason
    assert episode.num_tokens + 4 <= 70 + 22  # never grew past the limit by more than one turn's prompt
    tiny = EpisodeLimits(max_turns=10, max_new_tokens=4, max_tokens=16)
    starved = await run_episode(ScriptedPolicy(lake_expert), lake_env(), lake, "1", seed=0, limits=tiny)
    assert starved.status == FAILED and "no model turn fit" in starved.status_reason
    assert array_problem(to_proto(starved)) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [[1.0], [float("nan")]])
async def test_sampled_logprobs_are_kept_verbatim(lake: TextInterface, bad: list[float]) -> None:
    # The episode never "fixes" what the sampler returned; the buffer's validation rejects it.
    vocab = lake.tokenizer.get_vocab()
    policy = RecordingPolicy([[vocab["up"]]], bad, versions=[0] * 10)
    episode = await run_episode(policy, lake_env(), lake, "1", seed=0, limits=EpisodeLimits(max_turns=1))
    assert array_problem(to_proto(episode)) is not None


def test_batched_sampler_survives_one_event_loop_per_step(lake: TextInterface, lake_config) -> None:  # type: ignore[no-untyped-def]
    # The local runner's synchronous baseline may call asyncio.run once per training step.
    vocab = lake.tokenizer.get_vocab()
    fake = FakeSampler(vocab["up"], vocab["<eot>"])
    policy = BatchedSampler(fake)
    limits = EpisodeLimits(max_turns=2)
    for step in range(3):
        group = asyncio.run(run_group(policy, inline_factory(lake_config), lake, "1", 2, limits=limits, seed=step))
        assert [e.num_turns for e in group] == [2, 2]
    asyncio.run(policy.close())


@pytest.mark.asyncio
async def test_an_episode_counts_its_sandbox_start_as_environment_time(lake: TextInterface, lake_config, lake_expert) -> None:  # type: ignore[no-untyped-def]
    """The report's split of an episode's time (sampler, environment, the rest) is only right if a
    slow sandbox start shows as environment time and wall time, not as nothing."""
    start_seconds, turn_seconds = 0.3, 0.05
    inline = inline_factory(lake_config)

    async def slow_sandbox():  # type: ignore[no-untyped-def]
        await asyncio.sleep(start_seconds)  # the sandbox's start, as a measured duration
        return await inline()

    class SlowExpert(ScriptedPolicy):
        async def generate(self, prompt, **kwargs):  # type: ignore[no-untyped-def]
            await asyncio.sleep(turn_seconds)  # one sampler call's duration
            return await super().generate(prompt, **kwargs)

    (episode,) = await run_group(SlowExpert(lake_expert), slow_sandbox, lake, "1", 1, limits=LIMITS)
    assert episode.status == OK and episode.num_turns >= 2
    assert episode.environment_seconds >= start_seconds
    assert episode.sample_seconds >= turn_seconds * episode.num_turns
    wall = episode.finished_unix - episode.started_unix
    assert wall >= episode.environment_seconds + episode.sample_seconds - 1e-3
