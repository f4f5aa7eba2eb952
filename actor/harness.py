"""The test harness that judges an agent's code: run as a script in a fresh, confined interpreter.

    python -I harness.py --repo DIR --report-fd N MODULE...   (a nonce on stdin)

Standard library only, and started with ``-I`` so nothing from the agent's tree (a
``sitecustomize.py``, a shadowing ``unittest.py``) is imported before the harness has loaded what it
relies on. It reads a nonce from stdin, imports each test module and runs its unittest cases one by
one, then writes a junit-XML report carrying the nonce to the report descriptor, a pipe its parent
reads. The verdict is that report, never this process's exit code or output: code that ends the
process early (``os._exit(0)``, ``sys.exit(0)`` at import) leaves no report, and code that patches
``unittest`` or the harness is caught by comparing every object the harness relies on with a
snapshot taken before the agent's code ran (the report then says ``tampered``).
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
import traceback
import types
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite
import unittest.util
from typing import Any
from xml.sax.saxutils import quoteattr

WATCHED_MODULES: tuple[types.ModuleType, ...] = (
    unittest,
    unittest.case,
    unittest.loader,
    unittest.result,
    unittest.suite,
    unittest.util,
    builtins,
    os,
)


def snapshot(modules: tuple[types.ModuleType, ...]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every attribute of the watched modules and of the classes they define, by identity."""
    taken: dict[tuple[str, str], dict[str, Any]] = {}
    for module in modules:
        taken[(module.__name__, "")] = dict(vars(module))
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                taken[(module.__name__, name)] = dict(vars(value))
    return taken


def changed(before: dict[tuple[str, str], dict[str, Any]], modules: tuple[types.ModuleType, ...]) -> list[str]:
    """Names whose object is no longer the one in ``before`` (added, removed or replaced)."""
    after = snapshot(modules)
    found = []
    for key, attrs in before.items():
        now = after.get(key, {})
        for name in set(attrs) | set(now):
            if attrs.get(name, _MISSING) is not now.get(name, _MISSING):
                found.append(".".join(part for part in (*key, name) if part))
    if sys.modules.get("unittest") is not unittest:
        found.append("sys.modules['unittest']")
    return sorted(found)


_MISSING = object()


class _Result(unittest.TestResult):
    """Collects one outcome per test id: passed, failed, error or skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, tuple[str, str]] = {}

    def addSuccess(self, test: Any) -> None:  # noqa: N802 - unittest's API
        self.outcomes.setdefault(test.id(), ("passed", ""))

    def addFailure(self, test: Any, err: Any) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("failed", _describe(err))

    def addError(self, test: Any, err: Any) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("error", _describe(err))

    def addSkip(self, test: Any, reason: str) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("skipped", reason)

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:  # noqa: N802
        if err is not None:
            kind = "failed" if issubclass(err[0], test.failureException) else "error"
            self.outcomes[test.id()] = (kind, _describe(err))


def _describe(err: Any) -> str:
    return "".join(traceback.format_exception(*err))[-2000:]


def _cases(suite: Any) -> list[Any]:
    found: list[Any] = []
    for item in suite:
        found.extend(_cases(item) if isinstance(item, unittest.suite.TestSuite) else [item])
    return found


def run(modules: list[str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Import and run each module's tests; returns outcomes and module errors (never raises)."""
    result = _Result()
    errors: list[str] = []
    loader = unittest.loader.TestLoader()
    for name in modules:
        try:
            cases = _cases(loader.loadTestsFromName(name))
        except BaseException:  # noqa: BLE001 - SystemExit at import is the agent's code ending the run
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
            continue
        for case in cases:
            try:
                case.run(result)
            except BaseException:  # noqa: BLE001 - a test raising SystemExit past unittest
                result.outcomes[case.id()] = ("error", traceback.format_exc(limit=3))
            if case.id() not in result.outcomes:  # nothing reported: a patched runner swallowed it
                result.outcomes[case.id()] = ("error", "the test reported no outcome")
    return result.outcomes, errors


def junit(nonce: str, outcomes: dict[str, tuple[str, str]], errors: list[str], tampered: list[str]) -> str:
    lines = [
        f"<testsuite name=\"stoker\" nonce={quoteattr(nonce)} tests=\"{len(outcomes)}\" "
        f"tampered={quoteattr(' '.join(tampered))} module-errors=\"{len(errors)}\">"
    ]
    for test_id, (kind, detail) in sorted(outcomes.items()):
        classname, _, name = test_id.rpartition(".")
        body = "" if kind == "passed" else f"<{kind} message={quoteattr(detail[-2000:])}/>"
        lines.append(f"<testcase classname={quoteattr(classname)} name={quoteattr(name)}>{body}</testcase>")
    for error in errors:
        lines.append(f"<system-err>{quoteattr(error[-2000:])}</system-err>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("modules", nargs="+")
    args = parser.parse_args()
    nonce = sys.stdin.readline().strip()
    write, exit_now, report_fd = os.write, os._exit, args.report_fd
    before = snapshot(WATCHED_MODULES)
    harness_before = dict(globals())
    os.chdir(args.repo)
    sys.path.insert(0, args.repo)
    outcomes, errors = run(args.modules)
    tampered = changed(before, WATCHED_MODULES)
    tampered += [f"harness.{n}" for n, v in harness_before.items() if globals().get(n, _MISSING) is not v]
    data = junit(nonce, outcomes, errors, tampered).encode()
    for stream in (sys.stdout, sys.stderr):  # the output is the agent's feedback (never the verdict)
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the agent's code replaced or closed
            pass
    while data:
        data = data[write(report_fd, data) :]
    exit_now(0)  # no atexit hook or lingering thread of the agent's code runs after the report


if __name__ == "__main__":
    main()
