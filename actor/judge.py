"""Judging an agent's code by tests it cannot fake (the harness side is ``stoker.actor.harness``).

``judge_unittest`` copies the agent's files into a fresh directory outside the agent's tree,
writes the pristine test files over them, and runs the harness there in a fresh, confined
interpreter (``stoker.actor.isolation``). The verdict comes only from the junit-XML report the
harness writes to a pipe, checked against a nonce; the report is kept beside the judged copy
(``report.xml``), outside the agent's tree. No report, a wrong nonce, or a report saying the
harness's objects were patched all mean "not passed".
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stoker.actor import harness
from stoker.actor.isolation import confined_command, confined_popen_kwargs, make_readable_by_nobody


@dataclass(frozen=True)
class Verdict:
    """What a test run established; ``outcomes`` maps a unittest id to passed/failed/error/skipped."""

    outcomes: dict[str, str] = field(default_factory=dict)
    problem: str = ""  # why the run proves nothing (no report, tampering, timeout), else ""
    output: str = ""  # the run's stdout and stderr: shown to the agent, never trusted
    module_errors: int = 0  # test modules that could not be imported (a syntax error, an exit)

    def passed(self, test_ids: list[str] | None = None) -> bool:
        """Whether the run is trustworthy and every test (or every one of ``test_ids``) passed."""
        if self.problem or self.module_errors or not self.outcomes:
            return False
        wanted = test_ids if test_ids else list(self.outcomes)
        return all(self.outcomes.get(test_id) == "passed" for test_id in wanted)


def module_name(test_file: str) -> str:
    """``pkg/test_x.py`` -> ``pkg.test_x``."""
    return test_file.removesuffix(".py").replace("/", ".")


def judge_unittest(
    agent_tree: Path,
    pristine: dict[str, str],
    test_modules: list[str],
    judge_dir: Path,
    timeout_seconds: float,
    prepare: Callable[[Path], None] | None = None,
) -> Verdict:
    """Run ``test_modules`` against a copy of ``agent_tree`` with ``pristine`` files written over it.

    ``test_modules`` are names unittest loads (modules, or test ids such as ``mod.Class.test``);
    ``prepare`` then changes the copy (applies a test patch) before the run.
    """
    if judge_dir.exists():
        shutil.rmtree(judge_dir)
    repo = judge_dir / "repo"
    shutil.copytree(agent_tree, repo, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for name, content in pristine.items():  # the tests as written, whatever the agent did to them
        path = repo / name
        if path.is_symlink() or path.is_dir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    if prepare is not None:
        prepare(repo)
    make_readable_by_nobody(judge_dir)
    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    argv = [sys.executable, "-I", harness.__file__, "--repo", str(repo), f"--report-fd={write_end}", *test_modules]
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(read_end, chunks), daemon=True)
    try:
        process = subprocess.Popen(
            confined_command(argv, repo),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_end,),
            **confined_popen_kwargs(),
        )
    finally:
        os.close(write_end)
    reader.start()
    try:
        output, _ = process.communicate(f"{nonce}\n".encode(), timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        _kill_session(process)
        reader.join(5.0)
        return Verdict(problem=f"tests timed out after {timeout_seconds:g} s")
    reader.join(5.0)
    report = b"".join(chunks)
    (judge_dir / "report.xml").write_bytes(report)
    return _read_report(report, nonce, output.decode(errors="replace"))


def _drain(fd: int, chunks: list[bytes]) -> None:
    with os.fdopen(fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


def _read_report(report: bytes, nonce: str, output: str) -> Verdict:
    if not report.strip():
        return Verdict(problem="the test run ended without a report (the code under test ended the process)", output=output)
    try:
        suite = ElementTree.fromstring(report)
    except ElementTree.ParseError:
        return Verdict(problem="the test report is not valid junit XML", output=output)
    if suite.get("nonce") != nonce:
        return Verdict(problem="the test report was not written by the harness", output=output)
    if suite.get("tampered"):
        return Verdict(problem=f"the code under test patched the test machinery: {suite.get('tampered')}", output=output)
    outcomes: dict[str, str] = {}
    for case in suite.iter("testcase"):
        test_id = f"{case.get('classname')}.{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failed", "error", "skipped")]
        outcomes[test_id] = kinds[0] if kinds else "passed"
    module_errors = [element.text or "" for element in suite.iter("system-err")]
    if module_errors:
        output = "\n".join([output, *module_errors])
    return Verdict(outcomes=outcomes, output=output, module_errors=len(module_errors))
