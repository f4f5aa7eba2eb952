"""Judging an agent's code by tests it cannot fake: this process is the trusted side.

``judge_unittest`` copies the agent's files into a fresh directory, writes the pristine test files
over them, and starts the test process (``harness.py`` with the audit hook of ``tamper.py``) in
the sandbox of ``stoker.actor.isolation``. The verdict is written here, by a process that never
imports the agent's code and that the test process cannot reach: the test process holds no nonce
and no report descriptor; its report arrives over a Unix socket, accepted only from the test
process's own pid after it has ``execve``d a fresh interpreter (see docs/environments.md,
"Isolation"), and is then checked rather than trusted: every test the pristine files define must
be there, plain-data comparisons are redone here from JSON, and any refused attempt (the hook's
``stoker-tampering:`` lines, or a connection from another process) means tampering, reward 0.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

from stoker.actor.environments import EnvironmentProblem
from stoker.actor.harness_rewrite import unchecked_forms
from stoker.actor.isolation import (
    BUBBLEWRAP,
    IsolationUnavailable,
    confine,
    describe,
    isolation,
    make_readable_by_nobody,
    tmp_limit_bytes,
)
from stoker.procstat import proc_stat

HARNESS_FILES = ("harness.py", "harness_rewrite.py", "tamper.py", "tamper_checks.py", "tamper_state.py", "tamper_report.py")
log = logging.getLogger("stoker.actor.judge")
_warned: list[bool] = []
NOTICE = re.compile(r"^stoker-tampering: ([^:\n]+): ?(.*)$", re.MULTILINE)
REPORT_LIMIT = 4 << 20
OUTPUT_LIMIT = 1 << 20
STARTED = b"stoker-started\n"  # the harness's first message, sent before it imports any agent code
START_ATTEMPTS = 3  # a run that never started (bwrap failed, the machine too loaded) is retried


class JudgeUnavailable(EnvironmentProblem):
    """No test run could start (the sandbox's fault, not the agent's): the episode fails, with this
    reason, and is never trained on as a reward."""


class _NotStarted(Exception):
    """This run ended before the harness said it started: no agent code ran."""


@dataclass(frozen=True)
class Verdict:
    """What a test run established; ``outcomes`` maps a unittest id to passed/failed/error/skipped."""

    outcomes: dict[str, str] = field(default_factory=dict)
    problem: str = ""  # why the run proves nothing (no report, tampering, timeout), else ""
    output: str = ""  # the run's stdout and stderr: shown to the agent, never trusted
    module_errors: int = 0  # test modules that could not be imported (a syntax error, an exit)
    tampering: tuple[tuple[str, str], ...] = ()  # (kind, detail) of each refused attempt
    expected: tuple[str, ...] = ()  # the tests the pristine files define (all must pass)

    def passed(self, test_ids: list[str] | None = None) -> bool:
        """Whether the run is trustworthy and every test (or every one of ``test_ids``) passed."""
        if self.problem or self.tampering or self.module_errors or not self.outcomes:
            return False
        wanted = list(test_ids) if test_ids else [*self.expected, *self.outcomes]
        return all(self.outcomes.get(test_id) == "passed" for test_id in wanted)

    def tampering_kinds(self) -> dict[str, int]:
        """Refused attempts by kind (``frame introspection``: 2, ...)."""
        counts: dict[str, int] = {}
        for kind, _ in self.tampering:
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def tampering_metrics(kinds: dict[str, int]) -> dict[str, float]:
    """An episode's refused attempts for its ``info["metrics"]``: ``tampering_attempts`` (always)
    and ``tampering/<kind>`` per kind seen; they reach the learner's metrics as ``episode_*``.
    ``judge_confined`` is 0 when test runs go unconfined (the rlimits fallback), so a degraded
    sandbox shows in every metrics row, not only in a log line."""
    return {"tampering_attempts": float(sum(kinds.values())), "judge_confined": 1.0 if isolation() == BUBBLEWRAP else 0.0,
            **{f"tampering/{kind.replace(' ', '_')}": float(n) for kind, n in sorted(kinds.items())}}


def module_name(test_file: str) -> str:
    """``pkg/test_x.py`` -> ``pkg.test_x``."""
    return test_file.removesuffix(".py").replace("/", ".")


def defined_tests(module: str, source: str) -> list[str]:
    """The unittest ids a test module defines, read from its source (never imported here)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    methods: dict[str, list[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else "" for b in node.bases]
        if not any(b.endswith("TestCase") or b in methods for b in bases):
            continue
        own = [n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")]
        inherited = [m for b in bases for m in methods.get(b, [])]
        methods[node.name] = list(dict.fromkeys([*inherited, *own]))
    return [f"{module}.{cls}.{name}" for cls, names in methods.items() for name in names]


def expected_tests(pristine: dict[str, str], test_modules: list[str]) -> tuple[str, ...]:
    """What must pass: each module's defined tests, or the named test ids themselves."""
    sources = {module_name(name): text for name, text in pristine.items() if name.endswith(".py")}
    found: list[str] = []
    for entry in test_modules:
        parts = entry.split(".")
        module = next((".".join(parts[:cut]) for cut in range(len(parts), 0, -1) if ".".join(parts[:cut]) in sources), None)
        ids = defined_tests(module, sources[module]) if module else []
        chosen = [i for i in ids if i == entry or i.startswith(entry + ".")]
        found += chosen or [entry]
    return tuple(dict.fromkeys(found))


def judge_unittest(
    agent_tree: Path,
    pristine: dict[str, str],
    test_modules: list[str],
    judge_dir: Path,
    timeout_seconds: float,
    prepare: Callable[[Path], None] | None = None,
    test_files: list[str] | None = None,
) -> Verdict:
    """Run ``test_modules`` against a copy of ``agent_tree`` with ``pristine`` files written over it.

    ``test_modules`` are names unittest loads (modules, or test ids such as ``mod.Class.test``);
    ``prepare`` then changes the copy (applies a test patch) before the run. ``test_files`` are the
    copy's trusted test files after that (default: the pristine ones); only their assertions
    count. A sandbox that cannot
    isolate raises ``EnvironmentProblem`` (one line: why, and what to set).
    """
    if judge_dir.exists():
        shutil.rmtree(judge_dir)
    repo = judge_dir / "repo"
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "*.pyo", "*.so", "*.pth")
    shutil.copytree(agent_tree, repo, symlinks=True, ignore=ignore)
    for name, content in pristine.items():  # the tests as written, whatever the agent did to them
        path = repo / name
        if path.is_symlink() or path.is_dir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    if prepare is not None:
        prepare(repo)
    names = test_files if test_files is not None else list(pristine)
    tests = {name: (repo / name).read_text() for name in names if name.endswith(".py") and (repo / name).is_file()}
    harness_dir = judge_dir / "harness"
    harness_dir.mkdir()
    for name in HARNESS_FILES:
        shutil.copyfile(Path(__file__).with_name(name), harness_dir / name)
    verdict = _run_started(judge_dir, tests, test_modules, timeout_seconds)
    (judge_dir / "report.xml").write_text(junit(verdict))
    return verdict


def _run_started(judge_dir: Path, tests: dict[str, str], modules: list[str], timeout: float) -> Verdict:
    """The verdict of the first run that started, out of ``START_ATTEMPTS``; else ``JudgeUnavailable``.

    A run is started once the harness, before importing any of the agent's code, has said so over
    the report socket (from the test process's pid): after that, no report is the agent's failure.
    Each try makes the judged copy readable by the test's uid again: anything may have reset an
    ancestor's mode in between (pytest makes its temporary root 0700 when a session starts)."""
    unchecked = [f"{name}: {form}" for name, source in tests.items() for form in unchecked_forms(source, name)]
    if unchecked:  # the task's fault: its tests would decide through code the agent can patch
        raise EnvironmentProblem(f"the judge cannot check these test forms: {'; '.join(unchecked[:3])} "
                                 "(rewrite them with the assertions docs/environments.md lists)")
    reason = ""
    for attempt in range(1, START_ATTEMPTS + 1):
        channel = Path(tempfile.mkdtemp(prefix="stoker-judge-"))  # short: a socket path holds 107 bytes
        try:
            make_readable_by_nobody(judge_dir)
            return _run((judge_dir / "repo").resolve(), (judge_dir / "harness").resolve(), channel, tests, modules, timeout)
        except _NotStarted as exc:
            reason = str(exc)
        except OSError as exc:  # the judge's own trouble (no process, no socket)
            reason = f"the judge could not run the tests: {exc}"
        finally:
            shutil.rmtree(channel, ignore_errors=True)
        log.warning("judged test run did not start (try %d of %d): %s", attempt, START_ATTEMPTS, reason)
    raise JudgeUnavailable(f"the test run did not start ({START_ATTEMPTS} tries): {reason}")


def _run(repo: Path, harness: Path, channel: Path, tests: dict[str, str], modules: list[str], timeout: float) -> Verdict:
    expected = expected_tests(tests, modules)
    socket_path = str(channel / "report")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(8)
    os.chmod(channel, 0o711)  # the test process may connect, never replace the socket
    os.chmod(socket_path, 0o666)
    tmp_bytes = tmp_limit_bytes()
    if isolation() != BUBBLEWRAP and not _warned:
        _warned.append(True)
        log.warning("judged test runs are not confined: %s", describe())
    argv = ["python", "-I", "-S", "-B", str(harness / "harness.py"), "--repo", str(repo), "--socket", socket_path,
            *[f"--test-file={name}" for name in tests], f"--file-limit={tmp_bytes}", "--", *modules]
    try:
        confined = confine(argv, str(repo), [str(repo), str(harness), str(channel)], tmp_bytes)
    except IsolationUnavailable as exc:
        server.close()
        raise EnvironmentProblem(str(exc)) from None
    output: list[bytes] = []
    try:
        process = subprocess.Popen(confined.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **confined.popen)
    finally:
        for fd in confined.popen.get("pass_fds", ()):
            os.close(fd)
    reader = threading.Thread(target=_drain, args=(process.stdout, output), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        tester = _tester_pid(confined.info_fd, process) if isolation() == BUBBLEWRAP else process.pid
        report, foreign, started = _receive(server, process, tester, deadline)
    finally:
        server.close()
    timed_out = report is None and process.poll() is None
    _kill_run(process, tester)
    reader.join(5.0)
    text = b"".join(output).decode(errors="replace")
    if not started:
        ended = f"timed out after {timeout:g} s" if timed_out else f"exit status {process.returncode}"
        raise _NotStarted(f"{ended}; output: {text.strip()[-500:] or '(none)'}")
    notices = tuple((m.group(1).strip(), m.group(2).strip()) for m in NOTICE.finditer(text))
    foreign_attempts = tuple(("forged report", f"a report sent by pid {pid}, not the test process") for pid in foreign)
    if report is None and not timed_out:
        text += f"\n(the test run exited with status {process.returncode} and sent no report)"
    if timed_out:
        return Verdict(problem=f"tests timed out after {timeout:g} s", output=text, tampering=notices + foreign_attempts, expected=expected)
    return _read_report(report, text, notices + foreign_attempts, expected)


def _drain(stream: Any, chunks: list[bytes]) -> None:
    kept = 0
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
        if kept < OUTPUT_LIMIT:
            chunks.append(chunk)
            kept += len(chunk)


def _tester_pid(info_fd: int, process: subprocess.Popen[bytes]) -> int:
    """The test process's pid (outside its namespace), from bwrap's --info-fd JSON."""
    with os.fdopen(info_fd, "rb") as info:
        data = info.read(65536)
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return -1  # bwrap failed before starting it: no report will be accepted


def _receive(server: socket.socket, process: subprocess.Popen[bytes], tester: int, deadline: float) -> tuple[bytes | None, list[int], bool]:
    """(the report from a connection whose peer is ``tester``, pids of any other sender, whether
    the harness said it started first)."""
    foreign: list[int] = []
    started = False
    pidfd = os.pidfd_open(process.pid) if hasattr(os, "pidfd_open") else None
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            waits = [server] + ([pidfd] if pidfd is not None else [])
            ready, _, _ = select.select(waits, [], [], remaining if pidfd is not None else min(remaining, 0.05))
            if server in ready:
                conn, _ = server.accept()
                with conn:
                    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                    if pid != tester:
                        foreign.append(pid)
                        continue
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    data = _read_all(conn)
                    if not started and data == STARTED:
                        started = True
                        continue
                    return data, foreign, started
            elif ready or process.poll() is not None:
                return None, foreign, started
        return None, foreign, started
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _read_all(conn: socket.socket) -> bytes | None:
    chunks, size = [], 0
    try:
        while chunk := conn.recv(65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > REPORT_LIMIT:
                return None
    except OSError:
        return None
    return b"".join(chunks)


def _kill_run(process: subprocess.Popen[bytes], tester: int) -> None:
    """End the run and everything it started (``setsid`` children too)."""
    if process.poll() is None:
        for pid in [*_descendants(process.pid), process.pid]:  # a subreaper's orphans are its descendants
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        if tester > 0:  # bwrap: the namespace's init; its namespace dies with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(tester, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10.0)


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    parents[int(name)] = int(proc_stat(name)[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    for pid in found:  # stop them first: a stopped process cannot fork while we kill the rest
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    return found


def _read_report(report: bytes | None, output: str, tampering: tuple[tuple[str, str], ...], expected: tuple[str, ...]) -> Verdict:
    def verdict(problem: str, **more: Any) -> Verdict:
        if tampering:  # the reason the agent and the user see first
            problem = f"tampering: the code under test tried {', '.join(sorted({kind for kind, _ in tampering}))}"
        return Verdict(problem=problem, output=output, tampering=tampering, expected=expected, **more)

    if not report:
        return verdict("the test run ended without a report (the code under test ended the process)")
    try:
        data = json.loads(report)
        outcomes = {str(test_id): str(kind) for test_id, (kind, _detail) in data["outcomes"].items()}
        details = {str(test_id): str(detail) for test_id, (_kind, detail) in data["outcomes"].items()}
        module_errors = [str(error) for error in data["module_errors"]]
        reported = tuple((str(kind), str(detail)) for kind, detail in data["tampering"])
        checks = [(str(t), json.loads(a), json.loads(b), bool(same)) for t, a, b, same in data["checks"]]
    except (ValueError, KeyError, TypeError):
        return verdict("the test report is malformed")
    # The report lists every refusal the output announced, unless the output was forged to add some.
    tampering = reported + tuple(t for t in tampering if t[0] == "forged report" or t not in reported)
    for test_id, a, b, same in checks:  # plain data, compared again by a process the agent cannot reach
        if (a == b) != same:
            tampering += (("comparison mismatch", f"{test_id}: {a!r} vs {b!r}"),)
    if tampering:
        return verdict("", outcomes=outcomes)
    failing = [f"{test_id}: {details[test_id]}" for test_id, kind in sorted(outcomes.items()) if kind != "passed" and details[test_id]]
    output = "\n".join([output, *module_errors, *failing[:3]]) if module_errors or failing else output
    missing = [test_id for test_id in expected if test_id not in outcomes]
    problem = f"tests never ran: {', '.join(missing[:5])}" if missing and not module_errors else ""
    return Verdict(outcomes=outcomes, output=output, module_errors=len(module_errors), problem=problem,
                   tampering=(), expected=expected)


def junit(verdict: Verdict) -> str:
    """The verdict as junit XML (``report.xml`` beside the judged copy), written by the judge."""
    lines = [
        f"<testsuite name=\"stoker\" tests=\"{len(verdict.outcomes)}\" module-errors=\"{verdict.module_errors}\" "
        f"problem={quoteattr(verdict.problem)} tampering={quoteattr(' '.join(sorted(verdict.tampering_kinds())))}>"
    ]
    for test_id, kind in sorted(verdict.outcomes.items()):
        classname, _, name = test_id.rpartition(".")
        body = "" if kind == "passed" else f"<{kind}/>"
        lines.append(f"<testcase classname={quoteattr(classname)} name={quoteattr(name)}>{body}</testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
