"""The built-in verifiable-answers environment: one prompt, one answer, a verdict.

Each task is a record of a JSONL task file (``environment.tasks``)::

    {"id": "add-3-4", "prompt": "3+4=", "verifier": "numeric", "answer": 7}
    {"id": "capital", "prompt": "Capital of France?", "verifier": "exact", "answer": "Paris"}
    {"id": "date", "prompt": "A date, ISO", "verifier": "regex", "pattern": "\\\\d{4}-\\\\d{2}-\\\\d{2}"}
    {"id": "add", "prompt": "Write add(a, b)", "verifier": "python", "tests": ["assert add(1, 2) == 3"]}

Verifiers: ``exact`` (the stripped answer equals ``answer``; ``caseSensitive`` in the record or
``environment.options``, default false), ``numeric`` (the last number in the answer is within
``tolerance`` of ``answer``, relative, default 1e-6), ``regex`` (``pattern`` matches the whole
stripped answer) and ``python`` (the answer, its code fences removed, is ``solution.py``; ``tests``
is a unittest module importing from it, or a list of assert statements; they run in the confined
judge of ``stoker.actor.judge``, so the answer cannot fake its verdict). The default verifier is
``environment.options.verifier`` (``exact`` unless set). Reward 1 for a correct answer, else 0.

The episode ends after the first answer unless ``attempts`` (in the record or
``environment.options``, default 1) allows more: a wrong answer's verdict is then the next
observation ("incorrect: ...; try again (2 attempts left)") and the model answers again, up to
``attempts`` turns (within ``environment.maxTurns``); the episode ends at the first correct one.
"""

from __future__ import annotations

import ast
import builtins
import math
import re
from pathlib import Path
from typing import Any

from stoker.actor.datasets import records_by_id
from stoker.actor.environments import EnvironmentProblem, Observation, StepResult
from stoker.actor.judge import judge_unittest, tampering_metrics

VERIFIERS = ("exact", "numeric", "regex", "python")
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    try:
        return float(found[-1]) if found else None
    except ValueError:
        return None


def strip_fences(text: str) -> str:
    found = FENCE.findall(text)
    return found[0] if found else text


def solution_names(statements: list[str]) -> list[str]:
    """Names the assert lines read and do not define: what they import from ``solution``."""
    used: dict[str, None] = {}
    bound: set[str] = set(dir(builtins))
    for statement in statements:
        try:
            tree = ast.parse(statement)
        except SyntaxError:
            continue  # the test module will not compile: a module error, not passed
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (bound.add(node.id) if isinstance(node.ctx, ast.Store) else used.setdefault(node.id))
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
    return [name for name in used if name not in bound]


def tests_module(tests: Any) -> str:
    """A unittest module from a task's ``tests``: kept as is, or one test method per assert.

    The solution's names are imported one by one, never with ``*``: a solution exporting
    ``unittest`` (or anything else the module relies on) shadows nothing.
    """
    if isinstance(tests, str):
        return tests
    names = solution_names([str(statement) for statement in tests])
    imported = f"from solution import {', '.join(names)}" if names else "import solution  # noqa: F401"
    lines = ["import unittest", "", imported, "", "", "class SolutionTest(unittest.TestCase):"]
    for index, statement in enumerate(tests):
        body = "\n".join("        " + line for line in str(statement).splitlines())
        lines += [f"    def test_{index}(self):", body, ""]
    return "\n".join(lines) + "\n"


def verify(
    record: dict[str, Any], answer: str, options: dict[str, Any], workdir: Path, tampering: dict[str, int] | None = None
) -> tuple[bool, str]:
    """Whether ``answer`` is correct for ``record``, and a short note for the observation.

    ``tampering`` collects the judge's refused attempts by kind (python verifier)."""
    tampering = {} if tampering is None else tampering
    kind = record.get("verifier", options.get("verifier", "exact"))
    if kind not in VERIFIERS:
        raise EnvironmentProblem(f"task {record['id']!r}: verifier {kind!r}; expected one of {', '.join(VERIFIERS)}")
    if kind == "exact":
        expected, given = str(record.get("answer", "")).strip(), answer.strip()
        if not record.get("caseSensitive", options.get("caseSensitive", False)):
            expected, given = expected.casefold(), given.casefold()
        return given == expected, ""
    if kind == "numeric":
        value = last_number(answer)
        if value is None:
            return False, "no number in the answer"
        expected_value = float(record["answer"])
        tolerance = float(record.get("tolerance", options.get("tolerance", 1e-6)))
        return math.isclose(value, expected_value, rel_tol=tolerance, abs_tol=tolerance), ""
    if kind == "regex":
        return re.fullmatch(str(record["pattern"]), answer.strip()) is not None, ""
    tree = workdir / "answer"
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "solution.py").write_text(strip_fences(answer))
    verdict = judge_unittest(
        tree,
        {"test_solution.py": tests_module(record["tests"])},
        ["test_solution"],
        workdir / "judge",
        float(options.get("testTimeoutSeconds", 10.0)),
    )
    failing = [test_id for test_id, kind in sorted(verdict.outcomes.items()) if kind != "passed"]
    for kind, count in verdict.tampering_kinds().items():
        tampering[kind] = tampering.get(kind, 0) + count
    return verdict.passed(), verdict.problem or ("failing: " + " ".join(failing) if failing else "")


class AnswersEnvironment:
    """One question per episode, judged by its record's verifier (one or more attempts)."""

    def __init__(self, options: dict[str, Any], workdir: str):
        self.options = options
        self.workdir = Path(workdir or ".")
        self.tasks = records_by_id(list(options.get("taskFiles") or []))
        self.record: dict[str, Any] | None = None
        self.attempts_left = 1
        self.tampering: dict[str, int] = {}  # refused attempts by kind, over the whole episode

    @classmethod
    def from_options(cls, options: dict[str, Any], workdir: str) -> AnswersEnvironment:
        if not options.get("taskFiles"):
            raise EnvironmentProblem("the answers environment needs environment.tasks to name a JSONL task file")
        return cls(options, workdir)

    def reset(self, task_id: str, seed: int) -> Observation:
        del seed
        record = self.tasks.get(task_id)
        if record is None:
            raise EnvironmentProblem(f"unknown task {task_id!r}; not in {', '.join(self.options['taskFiles'])}")
        if "prompt" not in record:
            raise EnvironmentProblem(f"task {task_id!r} has no prompt")
        attempts = record.get("attempts", self.options.get("attempts", 1))
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
            raise EnvironmentProblem(f"task {task_id!r}: attempts {attempts!r}; expected an integer >= 1")
        self.record, self.attempts_left, self.tampering = record, attempts, {}
        return Observation(str(record["prompt"]), _info(False))

    def step(self, action: str) -> StepResult:
        if self.record is None:
            raise EnvironmentProblem("step before reset")
        correct, note = verify(self.record, action, self.options, self.workdir, self.tampering)
        self.attempts_left -= 1
        text = ("correct" if correct else "incorrect") + (f": {note}" if note else "")
        done = correct or self.attempts_left <= 0
        if not done:
            text += f"; try again ({self.attempts_left} attempt{'s' if self.attempts_left != 1 else ''} left)"
        return StepResult(Observation(text, _info(correct, self.tampering)), 1.0 if correct else 0.0, done)

    def close(self) -> None:
        pass


def _info(success: bool, tampering: dict[str, int] | None = None) -> dict[str, Any]:
    return {"metrics": {"success": 1.0 if success else 0.0, **tampering_metrics(tampering or {})}}
