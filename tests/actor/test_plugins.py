"""Environments by reference: a throwaway package outside the source tree, checked, run and trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from stoker.actor.environments import EnvironmentProblem, make_environment
from stoker.actor.episode import FAILED, OK, EpisodeLimits, run_group
from stoker.actor.plugins import environment_problems, resolve
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.process_sandbox import ProcessSandboxFactory, Zygote
from stoker.actor.sandbox import SandboxConfig
from stoker.conversation.tokenization import TextInterface

PLUGIN = '''
"""A throwaway environment: say the letter the prompt asks for."""
from pydantic import BaseModel, Field

from stoker.actor.environments import Observation, StepResult
from stoker.actor.plugins import environment_plugin


class Options(BaseModel):
    letters: str = Field("ab", min_length=1)
    crash_on: str = ""  # a task whose step raises (tests)


def _tasks(options):
    return list(options.letters)


class SayLetter:
    def __init__(self, options, workdir):
        self.options, self.workdir, self.target = options, workdir, ""

    def reset(self, task_id, seed):
        self.target = task_id
        return Observation(f"say {task_id}")

    def step(self, action):
        if self.target == self.options.crash_on:
            raise RuntimeError("the plugin broke mid-episode")
        success = self.target in action
        return StepResult(Observation("ok" if success else "no"), 1.0 if success else 0.0, True)

    def close(self):
        pass


@environment_plugin(options=Options, tasks=_tasks)
def make(options, workdir):
    return SayLetter(options, workdir)


def untyped(options):
    """A factory with no options model: it gets the mapping itself."""
    env = SayLetter(Options(**options), "")
    env.tasks = ["a"]
    return env
'''


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sayletter`` as an installed distribution (entry point ``say-letter``) outside the source tree."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "sayletter").mkdir()
    (root / "sayletter" / "__init__.py").write_text(PLUGIN)
    (root / "broken.py").write_text("import not_a_module_anywhere\n")
    info = root / "sayletter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sayletter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[stoker.environments]\nsay-letter = sayletter:make\n")
    return root


@pytest.fixture
def on_path(plugin_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(plugin_root))
    paths = [str(plugin_root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # for the sandboxes and `stoker run`
    yield plugin_root
    sys.modules.pop("sayletter", None)


def test_a_reference_and_an_entry_point_make_the_same_environment(on_path: Path, tmp_path: Path) -> None:
    for name in ("sayletter:make", "say-letter"):
        env = make_environment(name, {"letters": "xyz"}, str(tmp_path))
        assert env.reset("y", 0).text == "say y"
        assert env.step("I say y").reward == 1.0
        assert resolve(name).tasks({"letters": "xyz"}, str(tmp_path)) == ["x", "y", "z"]
    untyped = make_environment("sayletter:untyped", {"letters": "q"}, "")
    assert untyped.reset("q", 0).text == "say q"
    assert resolve("sayletter:untyped").tasks({}, str(tmp_path)) == ["a"]


def test_bad_references_import_errors_and_bad_options_are_clear(on_path: Path) -> None:
    assert environment_problems("sayletter:make", {"letters": "ab"}, []) == []
    [(path, message)] = environment_problems("nope", {}, [])
    assert path == "environment.name" and "frozenlake, swe, swebench, answers, say-letter" in message
    [(path, message)] = environment_problems("sayletter:nothing", {}, [])
    assert "has no attribute 'nothing'" in message
    [(path, message)] = environment_problems("broken:make", {}, [])
    assert "cannot import broken: ModuleNotFoundError" in message
    [(path, message)] = environment_problems("sayletter:make", {"letters": ""}, [])
    assert path == "environment.options.letters" and "at least 1 character" in message
    [(path, message)] = environment_problems("say-letter", {"letterz": "ab"}, ["missing.jsonl"])
    assert path == "environment.tasks[0]" and "No such file" in message
    with pytest.raises(EnvironmentProblem, match="rejected its options: options.letters"):
        make_environment("sayletter:make", {"letters": ""}, "")


def test_stoker_validate_reports_plugin_problems_with_field_paths(on_path: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nspec:\n"
        "  environment: {name: 'sayletter:make', options: {letters: ''}}\n"
    )
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "validate", str(manifest)], capture_output=True, text=True)
    assert done.returncode == 2
    assert f"{manifest}: spec.environment.options.letters: String should have at least 1 character" in done.stderr
    assert "Traceback" not in done.stderr


@pytest_asyncio.fixture
async def zygote() -> AsyncIterator[Zygote]:
    zygote = Zygote()
    yield zygote
    await zygote.aclose()


@pytest.mark.asyncio
async def test_a_plugin_raising_mid_episode_fails_that_episode_only(
    on_path: Path, swe: TextInterface, zygote: Zygote
) -> None:
    config = SandboxConfig("sayletter:make", json.dumps({"letters": "ab", "crash_on": "b"}), step_timeout_seconds=20.0)
    factory = ProcessSandboxFactory(config, zygote)
    policy = ScriptedPolicy(lambda prompt: [*swe.encode("a"), swe.stop_token_ids[0]])
    limits = EpisodeLimits(max_turns=2, max_new_tokens=8, max_tokens=512)
    [crashed] = await run_group(policy, factory, swe, "b", 1, limits=limits)
    assert crashed.status == FAILED and "RuntimeError: the plugin broke mid-episode" in crashed.status_reason
    # Its traceback comes along from the sandbox process, for the run's failure report.
    assert "Traceback (most recent call last)" in crashed.status_reason and ", in step" in crashed.status_reason
    [fine] = await run_group(policy, factory, swe, "a", 1, limits=limits)  # the same zygote goes on
    assert fine.status == OK and fine.reward == 1.0


@pytest.mark.slow
def test_a_plugin_environment_trains_end_to_end_through_stoker_run(on_path: Path, tmp_path: Path, jax_env: dict[str, str]) -> None:
    manifest = tmp_path / "plugin.yaml"
    manifest.write_text(textwrap.dedent("""\
        apiVersion: stoker.dev/v1alpha1
        kind: RLJob
        metadata: {name: plugin}
        spec:
          model: {architecture: {vocabSize: 264, hiddenSize: 32, numLayers: 1, intermediateSize: 64, maxSeqLen: 64}}
          environment: {name: say-letter, options: {letters: ab}, maxTurns: 1, sandbox: {kind: process}}
          actors: {replicas: 1, concurrency: 2, sampling: {maxNewTokens: 4}}
          buffer: {groupSize: 2, maxStaleness: 2}
          learner: {batchGroups: 1, sequenceBuckets: [64], maxSteps: 3}
        """))
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(tmp_path / "run"), "--no-progress"],
        capture_output=True, text=True, env=jax_env, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [s["step"] for s in steps] == [1, 2, 3]
