"""Multi-turn episodes, strictly token-in-token-out, and episode groups.

The trajectory is built from ids only (``TrajectoryBuilder``)::

    <bos> obs_0 <act> | sampled_0 | obs_1 <act> | sampled_1 | ...
    mask:  0               1          0             1
    logprob/version: 0/-1 on context tokens, the sampler's values on sampled ones

(with a chat template, ``TextInterface`` lays out the opening and the ids between turns instead).

Sampled ids enter the trajectory exactly as the sampler returned them; they are decoded to text
only to hand the environment its action. Each observation is tokenised once and appended. The final
observation (after the episode ends) is not appended: no model token follows it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoker.actor.environments import Observation
from stoker.conversation.policy import Policy, PolicyError, Sampled
from stoker.actor.sandbox import EnvironmentFactory, EpisodeEnvironment, SandboxFailed, SandboxTimeout
from stoker.conversation.tokenization import TextInterface
from stoker.trajectory import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, VERSION_DTYPE, Episode
from stoker.v1 import trajectory_pb2

log = logging.getLogger("stoker.actor.episode")

OK = trajectory_pb2.EPISODE_STATUS_OK
TRUNCATED = trajectory_pb2.EPISODE_STATUS_TRUNCATED
FAILED = trajectory_pb2.EPISODE_STATUS_FAILED
TIMEOUT = trajectory_pb2.EPISODE_STATUS_TIMEOUT
CLOSE_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_new_tokens: int = 4
    max_tokens: int = 512  # the whole conversation must fit the model's context and the learner's rows
    episode_seconds: float = 300.0
    max_sampled_tokens: int | None = None  # over all turns (sampling.maxTokensPerEpisode)
    stop_strings: tuple[str, ...] = ()  # a turn also ends at these (sampling.stopStrings)


@dataclass
class TrajectoryBuilder:
    """Per-token arrays grown turn by turn; context tokens masked out, sampled ones in."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_context(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def add_sampled(self, sampled: Sampled) -> None:
        n = len(sampled.token_ids)
        if len(sampled.logprobs) != n:
            raise ValueError(f"sampler returned {n} ids but {len(sampled.logprobs)} log-probs")
        self.token_ids.extend(sampled.token_ids)
        self.loss_mask.extend([1] * n)
        self.logprobs.extend(sampled.logprobs)
        self.versions.extend([sampled.version] * n)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token_ids, loss_mask, logprobs, policy_versions) in the trajectory dtypes."""
        return (
            np.asarray(self.token_ids, TOKEN_DTYPE),
            np.asarray(self.loss_mask, MASK_DTYPE),
            np.asarray(self.logprobs, LOGPROB_DTYPE),
            np.asarray(self.versions, VERSION_DTYPE),
        )


def _metrics(observation: Observation) -> dict[str, float]:
    """The environment's numeric metrics; NaN and infinities are left out (they would poison every
    mean they enter, and the buffer refuses them)."""
    raw = observation.info.get("metrics", {}) if isinstance(observation.info, dict) else {}
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float) and math.isfinite(v)}


def cut_at_stop_string(sampled: Sampled, interface: TextInterface, stops: Sequence[str]) -> Sampled:
    """``sampled`` up to and including the token that completes the first stop string in its text
    (unchanged when none occurs). The kept ids and log-probs are a prefix of what was sampled, so
    the trajectory stays token-exact; the turn counts as ended by the model."""
    ids = sampled.token_ids

    def stops_within(n: int) -> bool:
        text = interface.decode(ids[:n])
        return any(stop in text for stop in stops)

    if not stops_within(len(ids)):
        return sampled
    low, high = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        if stops_within(middle):
            high = middle
        else:
            low = middle + 1
    return dataclasses.replace(sampled, token_ids=ids[:low], logprobs=sampled.logprobs[:low], finished=True)


async def run_episode(
    policy: Policy,
    env: EpisodeEnvironment,
    interface: TextInterface,
    task_id: str,
    *,
    seed: int,
    limits: EpisodeLimits,
    group_id: str = "",
    group_size: int = 1,
    episode_id: str | None = None,
    actor_id: str = "",
    setup_seconds: float = 0.0,
) -> Episode:
    """Play one episode to the end; never raises for environment trouble (it becomes the status).

    The episode is one conversation (``session``) of the policy from its first turn to the end.
    ``setup_seconds``: what starting ``env`` took (its sandbox), counted as the episode's
    environment time and wall time."""
    episode_id = episode_id or uuid.uuid4().hex
    builder = TrajectoryBuilder()
    sampled: Sampled | None = None
    turn_rewards: list[float] = []
    metrics: dict[str, float] = {}
    status, reason = TRUNCATED, f"turn limit ({limits.max_turns})"
    sample_s, env_s = 0.0, setup_seconds
    started = time.time() - setup_seconds
    try:
        async with asyncio.timeout(limits.episode_seconds):
            t0 = time.perf_counter()
            observation = await env.reset(task_id, seed)
            env_s += time.perf_counter() - t0
            metrics = _metrics(observation)
            for _ in range(limits.max_turns):
                context = (
                    interface.first_turn_ids(observation.text)
                    if sampled is None
                    else interface.next_turn_ids(observation.text, sampled.token_ids)
                )
                if len(builder) + len(context) + limits.max_new_tokens > limits.max_tokens:
                    status, reason = TRUNCATED, f"context limit ({limits.max_tokens} tokens)"
                    break
                budget = limits.max_new_tokens
                if limits.max_sampled_tokens is not None:
                    budget = min(budget, limits.max_sampled_tokens - sum(builder.loss_mask))
                    if budget < 1:
                        status, reason = TRUNCATED, f"token budget ({limits.max_sampled_tokens} sampled tokens per episode)"
                        break
                builder.add_context(context)
                t0 = time.perf_counter()
                sampled = await policy.generate(
                    list(builder.token_ids),
                    max_new_tokens=budget,
                    stop_token_ids=interface.stop_token_ids,
                    session=episode_id,
                )
                sample_s += time.perf_counter() - t0
                if limits.stop_strings:
                    sampled = cut_at_stop_string(sampled, interface, limits.stop_strings)
                builder.add_sampled(sampled)
                t0 = time.perf_counter()
                result = await env.step(interface.decode(sampled.token_ids))
                env_s += time.perf_counter() - t0
                reward = float(result.reward)
                if not math.isfinite(reward):
                    # A failed episode, never trained on; the turn counts with reward 0 so the
                    # episode stays a valid (finite) trajectory the buffer and metrics accept.
                    turn_rewards.append(0.0)
                    status, reason = FAILED, f"non-finite reward {reward} at turn {len(turn_rewards)}; expected a finite number"
                    break
                turn_rewards.append(reward)
                observation = result.observation
                metrics = _metrics(observation) or metrics
                if result.terminated:
                    status, reason = OK, ""
                    break
                if result.truncated:
                    status, reason = TRUNCATED, "the environment truncated the episode"
                    break
    except TimeoutError:
        status, reason = TIMEOUT, f"episode exceeded its {limits.episode_seconds:g} s limit"
    except SandboxTimeout as exc:
        status, reason = TIMEOUT, str(exc)
    except (SandboxFailed, PolicyError) as exc:
        status, reason = FAILED, str(exc)
    finally:
        await policy.end_session(episode_id)
    if status in (OK, TRUNCATED) and not any(builder.loss_mask):
        status, reason = FAILED, f"no model turn fit: {reason}"
    ids, mask, logprobs, versions = builder.arrays()
    return Episode(
        episode_id=episode_id,
        group_id=group_id,
        group_size=group_size,
        task_id=task_id,
        reward=float(sum(turn_rewards)),
        turn_rewards=turn_rewards,
        status=status,
        status_reason=reason,
        num_turns=len(turn_rewards),
        actor_id=actor_id,
        started_unix=started,
        finished_unix=time.time(),
        sample_seconds=sample_s,
        environment_seconds=env_s,
        metrics=metrics,
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        policy_versions=versions,
    )


def failed_episode(
    task_id: str, reason: str, *, status: int = FAILED, group_id: str = "", group_size: int = 1, actor_id: str = ""
) -> Episode:
    """An episode that never got going (its sandbox did not start); submitted so its group completes."""
    ids, mask, logprobs, versions = TrajectoryBuilder().arrays()
    now = time.time()
    return Episode(
        episode_id=uuid.uuid4().hex,
        group_id=group_id,
        group_size=group_size,
        task_id=task_id,
        status=status,
        status_reason=reason,
        actor_id=actor_id,
        started_unix=now,
        finished_unix=now,
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        policy_versions=versions,
    )


class EpisodeSlots:
    """At most ``limit`` episodes run at once; the actor starts its next group as soon as one slot
    is free.

    Each episode holds a slot while it runs (``async with slots``) and, when it ends, gives back the
    reservation its group took for it when it was admitted. A group whose last episode is still
    running therefore holds one reservation, not a group's, and the next group starts -- its
    episodes taking slots as they free up -- while fewer than ``limit`` episodes are reserved.
    (Counting running *groups* instead left slots idle behind every straggler.) At most one group's
    episodes wait for slots, so admission credit is never held far ahead of the work.
    """

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = max(1, limit)
        self._clock = clock
        self.reserved = 0  # episodes of started groups that have not ended
        self.running = 0  # episodes holding a slot now
        self._running = asyncio.Semaphore(self.limit)
        self._changed = asyncio.Condition()
        self._slot_seconds = 0.0  # the running episodes' wall time, summed, up to ``_counted_at``
        self._counted_at = clock()

    def slot_seconds(self) -> float:
        """The wall time episodes have held slots, summed over episodes: its rate is the mean
        number in flight (``stoker.actor.diagnostics.LoadMeter``)."""
        now = self._clock()
        self._slot_seconds += self.running * (now - self._counted_at)
        self._counted_at = now
        return self._slot_seconds

    async def reserve(self, episodes: int) -> None:
        """Wait for a free slot, then count ``episodes`` more (one group's)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.reserved < self.limit)
            self.reserved += episodes

    async def give_back(self, episodes: int) -> None:
        """Return reservations: an episode's when it ends, a group's that never started."""
        async with self._changed:
            self.reserved -= episodes
            self._changed.notify_all()

    async def __aenter__(self) -> None:
        await self._running.acquire()
        self.slot_seconds()
        self.running += 1

    async def __aexit__(self, *exc: object) -> None:
        self.slot_seconds()
        self.running -= 1
        self._running.release()
        await self.give_back(1)


async def run_group(
    policy: Policy,
    env_factory: EnvironmentFactory,
    interface: TextInterface,
    task_id: str,
    group_size: int,
    *,
    limits: EpisodeLimits,
    seed: int = 0,
    group_id: str | None = None,
    actor_id: str = "",
    slots: AbstractAsyncContextManager[Any] | None = None,
) -> list[Episode]:
    """``group_size`` episodes of one task, concurrently; always returns exactly that many.

    Each episode gets its own environment from ``env_factory`` (its own sandbox) and the seed
    ``seed * 1000 + index`` (so slippery lakes differ within a group). ``slots`` (a semaphore, or
    ``EpisodeSlots`` with this group reserved) bounds how many episodes run at once across groups.
    """
    group_id = group_id or uuid.uuid4().hex

    async def one(index: int) -> Episode:
        if slots is None:
            return await start(index)
        async with slots:
            return await start(index)

    async def start(index: int) -> Episode:
        asked = time.perf_counter()
        try:
            env = await env_factory()
        except SandboxTimeout as exc:
            return failed_episode(task_id, str(exc), status=TIMEOUT, group_id=group_id, group_size=group_size)
        except SandboxFailed as exc:
            return failed_episode(task_id, str(exc), group_id=group_id, group_size=group_size)
        try:
            return await run_episode(
                policy,
                env,
                interface,
                task_id,
                seed=seed * 1000 + index,
                limits=limits,
                group_id=group_id,
                group_size=group_size,
                actor_id=actor_id,
                setup_seconds=time.perf_counter() - asked,
            )
        finally:
            await _close(env)

    episodes = await asyncio.gather(*(one(i) for i in range(group_size)))
    for episode in episodes:
        episode.actor_id = actor_id
    return list(episodes)


async def _close(env: EpisodeEnvironment) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_SECONDS):
            await env.close()
    except TimeoutError:
        log.warning("closing an environment took over %.0f s; abandoned", CLOSE_TIMEOUT_SECONDS)


def summarize(episodes: Sequence[Episode]) -> dict[str, Any]:
    """Mean reward, success rate and status counts of some episodes (logs, the local runner)."""
    names: dict[int, str] = {OK: "ok", TRUNCATED: "truncated", FAILED: "failed", TIMEOUT: "timeout"}
    counts: dict[str, int] = {}
    for e in episodes:
        name = names.get(int(e.status), str(e.status))
        counts[name] = counts.get(name, 0) + 1
    n = max(len(episodes), 1)
    return {
        "episodes": len(episodes),
        "mean_reward": sum(e.reward for e in episodes) / n,
        "success_rate": sum(e.metrics.get("success", 0.0) for e in episodes) / n,
        "statuses": counts,
    }
