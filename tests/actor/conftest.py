"""Shared fixtures for the actor tests: interfaces, scripted policies, episode limits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from stoker.actor.environments import options_json
from stoker.actor.frozenlake import expert_move
from stoker.actor.sandbox import SandboxConfig
from stoker.actor.swe import solution_commands
from stoker.conversation.tokenization import TextInterface, text_interface
from stoker.spec import EnvironmentSpec, ModelSpec, RLJobSpec, TransformerConfig


@pytest.fixture
def lake_spec() -> RLJobSpec:
    return RLJobSpec()


@pytest.fixture
def lake(lake_spec: RLJobSpec) -> TextInterface:
    return text_interface(lake_spec)


@pytest.fixture
def lake_config(lake_spec: RLJobSpec) -> SandboxConfig:
    return SandboxConfig("frozenlake", options_json(lake_spec.environment.frozenlake), step_timeout_seconds=10.0)


@pytest.fixture
def swe_spec() -> RLJobSpec:
    return RLJobSpec(
        environment=EnvironmentSpec(name="swe"),
        model=ModelSpec(architecture=TransformerConfig(vocab_size=320, max_seq_len=4096)),
    )


@pytest.fixture
def swe(swe_spec: RLJobSpec) -> TextInterface:
    return text_interface(swe_spec)


@pytest.fixture
def swe_config(swe_spec: RLJobSpec) -> SandboxConfig:
    return SandboxConfig("swe", options_json(swe_spec.environment.swe), step_timeout_seconds=20.0)


@pytest.fixture
def lake_expert(lake: TextInterface) -> Callable[[Sequence[int]], list[int]]:
    """Reads the last grid in the prompt and names the next move of a shortest safe path."""
    vocab = lake.tokenizer.get_vocab()

    def respond(prompt: Sequence[int]) -> list[int]:
        return [vocab[expert_move(lake.decode(prompt).split(), 4)]]

    return respond


@pytest.fixture
def swe_solver(swe: TextInterface) -> Callable[[str], Callable[[Sequence[int]], list[int]]]:
    """For a task: turn k answers the k-th solution command, then the end-of-turn token."""

    def for_task(task: str) -> Callable[[Sequence[int]], list[int]]:
        commands = solution_commands(task)
        marker = swe.prompt_ids[0]

        def respond(prompt: Sequence[int]) -> list[int]:
            turn = list(prompt).count(marker) - 1
            return [*swe.encode(commands[min(turn, len(commands) - 1)]), swe.stop_token_ids[0]]

        return respond

    return for_task


# Code an agent could put at the top of a module it may edit, each a known way to fake a test verdict.
CHEATS = {
    "os._exit(0) at import": "import os\nos._exit(0)",
    "sys.exit(0) at import": "import sys\nsys.exit(0)",
    "patch unittest assertions": "import unittest\nunittest.TestCase.assertEqual = lambda self, a, b, msg=None: None",
    "patch unittest results": (
        "import unittest.result\nunittest.result.TestResult.addFailure = unittest.result.TestResult.addSuccess"
    ),
    "patch unittest's runner": (
        "import unittest\nunittest.TestCase.run = lambda self, result=None: result.addSuccess(self)"
    ),
    "exit from inside a test": "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)",
}
