"""SWE-bench-format instances: real git checkouts, the test patch, FAIL_TO_PASS and PASS_TO_PASS."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from stoker.actor.environments import EnvironmentProblem
from stoker.actor.settings import ActorSettings
from stoker.actor.swe import solution_commands
from stoker.actor.swebench import (
    SweBenchEnvironment,
    bundled_instances_dir,
    convert_bundled,
    git,
    load_instances,
    patched_files,
)
from stoker.spec import EnvironmentSpec, ModelSpec, RLJobSpec, TransformerConfig

from .conftest import CHEATS

BUNDLED = load_instances([str(bundled_instances_dir())])


def _env(tmp_path: Path, instance: str, instances: dict | None = None) -> SweBenchEnvironment:  # type: ignore[type-arg]
    env = SweBenchEnvironment(str(tmp_path / "sandbox"), instances or BUNDLED)
    env.reset(instance, seed=0)
    return env


def _source_file(env: SweBenchEnvironment) -> Path:
    """The module the reference fix edits: where an agent would put its code."""
    assert env.instance is not None
    return env.repo / patched_files(env.instance.patch)[0]


def test_the_four_bundled_tasks_ship_as_instances() -> None:
    assert sorted(BUNDLED) == ["fizzbuzz", "inclusive_range", "median", "word_count"]
    for instance in BUNDLED.values():
        assert instance.repo.endswith(".bundle") and instance.fail_to_pass and instance.test_patch


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_reference_fix_scores_one_and_no_change_scores_zero(name: str, tmp_path: Path) -> None:
    env = _env(tmp_path, name)
    instance = BUNDLED[name]
    assert git("rev-parse", "HEAD", cwd=env.repo).strip() == instance.base_commit  # a real checkout
    for test_file in patched_files(instance.test_patch):
        assert not (env.repo / test_file).exists()  # the tests arrive with the test patch, at judging
    assert env.step("run_tests").reward == 0.0
    assert env.last_verdict is not None
    assert {t for t, kind in env.last_verdict.outcomes.items() if kind == "passed"} == set(instance.pass_to_pass)
    git("apply", cwd=env.repo, stdin=instance.patch)
    result = env.step("run_tests")
    assert result.reward == 1.0 and result.terminated
    assert set(env.last_verdict.outcomes) == set(instance.tests)


def test_the_agent_fixes_it_through_its_tools(tmp_path: Path) -> None:
    env = _env(tmp_path, "median")
    results = [env.step(command) for command in solution_commands("median")]
    assert results[-1].reward == 1.0
    assert "no such file" in env.step("view .git/config").observation.text  # the git store is off limits


@pytest.mark.parametrize("name", sorted(BUNDLED))
@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_every_cheat_scores_zero(name: str, cheat: str, tmp_path: Path) -> None:
    env = _env(tmp_path, name)
    source = _source_file(env)
    source.write_text(CHEATS[cheat] + "\n" + source.read_text())
    assert env.step("run_tests").reward == 0.0


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_writing_the_tests_yourself_scores_zero(name: str, tmp_path: Path) -> None:
    env = _env(tmp_path, name)
    for test_id in BUNDLED[name].tests:  # the same ids, tests that pass whatever the code does
        module, cls, method = test_id.split(".")
        path = env.repo / f"{module}.py"
        body = path.read_text() if path.exists() else "import unittest\n"
        path.write_text(body + f"\nclass {cls}(unittest.TestCase):\n    def {method}(self):\n        pass\n")
    assert env.step("run_tests").reward == 0.0


def _user_repo(root: Path) -> Path:
    """A user's own repository directory: a package with a bug and a test that already passes."""
    repo = root / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_ops.py").write_text(
        "import unittest\nfrom calc.ops import add, neg\n\n\nclass OpsTest(unittest.TestCase):\n"
        "    def test_neg(self):\n        self.assertEqual(neg(2), -2)\n"
    )
    git("init", "--quiet", "--initial-branch=main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "--quiet", "-m", "calc", cwd=repo)
    return repo


def test_a_users_own_directory_of_instances_loads_the_same_way(tmp_path: Path) -> None:
    repo = _user_repo(tmp_path)
    base = git("rev-parse", "HEAD", cwd=repo).strip()
    (repo / "tests" / "test_ops.py").write_text(
        (repo / "tests" / "test_ops.py").read_text() + "\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    )
    test_patch = git("diff", cwd=repo)
    git("checkout", "--quiet", ".", cwd=repo)
    instances = tmp_path / "instances"
    instances.mkdir()
    record = {
        "instance_id": "calc-1", "repo": "../calc", "base_commit": base, "problem_statement": "add subtracts",
        "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["tests.test_ops.OpsTest.test_add"]),
        "PASS_TO_PASS": json.dumps(["tests.test_ops.OpsTest.test_neg"]), "test_command": "unittest",
    }
    (instances / "calc.jsonl").write_text(json.dumps(record) + "\n")
    loaded = load_instances([str(instances)])
    env = _env(tmp_path, "calc-1", loaded)
    assert env.step("run_tests").reward == 0.0
    fix = "replace calc/ops.py\n<<<\n    return a - b\n===\n    return a + b\n>>>"
    assert "replaced" in env.step(fix).observation.text
    # Fixing FAIL_TO_PASS while breaking PASS_TO_PASS is not a fix.
    assert "replaced" in env.step("replace calc/ops.py\n<<<\n    return -a\n===\n    return a\n>>>").observation.text
    assert env.step("run_tests").reward == 0.0
    assert "replaced" in env.step("replace calc/ops.py\n<<<\ndef neg(a):\n    return a\n===\ndef neg(a):\n    return -a\n>>>").observation.text
    assert env.step("run_tests").reward == 1.0
    # The protected test module cannot be edited through the tools either.
    assert "read-only" in env.step("replace tests/test_ops.py\n<<<\nneg(2), -2\n===\nneg(2), 2\n>>>").observation.text


def test_bad_instances_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instance_id": "x", "repo": "r"}) + "\n")
    with pytest.raises(EnvironmentProblem, match="bad.jsonl:1: missing base_commit, test_patch"):
        load_instances([str(bad)])
    bad.write_text(json.dumps({**BUNDLED_RECORD, "test_command": "pytest -x"}) + "\n")
    with pytest.raises(EnvironmentProblem, match="test_command 'pytest -x'; expected unittest"):
        load_instances([str(bad)])
    bad.write_text(json.dumps({**BUNDLED_RECORD, "base_commit": "0" * 40}) + "\n")
    env = SweBenchEnvironment(str(tmp_path / "s"), load_instances([str(bad)]))
    with pytest.raises(EnvironmentProblem, match="git clone failed|git checkout failed"):
        env.reset("median", seed=0)


BUNDLED_RECORD = {
    **json.loads(next(line for line in (bundled_instances_dir() / "instances.jsonl").read_text().splitlines() if '"median"' in line)),
    "repo": str(bundled_instances_dir() / "median.bundle"),
}


def test_conversion_is_reproducible(tmp_path: Path) -> None:
    records = convert_bundled(tmp_path)
    shipped = [json.loads(line) for line in (bundled_instances_dir() / "instances.jsonl").read_text().splitlines()]
    assert records == shipped


def test_a_job_plays_the_bundled_instances_in_process_sandboxes_spec(tmp_path: Path) -> None:
    spec = RLJobSpec(
        environment=EnvironmentSpec(name="swebench"), model=ModelSpec(architecture=TransformerConfig(vocab_size=320))
    )
    settings = ActorSettings.from_spec(spec, actor_id="a")
    assert sorted(settings.tasks) == sorted(BUNDLED)
    done = subprocess.run(["git", "--version"], capture_output=True, text=True)
    assert done.returncode == 0
