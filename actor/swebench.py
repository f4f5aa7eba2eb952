"""SWE tasks in the SWE-bench instance format, with real git (the ``swebench`` environment).

An instance is one JSON object (a line of a JSONL file; ``environment.tasks`` names files or
directories of them)::

    {"instance_id": "median", "repo": "median.bundle", "base_commit": "<sha>",
     "problem_statement": "...", "test_patch": "<diff adding the tests>", "patch": "<reference fix>",
     "FAIL_TO_PASS": ["test_stats.MedianTest.test_odd_unsorted"], "PASS_TO_PASS": [],
     "test_command": "unittest"}

``repo`` is a local git directory or a git bundle, relative to the instance file. At reset the
sandbox clones it twice with real git, both at ``base_commit``: the agent's tree (``repo/``) and a
clean one outside it (``base/``). The agent works with the tools of ``stoker.actor.swe``. Judging
copies the agent's tree, writes every test file back to its ``base_commit`` content, applies
``test_patch`` and runs the FAIL_TO_PASS and PASS_TO_PASS tests in the confined judge
(``stoker.actor.judge``): reward 1 only when all of them pass. ``FAIL_TO_PASS``/``PASS_TO_PASS``
may be lists or JSON-encoded lists (as SWE-bench ships them). ``test_command`` is ``unittest``, the
one runner the harness can vouch for.

``python -m stoker.actor.swebench DIR`` converts the bundled TOML tasks into instances in DIR;
the converted four ship in ``actor/tasks/swebench/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.actor.datasets import jsonl_lines
from stoker.actor.environments import EnvironmentProblem, Observation
from stoker.actor.judge import Verdict, judge_unittest
from stoker.actor.swe import TOOLS_HELP, SweEnvironment, SweTask, bundled_tasks, tasks_root

REQUIRED = ("instance_id", "repo", "base_commit", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
# Fixed identity and dates: a conversion always produces the same commits.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "stoker", "GIT_AUTHOR_EMAIL": "stoker@localhost", "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "stoker", "GIT_COMMITTER_EMAIL": "stoker@localhost",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


def bundled_instances_dir() -> Path:
    return tasks_root() / "swebench"


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str  # absolute: a git directory or bundle
    base_commit: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    problem_statement: str = ""
    patch: str = ""  # the reference fix (never copied into the agent's tree)

    @classmethod
    def from_record(cls, record: dict[str, Any], base: Path, where: str) -> SweInstance:
        missing = [name for name in REQUIRED if name not in record]
        if missing:
            raise EnvironmentProblem(f"{where}: missing {', '.join(missing)}")
        if record.get("test_command", "unittest") != "unittest":
            raise EnvironmentProblem(f"{where}: test_command {record['test_command']!r}; expected unittest")
        repo = Path(str(record["repo"]))
        return cls(
            instance_id=str(record["instance_id"]),
            repo=str(repo if repo.is_absolute() else (base / repo).resolve()),
            base_commit=str(record["base_commit"]),
            test_patch=str(record["test_patch"]),
            fail_to_pass=_test_list(record["FAIL_TO_PASS"], f"{where}: FAIL_TO_PASS"),
            pass_to_pass=_test_list(record["PASS_TO_PASS"], f"{where}: PASS_TO_PASS"),
            problem_statement=str(record.get("problem_statement", "")),
            patch=str(record.get("patch", "")),
        )

    @property
    def tests(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]


def _test_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise EnvironmentProblem(f"{where}: not a list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EnvironmentProblem(f"{where}: not a list of test ids")
    return tuple(value)


def load_instances(paths: list[str]) -> dict[str, SweInstance]:
    """Instances from JSONL files and directories of them (``*.jsonl``), by ``instance_id``."""
    found: dict[str, SweInstance] = {}
    for entry in paths:
        path = Path(entry)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            raise EnvironmentProblem(f"{entry}: no *.jsonl instance files")
        for file in files:
            for number, record in jsonl_lines(file):
                if not isinstance(record, dict):
                    raise EnvironmentProblem(f"{file}:{number}: expected an instance object")
                instance = SweInstance.from_record(record, file.parent, f"{file}:{number}")
                found.setdefault(instance.instance_id, instance)
    return found


def git(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    """Run git; a failure is an ``EnvironmentProblem`` with git's own message."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd or Path.cwd()), **GIT_ENV}
    if cwd is not None:  # never a repository above cwd (a sandbox directory inside someone's checkout)
        env["GIT_CEILING_DIRECTORIES"] = str(cwd.resolve().parent)
    done = subprocess.run(["git", *args], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        command = next((a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-c")), "")
        raise EnvironmentProblem(f"git {command} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


def checkout(instance: SweInstance, dest: Path) -> None:
    """Clone the instance's repository (directory or bundle) into ``dest`` at ``base_commit``."""
    if dest.exists():
        shutil.rmtree(dest)
    git("clone", "--quiet", "--no-checkout", instance.repo, str(dest))
    git("-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", instance.base_commit, cwd=dest)


def patched_files(patch: str) -> list[str]:
    """Paths a unified diff writes (its ``+++ b/...`` lines)."""
    return [line[6:].strip() for line in patch.splitlines() if line.startswith("+++ b/")]


def test_file_of(test_id: str, tree: Path) -> str | None:
    """The file defining a unittest id (``pkg.test_x.Class.test`` -> ``pkg/test_x.py``) in ``tree``."""
    parts = test_id.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = "/".join(parts[:cut]) + ".py"
        if (tree / candidate).is_file():
            return candidate
    return None


def judge_instance(instance: SweInstance, agent_tree: Path, base_tree: Path, judge_dir: Path, timeout: float) -> Verdict:
    """FAIL_TO_PASS and PASS_TO_PASS after the test patch, on a copy of the agent's tree."""
    test_files = set(patched_files(instance.test_patch))
    test_files |= {f for f in (test_file_of(t, base_tree) for t in instance.tests) if f is not None}
    pristine = {name: (base_tree / name).read_text() for name in sorted(test_files) if (base_tree / name).is_file()}

    def apply_test_patch(tree: Path) -> None:
        for name in test_files - set(pristine):  # files the test patch creates: never the agent's
            (tree / name).unlink(missing_ok=True)
        git("apply", "--whitespace=nowarn", cwd=tree, stdin=instance.test_patch)

    return judge_unittest(agent_tree, pristine, instance.tests, judge_dir, timeout, prepare=apply_test_patch, test_files=sorted(test_files))


class SweBenchEnvironment(SweEnvironment):
    """A SWE-bench instance per episode: real git checkouts, judged after the test patch."""

    def __init__(self, workdir: str, instances: dict[str, SweInstance], test_timeout_seconds: float = 20.0):
        super().__init__(workdir, list(instances), test_timeout_seconds)
        self.instances = instances
        self.instance: SweInstance | None = None
        self.base = self.workdir / "base"

    @classmethod
    def from_options(cls, options: dict[str, Any], workdir: str) -> SweBenchEnvironment:
        files = list(options.get("taskFiles") or []) or [str(bundled_instances_dir())]
        return cls(workdir, load_instances(files), float(options.get("testTimeoutSeconds", 20.0)))

    def reset(self, task_id: str, seed: int) -> Observation:
        del seed
        instance = self.instances.get(task_id)
        if instance is None:
            raise EnvironmentProblem(f"unknown SWE-bench instance {task_id!r}")
        self.instance = instance
        checkout(instance, self.base)  # the judge's clean copy, outside the agent's tree
        checkout(instance, self.repo)
        protected = {f for f in (test_file_of(t, self.base) for t in instance.tests) if f is not None}
        self.task = SweTask(instance.instance_id, instance.problem_statement, {}, tuple(sorted(protected)), ())
        self._test_runs = self._steps = 0
        self._tampering = {}
        text = f"task: {instance.problem_statement}\nfiles: {' '.join(self._files())}\n{TOOLS_HELP}"
        return Observation(text, self._info(False))

    def _run_tests(self) -> tuple[bool, str]:
        assert self.instance is not None
        self._test_runs += 1
        verdict = judge_instance(self.instance, self.repo, self.base, self.workdir / "judge", self.test_timeout_seconds)
        return self._judged(verdict, verdict.passed(self.instance.tests))

    def _answer_lines(self) -> list[str]:
        assert self.instance is not None
        added = [line[1:].strip() for line in self.instance.patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
        return [line for line in added if len(line) >= 6]

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.base, ignore_errors=True)


def instance_tasks(env: Any) -> tuple[tuple[str, ...], str]:
    """The instance ids to play and the options JSON, from ``environment.tasks`` (files, dirs, ids)."""
    files = [str(Path(e).resolve()) for e in env.tasks if e.endswith(".jsonl") or Path(e).is_dir()]
    chosen = [e for e in env.tasks if not (e.endswith(".jsonl") or Path(e).is_dir())]
    files = files or [str(bundled_instances_dir())]
    instances = load_instances(files)
    unknown = [task for task in chosen if task not in instances]
    if unknown:
        raise EnvironmentProblem(f"unknown SWE-bench instances {unknown}; the files hold {sorted(instances)}")
    return tuple(chosen or instances), json.dumps({**env.options, "taskFiles": files})


# ------------------------------------------------------------------------------- conversion


def convert_bundled(dest: Path) -> list[dict[str, Any]]:
    """Write each bundled TOML task as a git bundle and an instance line in ``dest/instances.jsonl``."""
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    records = []
    for name in bundled_tasks():
        task = SweTask.load(name)
        work = dest / f".{name}-work"
        if work.exists():
            shutil.rmtree(work)
        work.mkdir()
        git("init", "--quiet", "--initial-branch=main", cwd=work)
        for path, content in task.files.items():
            if path not in task.test_files:
                _write(work / path, content)
        git("add", "-A", cwd=work)
        git("commit", "--quiet", "-m", f"{name}: the code with the bug", cwd=work)
        base_commit = git("rev-parse", "HEAD", cwd=work).strip()
        for path in task.test_files:
            _write(work / path, task.files[path])
        git("add", "-A", cwd=work)
        test_patch = git("diff", "--cached", cwd=work)
        git("reset", "--quiet", "--hard", base_commit, cwd=work)
        for edit in task.solution:
            target = work / edit["path"]
            target.write_text(target.read_text().replace(edit["old"], edit["new"], 1))
        patch = git("diff", cwd=work)
        git("checkout", "--quiet", ".", cwd=work)
        git("bundle", "create", "--quiet", str(dest / f"{name}.bundle"), "main", cwd=work)
        record: dict[str, Any] = {
            "instance_id": name, "repo": f"{name}.bundle", "base_commit": base_commit,
            "problem_statement": task.description, "test_patch": test_patch, "patch": patch,
            "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "test_command": "unittest",
        }
        record["FAIL_TO_PASS"], record["PASS_TO_PASS"] = _classify(record, dest, work)
        shutil.rmtree(work)
        records.append(record)
    (dest / "instances.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return records


def _classify(record: dict[str, Any], dest: Path, work: Path) -> tuple[list[str], list[str]]:
    """Test ids failing at base (FAIL_TO_PASS) and passing at base (PASS_TO_PASS), after the patch."""
    test_ids = [f"{f.removesuffix('.py').replace('/', '.')}" for f in patched_files(record["test_patch"])]
    probe = SweInstance.from_record({**record, "FAIL_TO_PASS": test_ids}, dest, record["instance_id"])
    verdict = judge_instance(probe, work, work, work.parent / f".{record['instance_id']}-judge", 60.0)
    shutil.rmtree(work.parent / f".{record['instance_id']}-judge", ignore_errors=True)
    if verdict.problem or not verdict.outcomes:
        raise EnvironmentProblem(f"{record['instance_id']}: cannot classify its tests: {verdict.problem}")
    failing = sorted(t for t, kind in verdict.outcomes.items() if kind != "passed")
    return failing, sorted(t for t, kind in verdict.outcomes.items() if kind == "passed")


def _write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else bundled_instances_dir()
    print(f"wrote {len(convert_bundled(out))} instances to {out}")
