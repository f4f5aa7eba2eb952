"""A SWE-style environment: fix a small Python repository until its failing tests pass.

Each bundled task is one file, ``stoker/actor/tasks/<name>.toml``: a description, a repository of
two or three Python files (one holding a failing unittest) and a reference solution that is never
copied into the sandbox. (TOML rather than a directory of ``.py`` files so the task sources are
never mistaken for modules of the ``stoker`` package.) The agent works with a plain-text tool
protocol, one command per turn::

    ls
    view <path>
    replace <path>
    <<<
    old text (must occur exactly once)
    ===
    new text
    >>>
    run_tests

``run_tests`` judges a copy of the repository with the pristine test files written over it, in a
fresh confined process whose verdict is a report the agent's code cannot forge (see
``stoker.actor.judge``). Reward 1 and the episode ends when every test passes.
"""

from __future__ import annotations

import shutil
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from stoker.actor.environments import EnvironmentProblem, Observation, StepResult
from stoker.actor.judge import Verdict, judge_unittest, module_name, tampering_metrics

TOOLS_HELP = (
    "tools, one per turn: ls | view <path> | replace <path> then lines <<< old === new >>> | run_tests"
)
OUTPUT_LIMIT = 1200  # characters of tool output shown; observations cost context


def tasks_root() -> Path:
    return Path(str(resources.files("stoker.actor") / "tasks"))


def bundled_tasks() -> list[str]:
    """Names of the bundled tasks, sorted."""
    return sorted(p.stem for p in tasks_root().glob("*.toml"))


@dataclass(frozen=True)
class SweTask:
    name: str
    description: str
    files: dict[str, str]  # repository path -> content
    test_files: tuple[str, ...]
    solution: tuple[dict[str, str], ...]  # reference edits {path, old, new}

    @classmethod
    def load(cls, name: str) -> SweTask:
        if name not in bundled_tasks():
            raise EnvironmentProblem(f"unknown swe task {name!r}; expected one of {', '.join(bundled_tasks())}")
        data = tomllib.loads((tasks_root() / f"{name}.toml").read_text())
        return cls(
            name=name,
            description=data["description"],
            files=dict(data["files"]),
            test_files=tuple(data["test_files"]),
            solution=tuple(data.get("solution", ())),
        )


@dataclass(frozen=True)
class Command:
    name: str  # ls | view | replace | run_tests | invalid
    path: str = ""
    old: str = ""
    new: str = ""
    problem: str = ""


def parse_command(text: str) -> Command:
    """Parse one tool call from the model's text (leading blank lines ignored)."""
    body = text.lstrip()
    first, _, rest = body.partition("\n")
    words = first.split()
    if not words:
        return Command("invalid", problem="empty answer")
    verb = words[0]
    if verb in ("ls", "run_tests"):
        return Command(verb)
    if verb == "view" and len(words) == 2:
        return Command("view", path=words[1])
    if verb == "replace" and len(words) == 2:
        start, sep, tail = rest.partition("<<<\n")
        old, mid, tail = tail.partition("\n===\n")
        new, end, _ = tail.partition("\n>>>")
        if start.strip() or not (sep and mid and end):
            return Command("invalid", problem="replace needs lines <<<, ===, >>> around old and new text")
        return Command("replace", path=words[1], old=old, new=new)
    return Command("invalid", problem=f"unknown command {first[:40]!r}")


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else "..." + text[-OUTPUT_LIMIT:]


class SweEnvironment:
    """One repository-fixing episode inside a sandbox's private directory."""

    def __init__(self, workdir: str, allowed: list[str] | None = None, test_timeout_seconds: float = 20.0):
        self.workdir = Path(workdir)
        self.allowed = allowed or bundled_tasks()
        self.test_timeout_seconds = test_timeout_seconds
        self.task: SweTask | None = None
        self.repo = self.workdir / "repo"
        self._test_runs = 0
        self._steps = 0
        self._tampering: dict[str, int] = {}  # refused attempts this episode, by kind
        self.last_verdict: Verdict | None = None  # the latest test run's, for tests and debugging

    @classmethod
    def from_options(cls, options: dict[str, Any], workdir: str) -> SweEnvironment:
        return cls(workdir, list(options.get("tasks") or []) or None)

    def reset(self, task_id: str, seed: int) -> Observation:
        del seed  # the tasks are deterministic
        if task_id not in self.allowed:
            raise EnvironmentProblem(f"swe task {task_id!r} is not in this job's task list")
        self.task = SweTask.load(task_id)
        if self.repo.exists():
            shutil.rmtree(self.repo)
        for name, content in self.task.files.items():
            path = self.repo / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        self._test_runs = self._steps = 0
        self._tampering = {}
        text = f"task: {self.task.description}\nfiles: {' '.join(self._files())}\n{TOOLS_HELP}"
        return Observation(text, self._info(False))

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise EnvironmentProblem("step before reset")
        self._steps += 1
        command = parse_command(action)
        if command.name == "run_tests":
            passed, output = self._run_tests()
            return StepResult(Observation(output, self._info(passed)), 1.0 if passed else 0.0, passed)
        if command.name == "ls":
            text = " ".join(self._files())
        elif command.name == "view":
            path = self._resolve(command.path)
            text = path.read_text() if path is not None and path.is_file() else f"no such file: {command.path}"
        elif command.name == "replace":
            text = self._replace(command)
        else:
            text = f"invalid: {command.problem}\n{TOOLS_HELP}"
        return StepResult(Observation(_tail(text), self._info(False)), 0.0, False)

    def close(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)

    def _files(self) -> list[str]:
        return sorted(str(p.relative_to(self.repo)) for p in self.repo.rglob("*.py"))

    def _resolve(self, name: str) -> Path | None:
        path = (self.repo / name).resolve()
        root = self.repo.resolve()
        if not path.is_relative_to(root) or ".git" in path.relative_to(root).parts:
            return None  # outside the repository, or its git store (the judge's, not the agent's)
        return path

    def _replace(self, command: Command) -> str:
        assert self.task is not None
        path = self._resolve(command.path)
        if path is None or not path.is_file():
            return f"no such file: {command.path}"
        if str(path.relative_to(self.repo.resolve())) in self.task.test_files:
            return f"{command.path} is a test file; tests are read-only"
        content = path.read_text()
        count = content.count(command.old) if command.old else 0
        if count != 1:
            return f"old text found {count} times in {command.path}; expected exactly once"
        path.write_text(content.replace(command.old, command.new))
        return f"replaced in {command.path}"

    def _run_tests(self) -> tuple[bool, str]:
        assert self.task is not None
        self._test_runs += 1
        pristine = {name: self.task.files[name] for name in self.task.test_files}
        verdict = judge_unittest(
            self.repo,
            pristine,
            [module_name(name) for name in self.task.test_files],
            self.workdir / "judge",
            self.test_timeout_seconds,
        )
        return self._judged(verdict, verdict.passed())

    def _judged(self, verdict: Verdict, passed: bool) -> tuple[bool, str]:
        self.last_verdict = verdict
        for kind, count in verdict.tampering_kinds().items():
            self._tampering[kind] = self._tampering.get(kind, 0) + count
        return passed, _tail(("PASSED\n" if passed else "FAILED\n") + summarize(verdict, self._answer_lines()))

    def _answer_lines(self) -> list[str]:
        """Lines of the reference fix: never shown to the agent, whatever the judged code printed."""
        assert self.task is not None
        return [line.strip() for edit in self.task.solution for line in edit["new"].splitlines() if len(line.strip()) >= 6]

    def _info(self, success: bool) -> dict[str, Any]:
        return {"metrics": {
            "success": 1.0 if success else 0.0,
            "test_runs": float(self._test_runs),
            "steps": float(self._steps),
            **tampering_metrics(self._tampering),
        }}



def summarize(verdict: Verdict, withheld: list[str] | None = None) -> str:
    """Failing test names, the run's problem and its last lines: enough to act on, and short.

    Output lines holding any of ``withheld`` (the reference fix) are dropped."""
    failing = [f"{kind.upper()}: {test_id}" for test_id, kind in sorted(verdict.outcomes.items()) if kind != "passed"]
    lines = [line for line in verdict.output.strip().splitlines() if not any(w in line for w in withheld or [])]
    keep = [line for line in lines if "Error" in line.split(":")[0]]
    return "\n".join([*([verdict.problem] if verdict.problem else []), *failing, *keep[-5:], *lines[-1:]])


def solution_commands(task: str) -> list[str]:
    """The tool calls that solve a bundled task: each reference edit, then run_tests."""
    commands = [f"replace {e['path']}\n<<<\n{e['old']}\n===\n{e['new']}\n>>>" for e in SweTask.load(task).solution]
    return [*commands, "run_tests"]
