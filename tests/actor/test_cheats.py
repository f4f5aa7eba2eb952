"""Every known way to fake a SWE reward gets 0, and the sandbox holds (bubblewrap and fallback)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.actor import isolation
from stoker.actor.swe import SweEnvironment, solution_commands

from .conftest import CHEATS

BUBBLEWRAP = isolation.isolation() == isolation.BUBBLEWRAP


@pytest.fixture(params=["bubblewrap", "rlimits"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "bubblewrap" and not BUBBLEWRAP:
        pytest.skip("bwrap cannot run here (see docs/environments.md, Isolation)")
    if request.param == "rlimits":
        monkeypatch.setenv("STOKER_SANDBOX_ISOLATION", "rlimits")
    isolation.isolation.cache_clear()
    yield request.param
    monkeypatch.delenv("STOKER_SANDBOX_ISOLATION", raising=False)
    isolation.isolation.cache_clear()


def _median(tmp_path: Path) -> SweEnvironment:
    env = SweEnvironment(str(tmp_path / "sandbox"))
    env.reset("median", seed=0)
    return env


def _prepend(env: SweEnvironment, code: str) -> None:
    """What the agent's replace tool can do: put code at the top of the solution module."""
    result = env.step(f"replace stats.py\n<<<\ndef median(values):\n===\n{code}\ndef median(values):\n>>>")
    assert "replaced" in result.observation.text




@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_code_that_fakes_the_verdict_gets_zero(cheat: str, mode: str, tmp_path: Path) -> None:
    env = _median(tmp_path)
    _prepend(env, CHEATS[cheat])
    result = env.step("run_tests")
    assert result.reward == 0.0 and not result.terminated
    assert result.observation.text.startswith("FAILED")


def test_the_reference_fix_still_passes_with_each_mode(mode: str, tmp_path: Path) -> None:
    env = _median(tmp_path)
    results = [env.step(command) for command in solution_commands("median")]
    assert results[-1].reward == 1.0 and results[-1].terminated


def test_editing_the_tests_or_adding_pytest_and_unittest_shims_gets_zero(mode: str, tmp_path: Path) -> None:
    env = _median(tmp_path)
    assert "read-only" in env.step("replace test_stats.py\n<<<\nassertEqual\n===\nassertNotEqual\n>>>").observation.text
    # A tool that could write any file would still lose: the judged copy gets the pristine tests,
    # and a conftest.py, sitecustomize.py or a unittest.py shadow is never imported by the harness.
    (env.repo / "test_stats.py").write_text("import unittest\nclass T(unittest.TestCase):\n    def test_ok(self): pass\n")
    (env.repo / "conftest.py").write_text("import os\nos._exit(0)\n")
    (env.repo / "sitecustomize.py").write_text("import os\nos._exit(0)\n")
    (env.repo / "unittest.py").write_text("raise SystemExit(0)\n")
    result = env.step("run_tests")
    assert result.reward == 0.0 and "FAILED: test_stats.MedianTest.test_odd_unsorted" in result.observation.text


@pytest.mark.skipif(not BUBBLEWRAP, reason="filesystem confinement needs bubblewrap")
def test_code_under_test_cannot_write_outside_or_read_another_sandbox(tmp_path: Path) -> None:
    isolation.isolation.cache_clear()
    other = tmp_path / "other-sandbox"
    other.mkdir()
    (other / "secret.txt").write_text("the-other-episodes-secret")
    outside = tmp_path / f"written-{uuid.uuid4().hex}"
    in_tmp = Path("/tmp") / f"stoker-cheat-{uuid.uuid4().hex}"
    env = _median(tmp_path)
    payload = f"""
import os
for target in ({str(outside)!r}, {str(in_tmp)!r}, {str(env.repo / "stats.py")!r}):
    try:
        with open(target, "a") as handle:
            handle.write("x")
        print("WROTE", target)
    except OSError as exc:
        print("DENIED", target, type(exc).__name__)
try:
    print("READ", open({str(other / "secret.txt")!r}).read())
except OSError as exc:
    print("DENIED-READ", type(exc).__name__)
print("UID", os.getuid())
"""
    _prepend(env, payload)
    assert env.step("run_tests").reward == 0.0
    assert env.last_verdict is not None
    output = env.last_verdict.output
    # Writes land in the run's private tmpfs at most, and vanish with it.
    assert not outside.exists() and not in_tmp.exists()
    assert f"DENIED {env.repo / 'stats.py'}" in output  # the agent's own tree is not even visible
    assert not (env.repo / "stats.py").read_text().endswith("x")
    assert "DENIED-READ" in output and "the-other-episodes-secret" not in output
    assert "UID 65534" in output  # never root
