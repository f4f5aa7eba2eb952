"""Reward plugins: ``environment.reward`` adds weighted ``module:function`` terms to each step.

A reward function gets a ``StepContext`` and returns a float::

    def brief(step: StepContext) -> float:           # a format reward
        return 1.0 if len(step.action) < 40 else 0.0

The step's reward becomes ``environmentWeight * environment reward + sum(weight * term)``; each
term's value also goes into the step's metrics as ``reward/<function>``. The functions run in the
actor, around whatever sandbox the environment runs in, and see text only. A function that
raises, or returns NaN or an infinity, fails that episode, like an environment crash.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from stoker.actor.environments import EnvironmentProblem, Observation, StepResult
from stoker.actor.plugins import import_reference
from stoker.actor.sandbox import EnvironmentFactory, EpisodeEnvironment, SandboxFailed


@dataclass(frozen=True)
class StepContext:
    task_id: str
    turn: int  # 1 for the first step of the episode
    action: str
    observation: str
    environment_reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass(frozen=True)
class RewardTerm:
    function: str  # package.module:function
    weight: float = 1.0


def resolve_term(term: RewardTerm) -> Callable[[StepContext], float]:
    target = import_reference(term.function, "reward")
    if not callable(target):
        raise EnvironmentProblem(f"reward {term.function!r} is a {type(target).__name__}; expected a function")
    return target


def reward_problems(terms: list[Any]) -> list[tuple[str, str]]:
    """``stoker validate``'s check: each term imports and is callable (field path under spec)."""
    problems = []
    for index, term in enumerate(terms):
        try:
            resolve_term(RewardTerm(term.function, term.weight))
        except EnvironmentProblem as exc:
            problems.append((f"environment.reward.terms[{index}].function", str(exc)))
    return problems


class RewardedEnvironment:
    """An episode's environment with reward terms applied to every step."""

    def __init__(self, inner: EpisodeEnvironment, terms: list[tuple[RewardTerm, Callable[[StepContext], float]]],
                 environment_weight: float):
        self.inner = inner
        self.terms = terms
        self.environment_weight = environment_weight
        self.task_id = ""
        self.turn = 0

    async def reset(self, task_id: str, seed: int) -> Observation:
        self.task_id, self.turn = task_id, 0
        return await self.inner.reset(task_id, seed)

    async def step(self, action: str) -> StepResult:
        result = await self.inner.step(action)
        self.turn += 1
        context = StepContext(
            self.task_id, self.turn, action, result.observation.text, result.reward,
            result.terminated, result.truncated, result.observation.info,
        )
        if not math.isfinite(result.reward):
            raise SandboxFailed(f"the environment returned reward {result.reward}; expected a finite number")
        total = self.environment_weight * result.reward
        metrics = dict(result.observation.info.get("metrics", {}))
        for term, function in self.terms:
            try:
                value = float(function(context))
            except Exception as exc:  # noqa: BLE001 - a reward plugin's crash fails this episode only
                raise SandboxFailed(f"reward {term.function} raised {type(exc).__name__}: {exc}") from exc
            if not math.isfinite(value):
                raise SandboxFailed(f"reward {term.function} returned {value}; expected a finite number")
            metrics[f"reward/{term.function}"] = value
            total += term.weight * value
        if not math.isfinite(total):  # finite terms can still overflow once weighted and summed
            raise SandboxFailed(f"the weighted reward terms sum to {total}; expected a finite number")
        info = {**result.observation.info, "metrics": metrics}
        return replace(result, observation=Observation(result.observation.text, info), reward=total)

    async def close(self) -> None:
        await self.inner.close()


class RewardedFactory:
    """Wraps a factory's environments in ``RewardedEnvironment``; ``aclose`` reaches the inner one."""

    def __init__(self, inner: EnvironmentFactory, terms: list[RewardTerm], environment_weight: float = 1.0):
        self.inner = inner
        self.terms = [(term, resolve_term(term)) for term in terms]
        self.environment_weight = environment_weight

    async def __call__(self) -> EpisodeEnvironment:
        return RewardedEnvironment(await self.inner(), self.terms, self.environment_weight)

    async def aclose(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()
