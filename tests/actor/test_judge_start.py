"""A judged run that never started is the sandbox's failure, retried and then a failed episode;
once the harness has started importing the agent's code, a missing report is the agent's (0)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stoker.actor import isolation, judge
from stoker.actor.environments import EnvironmentProblem
from stoker.actor.swe import SweEnvironment, solution_commands

TESTS = "import unittest\nfrom m import f\nclass T(unittest.TestCase):\n    def test_f(self):\n        self.assertEqual(f(2), 4)\n"


@pytest.fixture(params=["bubblewrap", "rlimits"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "bubblewrap" and isolation.isolation() != isolation.BUBBLEWRAP:
        pytest.fail(isolation.problem())  # fail, never skip: CI is meant to isolate
    if request.param == "rlimits":
        monkeypatch.setenv(isolation.ENV, isolation.FALLBACK)
    isolation.isolation.cache_clear()  # type: ignore[attr-defined]
    yield request.param
    monkeypatch.delenv(isolation.ENV, raising=False)
    isolation.isolation.cache_clear()  # type: ignore[attr-defined]


def _judge(tmp_path: Path, code: str) -> judge.Verdict:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / "m.py").write_text(code)
    return judge.judge_unittest(tree, {"test_m.py": TESTS}, ["test_m"], tmp_path / "judge", 20.0)


def _broken_starts(monkeypatch: pytest.MonkeyPatch, failing: int, breaks: Any) -> list[int]:
    """The first ``failing`` runs start broken by ``breaks(confined)``; returns the run count."""
    real = judge.confine
    runs: list[int] = []

    def confine(*args: Any, **kwargs: Any) -> Any:
        confined = real(*args, **kwargs)
        runs.append(len(runs))
        if len(runs) <= failing:
            breaks(confined)
        return confined

    monkeypatch.setattr(judge, "confine", confine)
    return runs


def _bad_bwrap_argument(confined: Any) -> None:
    bwrap = next(i for i, arg in enumerate(confined.argv) if os.path.basename(arg) == "bwrap")
    confined.argv[bwrap + 1 : bwrap + 1] = ["--ro-bind", "/nonexistent-stoker-source", "/nonexistent-stoker-target"]


def _harness_never_starts(confined: Any) -> None:
    python = len(confined.argv) - 1 - confined.argv[::-1].index("-I")  # the harness's interpreter: the last one
    confined.argv[python:] = ["-c", "import sys; print('interpreter died'); sys.exit(1)"]


def test_bwrap_failing_to_start_is_retried_then_the_judges_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "rlimits":
        runs = _broken_starts(monkeypatch, 99, _harness_never_starts)
        expected = "interpreter died"
    else:
        runs = _broken_starts(monkeypatch, 99, _bad_bwrap_argument)
        expected = "bwrap: Can't find source path /nonexistent-stoker-source"
    with pytest.raises(judge.JudgeUnavailable) as caught:
        _judge(tmp_path, "def f(x):\n    return x * 2\n")
    assert isinstance(caught.value, EnvironmentProblem)  # the episode fails (never a reward of 0)
    assert len(runs) == judge.START_ATTEMPTS
    message = str(caught.value)
    assert "\n" not in message and "did not start (3 tries)" in message and expected in message, message


def test_a_run_that_fails_to_start_once_is_retried_and_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    runs = _broken_starts(monkeypatch, 1, _bad_bwrap_argument if mode == "bubblewrap" else _harness_never_starts)
    assert _judge(tmp_path, "def f(x):\n    return x * 2\n").passed()
    assert len(runs) >= 2  # (a third if the machine also reset a mode in between)


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root actor hands the run to uid 65534")
def test_an_ancestor_made_private_between_runs_is_readable_again_on_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The flake of issue #33: a pytest session starting elsewhere makes /tmp/pytest-of-root 0700
    # (pytest strips a world-readable temporary root), so bwrap, started as nobody, could not
    # reach the judged copy ("bwrap: Can't find source path ...: Permission denied").
    if isolation.isolation() != isolation.BUBBLEWRAP:
        pytest.fail(isolation.problem())
    runs = _broken_starts(monkeypatch, 1, lambda confined: os.chmod(tmp_path, 0o700))
    assert _judge(tmp_path, "def f(x):\n    return x * 2\n").passed()
    assert len(runs) >= 2  # (a third if the machine also reset a mode in between)


@pytest.mark.parametrize("ending", ["import os\nos.abort()\n", "import os\nos._exit(0)\n",
                                    "import os\nos.close(1)\nos.close(2)\nos._exit(3)\n"])
def test_agent_code_ending_the_run_after_start_is_the_agents_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, ending: str) -> None:
    real, tries = judge._run, []

    def run(*args: Any) -> judge.Verdict:
        try:
            verdict = real(*args)
        except judge._NotStarted:  # only the machine's doing here (another pytest resetting /tmp's mode)
            tries.append("not started")
            raise
        tries.append("judged")
        return verdict

    monkeypatch.setattr(judge, "_run", run)
    verdict = _judge(tmp_path, ending + "def f(x):\n    return x * 2\n")
    assert not verdict.passed() and "ended without a report" in verdict.problem
    assert tries.count("judged") == 1 and tries[-1] == "judged"  # a started run is the agent's: never retried


def test_a_sandbox_that_cannot_start_fails_the_swe_step_not_the_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = SweEnvironment(str(tmp_path / "sandbox"))
    env.reset("median", seed=0)
    for command in solution_commands("median")[:-1]:
        env.step(command)
    _broken_starts(monkeypatch, 99, _bad_bwrap_argument)
    with pytest.raises(judge.JudgeUnavailable):
        env.step("run_tests")


FORK_HANDLERS_ABORT = """
import ctypes, sys
from pathlib import Path
from stoker.actor import isolation, judge
assert isolation.isolation() == isolation.BUBBLEWRAP and isolation.interpreter()  # probed (and cached) first, as the zygote does
libc = ctypes.CDLL("libc.so.6")
# What gRPC does in a sandbox whose server runs: a C fork handler that can crash the child before
# it execs. Here it always aborts: only a spawn that runs no fork handlers (vfork) gets through.
# (pthread_atfork is glibc's static wrapper of __register_atfork.)
assert libc.__register_atfork(None, None, ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0
tmp = Path(sys.argv[1])
(tmp / "tree").mkdir()
(tmp / "tree" / "m.py").write_text("def f(x):\\n    return x * 2\\n")
verdict = judge.judge_unittest(tmp / "tree", {"test_m.py": sys.argv[2]}, ["test_m"], tmp / "judge", 20.0)
print("passed" if verdict.passed() else f"failed: {verdict.problem}")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root actor hands the run to uid 65534 (which made it fork)")
def test_a_root_judge_starts_its_run_without_fork_so_the_sandboxs_fork_handlers_never_run(tmp_path: Path) -> None:
    # The CI flake: Popen(user=65534) must fork(), and in a sandbox gRPC's fork handler crashed
    # the child before exec (exit -11, "the test run did not start (3 tries)"), ~1 run in 3.
    import subprocess
    import sys

    if isolation.isolation() != isolation.BUBBLEWRAP:
        pytest.fail(isolation.problem())
    run = subprocess.run([sys.executable, "-c", FORK_HANDLERS_ABORT, str(tmp_path), TESTS],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "passed", (run.stdout + run.stderr)[-2000:]
