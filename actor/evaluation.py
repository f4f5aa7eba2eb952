"""Held-out evaluation: ``environment.evalTasks`` played greedily every k policy versions.

Each time an actor's policy version reaches a new multiple of ``evalEveryVersions`` (version 0
included: the starting point), it plays a round: every evaluation task ``evalEpisodesPerTask``
times, greedily (temperature 0), on at most ``evalShare`` of its episode slots while training
goes on in the rest. The episodes are never Put, so no learner ever samples them; the round's sums
go to the buffer (``ReportEval``), which aggregates every actor's round per version for Stats, the
learner's metrics and the RLJob status. A round is named by its multiple of k: actors that reach
it at slightly different versions report into one round.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from stoker.actor.episode import FAILED, TIMEOUT, EpisodeLimits, EpisodeSlots, run_group
from stoker.conversation.policy import Policy, Sampled
from stoker.actor.sandbox import EnvironmentFactory
from stoker.conversation.tokenization import TextInterface
from stoker.trajectory import Episode


@dataclass(frozen=True)
class EvalPlan:
    """What one round plays, and on how many of the actor's slots."""

    tasks: tuple[str, ...]
    every_versions: int = 10
    slots: int = 1
    episodes_per_task: int = 1

    @classmethod
    def from_spec(cls, env: Any, tasks: Sequence[str], concurrency: int) -> EvalPlan:
        return cls(
            tasks=tuple(tasks),
            every_versions=env.eval_every_versions,
            slots=max(1, math.floor(env.eval_share * concurrency)),
            episodes_per_task=env.eval_episodes_per_task,
        )


@dataclass(frozen=True)
class EvalOutcome:
    """One actor's round: sums over its episodes (what ``ReportEval`` carries)."""

    version: int
    episodes: int
    reward_sum: float
    success_sum: float
    failed: int

    @property
    def success_rate(self) -> float:
        return self.success_sum / self.episodes if self.episodes else 0.0

    @classmethod
    def of(cls, version: int, episodes: Sequence[Episode]) -> EvalOutcome:
        return cls(
            version=version,
            episodes=len(episodes),
            reward_sum=float(sum(e.reward for e in episodes)),
            success_sum=float(sum(min(max(e.metrics.get("success", 0.0), 0.0), 1.0) for e in episodes)),
            failed=sum(1 for e in episodes if e.status in (FAILED, TIMEOUT)),
        )


def round_due(version: int, last_round: int, every_versions: int) -> int | None:
    """The round to play at ``version``: its newest multiple of k, if not played yet."""
    due = (version // every_versions) * every_versions
    return due if due > last_round else None


class GreedyPolicy:
    """A policy's greedy twin: every turn at temperature 0 (the wrapped policy must take one)."""

    def __init__(self, policy: Policy):
        if "temperature" not in inspect.signature(policy.generate).parameters:
            raise TypeError(f"{type(policy).__name__}.generate takes no temperature: it cannot play evaluation rounds greedily")
        self.policy = policy

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: Hashable = None
    ) -> Sampled:
        generate: Any = self.policy.generate
        return await generate(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, session=session, temperature=0.0)

    async def end_session(self, session: Hashable) -> None:
        await self.policy.end_session(session)


class _EvalSlot:
    """One of the actor's episode slots, taken by an evaluation episode: at most ``share``
    evaluation episodes hold one at a time, and they queue for slots with the training groups."""

    def __init__(self, slots: EpisodeSlots, share: asyncio.Semaphore):
        self.slots, self.share = slots, share

    async def __aenter__(self) -> None:
        await self.share.acquire()
        try:
            await self.slots.reserve(1)
        except BaseException:
            self.share.release()
            raise
        try:
            await self.slots.__aenter__()
        except BaseException:
            await self.slots.give_back(1)
            self.share.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.slots.__aexit__(*exc)
        finally:
            self.share.release()


async def play_round(
    policy: Policy,
    env_factory: EnvironmentFactory,
    interface: TextInterface,
    plan: EvalPlan,
    *,
    version: int,
    limits: EpisodeLimits,
    slots: EpisodeSlots,
    actor_id: str,
) -> tuple[EvalOutcome, list[Episode]]:
    """Every evaluation task ``episodes_per_task`` times, greedily; the same seeds every round, so
    rounds differ only by the policy."""
    greedy = GreedyPolicy(policy)
    share = asyncio.Semaphore(plan.slots)
    groups = await asyncio.gather(
        *(
            run_group(
                greedy, env_factory, interface, task, plan.episodes_per_task,
                limits=limits, seed=0, group_id=f"eval-{version}-{task}", actor_id=actor_id, slots=_EvalSlot(slots, share),
            )
            for task in plan.tasks
        )
    )
    episodes = [e for group in groups for e in group]
    return EvalOutcome.of(version, episodes), episodes
