"""The SWE environment's tool protocol, run directly (the sandbox tests run it in a sandbox)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.actor.environments import EnvironmentProblem
from stoker.actor.swe import SweEnvironment, SweTask, bundled_tasks, parse_command, solution_commands


def test_a_handful_of_tasks_ship_and_each_fails_until_fixed(tmp_path: Path) -> None:
    tasks = bundled_tasks()
    assert 3 <= len(tasks) <= 5
    for task in tasks:
        env = SweEnvironment(str(tmp_path / task))
        first = env.reset(task, seed=0)
        assert SweTask.load(task).description in first.text
        before = env.step("run_tests")
        assert not before.terminated and before.reward == 0.0 and before.observation.text.startswith("FAILED")
        results = [env.step(command) for command in solution_commands(task)]
        assert results[-1].terminated and results[-1].reward == 1.0
        assert results[-1].observation.info["metrics"]["success"] == 1.0


def test_parse_commands() -> None:
    assert parse_command("  view ranges.py").path == "ranges.py"
    replace = parse_command("replace a.py\n<<<\nx = 1\n===\nx = 2\n>>>")
    assert (replace.name, replace.path, replace.old, replace.new) == ("replace", "a.py", "x = 1", "x = 2")
    assert parse_command("replace a.py\nx = 1").name == "invalid"
    assert parse_command("rm -rf /").name == "invalid"
    assert parse_command("").problem == "empty answer"


@pytest.fixture
def env(tmp_path: Path) -> SweEnvironment:
    environment = SweEnvironment(str(tmp_path))
    environment.reset("median", seed=0)
    return environment


def test_tests_are_read_only(env: SweEnvironment) -> None:
    result = env.step("replace test_stats.py\n<<<\nassertEqual\n===\nassertNotEqual\n>>>")
    assert "read-only" in result.observation.text
    assert "assertEqual" in env.step("view test_stats.py").observation.text


def test_paths_cannot_escape_the_repository(env: SweEnvironment, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("s3cret")
    assert "no such file" in env.step("view ../secret.txt").observation.text
    assert "no such file" in env.step("view /etc/passwd").observation.text


def test_replace_needs_exactly_one_match_and_bad_commands_explain_the_tools(env: SweEnvironment) -> None:
    assert "found 0 times" in env.step("replace stats.py\n<<<\nnot there\n===\nx\n>>>").observation.text
    assert "found 6 times" in env.step("replace stats.py\n<<<\nordered\n===\nx\n>>>").observation.text
    assert "tools" in env.step("please fix it").observation.text
    assert env.step("ls").observation.text == "stats.py test_stats.py"


def test_unknown_task_is_a_clear_problem(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentProblem, match="not in this job's task list"):
        SweEnvironment(str(tmp_path)).reset("nope", seed=0)
    with pytest.raises(EnvironmentProblem, match="unknown swe task"):
        SweTask.load("nope")
