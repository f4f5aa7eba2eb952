"""Reward plugins: weighted module:function terms added to the environment's own reward."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import FAILED, OK, EpisodeLimits, run_group
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.rewards import RewardedFactory, RewardTerm
from stoker.actor.sandbox import SandboxConfig, inline_factory
from stoker.actor.settings import ActorSettings
from stoker.conversation.tokenization import TextInterface
from stoker.actor.wiring import environment_factory
from stoker.buffer.settings import BufferSettings
from stoker.buffer.validate import validate
from stoker.trajectory import to_proto
from stoker.spec import RLJobSpec

REWARDS = '''
def brief(step):
    """A format reward: 1 for an answer of at most 3 characters."""
    return 1.0 if len(step.action.strip()) <= 3 else 0.0


def turn(step):
    return float(step.turn)


def broken(step):
    raise ValueError("no reward today")


def undefined(step):
    return float("nan")


def huge(step):
    return 1e308
'''


@pytest.fixture
def rewards_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "myrewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards"
    sys.modules.pop("myrewards", None)


@pytest.fixture
def answers_config(tmp_path: Path) -> SandboxConfig:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "q", "prompt": "1+1=", "verifier": "numeric", "answer": 2}) + "\n")
    return SandboxConfig("answers", json.dumps({"taskFiles": [str(tasks)]}))


LIMITS = EpisodeLimits(max_turns=1, max_new_tokens=16, max_tokens=256)


def _answer(swe: TextInterface, text: str) -> ScriptedPolicy:
    return ScriptedPolicy(lambda prompt: [*swe.encode(text), swe.stop_token_ids[0]])


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "reward"),
    [("2", 0.5 * 1.0 + 0.25 * 1.0 + 2.0 * 1.0), ("it is 2", 0.5 * 1.0 + 0.0 + 2.0), ("it is 3", 0.0 + 0.0 + 2.0)],
)
async def test_terms_are_weighted_and_added_to_the_environment_reward(
    rewards_module: str, answers_config: SandboxConfig, swe: TextInterface, answer: str, reward: float
) -> None:
    terms = [RewardTerm(f"{rewards_module}:brief", 0.25), RewardTerm(f"{rewards_module}:turn", 2.0)]
    factory = RewardedFactory(inline_factory(answers_config), terms, environment_weight=0.5)
    [episode] = await run_group(_answer(swe, answer), factory, swe, "q", 1, limits=LIMITS)
    assert episode.status == OK
    assert episode.reward == pytest.approx(reward)
    assert episode.metrics[f"reward/{rewards_module}:turn"] == 1.0


@pytest.mark.asyncio
async def test_a_reward_that_raises_fails_that_episode_only(
    rewards_module: str, answers_config: SandboxConfig, swe: TextInterface
) -> None:
    factory = RewardedFactory(inline_factory(answers_config), [RewardTerm(f"{rewards_module}:broken")])
    [episode] = await run_group(_answer(swe, "2"), factory, swe, "q", 1, limits=LIMITS)
    assert episode.status == FAILED and "reward myrewards:broken raised ValueError: no reward today" in episode.status_reason


class ScoredEnvironment:
    """Two turns; the first scores 1, the second ``second``."""

    def __init__(self, second: float):
        self.second = second
        self.turn = 0

    async def reset(self, task_id: str, seed: int) -> Observation:
        return Observation("go", {})

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult(Observation("again", {}), 1.0, terminated=False)
        return StepResult(Observation("done", {"metrics": {"success": self.second}}), self.second, terminated=True)

    async def close(self) -> None:
        pass


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_a_non_finite_environment_reward_fails_the_episode_with_its_reason(swe: TextInterface, bad: float) -> None:
    async def factory() -> ScoredEnvironment:
        return ScoredEnvironment(bad)

    limits = EpisodeLimits(max_turns=2, max_new_tokens=16, max_tokens=256)
    [episode] = await run_group(_answer(swe, "2"), factory, swe, "q", 1, limits=limits)
    assert episode.status == FAILED
    assert episode.status_reason == f"non-finite reward {bad} at turn 2; expected a finite number"
    assert episode.turn_rewards == [1.0, 0.0] and episode.reward == 1.0
    assert "success" not in episode.metrics
    # A trajectory the buffer takes (a failed member of its group), not one it refuses.
    validate(to_proto(episode).SerializeToString(), BufferSettings(group_size=1))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("terms", "environment", "reason"),
    [
        ([("undefined", 1.0)], 1.0, "reward myrewards:undefined returned nan; expected a finite number"),
        ([("huge", 10.0)], 1.0, "the weighted reward terms sum to inf; expected a finite number"),
        ([("brief", 1.0)], float("nan"), "the environment returned reward nan; expected a finite number"),
    ],
)
async def test_a_non_finite_reward_from_a_plugin_fails_the_episode(
    rewards_module: str, swe: TextInterface, terms: list[tuple[str, float]], environment: float, reason: str
) -> None:
    async def scored() -> ScoredEnvironment:
        env = ScoredEnvironment(environment)
        env.turn = 1  # its first step is the one scored ``environment``
        return env

    factory = RewardedFactory(scored, [RewardTerm(f"{rewards_module}:{name}", weight) for name, weight in terms])
    [episode] = await run_group(_answer(swe, "2"), factory, swe, "q", 1, limits=LIMITS)
    assert episode.status == FAILED and episode.status_reason == reason
    assert episode.reward == 0.0


def test_the_spec_wires_rewards_and_validate_checks_them(rewards_module: str, tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate(
        {"environment": {"sandbox": {"kind": "inline"}, "reward": {"environmentWeight": 0.5,
                                                                   "terms": [{"function": "myrewards:brief", "weight": 0.1}]}}}
    )
    settings = ActorSettings.from_spec(spec, actor_id="a")
    assert settings.reward_terms == (RewardTerm("myrewards:brief", 0.1),)
    factory = environment_factory(settings)
    assert isinstance(factory, RewardedFactory) and factory.environment_weight == 0.5
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nspec:\n"
        "  environment: {reward: {terms: [{function: 'myrewards:nothing'}, {function: 'nomodule:f'}]}}\n"
    )
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "validate", str(manifest)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert "spec.environment.reward.terms[0].function: " in done.stderr and "has no attribute 'nothing'" in done.stderr
    assert "spec.environment.reward.terms[1].function: " in done.stderr and "cannot import nomodule" in done.stderr
