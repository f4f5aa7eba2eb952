"""How the audit hook ends a judged run: every other process killed, the report assembled; stdlib only.

Executed by the harness into the hook's private namespace, beside ``tamper.py``, whose ``finish``
then ``execve``s the fresh interpreter that sends ``build_report``'s JSON to the judge.
"""

from __future__ import annotations

import os
import signal
from typing import Any

ARG_LIMIT = 100_000  # bytes of report carried through execve (one argv string may hold 128 KiB)


def kill_others(getpid: Any, kill: Any, waitpid: Any, listdir: Any) -> None:
    """Every other process of the run: the whole pid namespace as its init, else our descendants.

    The functions are the ones taken when the hook was installed (the agent may have replaced os's)."""
    for _ in range(50):
        if getpid() == 1:
            try:
                kill(-1, signal.SIGKILL)
            except OSError:
                pass
        else:
            for pid in descendants(getpid, listdir):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        try:
            while waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            if getpid() == 1 or not descendants(getpid, listdir):
                return


def descendants(getpid: Any, listdir: Any) -> list[int]:
    me, parents = getpid(), {}
    try:
        for name in listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as handle:
                        parents[int(name)] = int(handle.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
    except OSError:
        return []
    found, frontier = [], [me]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def build_report(tests: dict[str, dict[str, Any]], attempts: list[tuple[str, str]], checks: list[tuple[str, Any, Any, bool]],
                 module_errors: list[str], dumps: Any) -> str:
    """The hook's outcomes as JSON (under ``ARG_LIMIT``): a test passed only if unittest said so, its
    body reached its end, no assertion failed and it was not skipped."""
    outcomes: dict[str, list[str]] = {}
    for test_id, record in tests.items():
        kind, detail = record.get("kind", "error"), record.get("detail", "")
        if record["failures"]:
            kind, detail = "failed", "; ".join(record["failures"])[:2000]
        elif "skipped" in record:  # skipTest, whatever unittest was made to say
            kind, detail = "skipped", record["skipped"]
        elif kind == "passed" and not record["done"]:
            kind, detail = "error", "the test body did not run to its end under the harness"
        outcomes[test_id] = [kind, str(detail)[-2000:]]
    report: dict[str, Any] = {"outcomes": outcomes, "module_errors": [e[-2000:] for e in module_errors],
                              "tampering": attempts[:50], "checks": []}
    for test_id, a, b, same in checks:
        try:
            report["checks"].append([test_id, dumps(a), dumps(b), same])
        except (TypeError, ValueError):
            continue
    data: str = dumps(report)
    while len(data.encode()) > ARG_LIMIT and (report["checks"] or report["module_errors"] or outcomes):
        report["checks"] = report["checks"][: len(report["checks"]) // 2]
        for entry in outcomes.values():
            entry[1] = entry[1][:200]
        report["module_errors"] = [e[:200] for e in report["module_errors"]]
        data = dumps(report)
        if not report["checks"] and len(data.encode()) > ARG_LIMIT:
            report["module_errors"], report["outcomes"] = ["the report is too large"], {}
            data = dumps(report)
            break
    return data
