"""The environment protocol: reset/step over text, with reward, done and info.

Environments run inside a sandbox (see ``sandbox_server``), so this module and the environments
stay free of JAX and of anything the actor's inference needs. The actor never hands an environment
token ids: it decodes the model's sampled ids to text for ``step`` and tokenises the observation
text it gets back.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Observation:
    text: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    observation: Observation
    reward: float
    terminated: bool  # the environment reached a terminal state
    truncated: bool = False  # the environment itself stopped the episode early


class EnvironmentProblem(Exception):
    """A user-visible environment problem (bad options, unknown task)."""


MAX_TRACEBACK_CHARS = 2000  # the reason travels in the trajectory (the buffer takes 4096 characters)


def crash_reason(exc: BaseException) -> str:
    """An environment's crash as an episode's status reason: ``environment raised Type: message``
    on the first line (the reason it is counted under), then the end of its traceback."""
    import traceback

    trace = "".join(traceback.format_exception(exc)).rstrip()
    if len(trace) > MAX_TRACEBACK_CHARS:
        trace = "..." + trace[-MAX_TRACEBACK_CHARS:]
    return f"environment raised {type(exc).__name__}: {exc}\n{trace}"


class Environment(Protocol):
    """One episode's environment; text in, text out."""

    def reset(self, task_id: str, seed: int) -> Observation: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


def make_environment(name: str, options: dict[str, Any], workdir: str) -> Environment:
    """Build a named environment from its RLJob options (camelCase or snake_case keys).

    ``name`` is a built-in (frozenlake, swe, swebench, answers), an entry-point name or a
    ``package.module:factory`` reference (``stoker.actor.plugins``). ``workdir`` is the sandbox's
    private directory; environments that touch files stay inside it.
    """
    # Imported by name, not at the top: each environment imports this module (a cycle), and a
    # sandbox loads only the one it plays (FrozenLake brings gymnasium, a plugin pydantic).
    if name == "frozenlake":
        from stoker.actor.frozenlake import FrozenLake

        return FrozenLake.from_options(options)
    if name == "swe":
        from stoker.actor.swe import SweEnvironment

        return SweEnvironment.from_options(options, workdir)
    if name == "swebench":
        from stoker.actor.swebench import SweBenchEnvironment

        return SweBenchEnvironment.from_options(options, workdir)
    if name == "answers":
        from stoker.actor.answers import AnswersEnvironment

        return AnswersEnvironment.from_options(options, workdir)
    from stoker.actor.plugins import resolve

    return resolve(name).make(options, workdir)


def uses_workdir(name: str) -> bool:
    """Whether the named environment may touch files, and so needs a private directory per episode."""
    return name != "frozenlake"


def may_block(name: str) -> bool:
    """Whether the named environment's calls can take long (processes, files, the network).

    Run inline, such calls go to a thread so the actor's event loop keeps sampling; a call that
    only updates memory (FrozenLake's table lookups, microseconds) is cheaper to make directly
    than the thread handoff it would need.
    """
    return name != "frozenlake"


def options_json(options: Any) -> str:
    """Spec options (a pydantic model) as the JSON a sandbox Reset carries."""
    return json.dumps(options.model_dump(mode="json", by_alias=True))


@dataclass(frozen=True)
class StepLatency:
    """Extra delay per environment step (benchmarks): none, fixed, uniform or exponential.

    ``seconds`` is the fixed delay, or the mean: uniform draws from [0, 2*seconds], exponential
    from Exp(1/seconds).
    """

    distribution: str = "none"
    seconds: float = 0.0

    def sample(self, rng: random.Random) -> float:
        if self.distribution == "none" or self.seconds <= 0:
            return 0.0
        if self.distribution == "fixed":
            return self.seconds
        if self.distribution == "uniform":
            return rng.uniform(0.0, 2.0 * self.seconds)
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.seconds)
        raise EnvironmentProblem(f"unknown latency distribution {self.distribution!r}")
