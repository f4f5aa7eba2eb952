"""The test process of a judged run: imports the agent's code, runs the pristine tests; stdlib only.

    python -I -S -B harness.py --repo DIR --socket PATH --test-file F ... -- MODULE...
    python -I -S -B harness.py --send PATH REPORT        (the fresh interpreter that reports)

This process holds no nonce and no report descriptor: the judge (``stoker.actor.judge``), a process
the agent's code cannot reach, writes the verdict. Before any agent code runs it makes itself
non-dumpable (no ``ptrace`` or ``/proc/PID/mem`` from the agent's own processes), installs the audit
hook of ``tamper.py`` from a private namespace, and loads each pristine test module with its
assertions rewritten to call the hook (``sys.audit`` held as a code constant, so no patch of a
module or class reaches them). The harness then runs the tests with ``unittest`` and tells the
hook where each begins and ends; the hook decides the outcomes, kills every other process of the
run and ``execve``s the ``--send`` interpreter, which connects to the judge's socket and sends them.
"""

from __future__ import annotations

import sys


def send(path: str, report: str) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(path)
        channel.sendall(report.encode())


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--send":
    send(sys.argv[2], sys.argv[3])
    sys.exit(0)

import argparse  # noqa: E402 - the reporter above must start with nothing loaded
import builtins  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import sysconfig  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import unittest  # noqa: E402
import unittest._log  # noqa: E402
import unittest.case  # noqa: E402
import unittest.loader  # noqa: E402
import unittest.result  # noqa: E402
import unittest.suite  # noqa: E402
import unittest.util  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

WATCHED_MODULES: tuple[types.ModuleType, ...] = (
    unittest, unittest.case, unittest.loader, unittest.result, unittest.suite, unittest.util, builtins, os,
)
# What a guarded context's __enter__/__exit__ run through: checked unchanged by identity and code at each.
GUARDED_STATE: tuple[Any, ...] = (
    unittest.case, unittest._log, unittest.case.TestCase, unittest.case._BaseTestCaseContext,
    unittest.case._AssertRaisesBaseContext, unittest.case._AssertWarnsContext, unittest._log._AssertLogsContext,
    getattr(unittest._log, "_CapturingHandler"), warnings.catch_warnings, re,
    sys.modules["re._compiler"], sys.modules["re._parser"], builtins,
)
STARTED = b"stoker-started\n"  # sent to the judge before any of the agent's code is imported
HERE = os.path.dirname(os.path.abspath(__file__))
HOOK_FILES = ("tamper_checks.py", "tamper_state.py", "tamper_report.py", "tamper.py")  # one private namespace


def _private(filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute a file beside this one into ``namespace`` (never in ``sys.modules``)."""
    path = os.path.join(HERE, filename)
    with open(path, encoding="utf-8") as handle:
        exec(compile(handle.read(), path, "exec"), namespace)
    return namespace


REWRITE = _private("harness_rewrite.py", {"__name__": "stoker_rewrite", "__builtins__": builtins})


def _trust(code: types.CodeType, module: str) -> None:
    sys.audit("stoker.trust", code, module)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _trust(const, module)


def compile_test_module(name: str, path: str) -> types.CodeType:
    """A pristine test module rewritten (see harness_rewrite.py); all are compiled before any agent code runs."""
    with open(path, encoding="utf-8") as handle:
        code: types.CodeType = REWRITE["compile_rewritten"](handle.read(), path)
    _trust(code, name)
    return code


def load_test_module(name: str, path: str, code: types.CodeType) -> None:
    """Import a compiled test module (its imports run the agent's code)."""
    parent = name.rpartition(".")[0]
    if parent:
        importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    sys.modules[name] = module  # whatever the agent's code, imported by it, put there
    if parent:
        setattr(sys.modules[parent], name.rpartition(".")[2], module)
    LOADED[name] = module
    sys.audit("stoker.loaded", name, module.__dict__)  # its globals, checked from here on


LOADED: dict[str, types.ModuleType] = {}
PRISTINE: set[str] = set()


def load_tests(loader: unittest.loader.TestLoader, entry: str) -> Any:
    """Tests for a module name or test id, resolved from the pristine modules the harness loaded."""
    parts = entry.split(".")
    for cut in range(len(parts), 0, -1):
        module = LOADED.get(".".join(parts[:cut]))
        if module is None:
            continue
        target: Any = module
        for part in parts[cut:]:
            target = getattr(target, part)
        if isinstance(target, types.ModuleType):
            return loader.loadTestsFromModule(target)
        if isinstance(target, type):
            return loader.loadTestsFromTestCase(target)
        return loader.loadTestsFromName(parts[-1], getattr(module, parts[cut]) if len(parts) - cut == 2 else module)
    if any(".".join(parts[:cut]) in PRISTINE for cut in range(1, len(parts) + 1)):
        raise ImportError(f"{entry}: its test module did not import")  # reported once, at its load
    return loader.loadTestsFromName(entry)


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
    """unittest's view of one test (the hook's assertions and end marker decide with it)."""

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


def _prctl(option: int, value: int) -> None:
    """PR_SET_DUMPABLE / PR_SET_CHILD_SUBREAPER, before the audit hook refuses ctypes."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError, ImportError):
        pass


def _leave_root(uid: int) -> None:
    """The fallback started by root: a network namespace of our own (loopback down), then ``uid``."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
        sys.stderr.write(f"stoker: the test process keeps the host network (unshare: errno {ctypes.get_errno()})\n")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _arm(args: argparse.Namespace, test_files: list[str], watched: tuple[types.ModuleType, ...]) -> None:
    paths = sysconfig.get_paths()
    prefixes = {os.path.dirname(os.__file__), paths["stdlib"], paths["platstdlib"]}
    prefixes |= {os.path.realpath(p) for p in prefixes}
    open_fds = frozenset(fd for fd in range(3, 256) if _is_open(fd))
    namespace: dict[str, Any] = {"__builtins__": dict(vars(builtins)), "__name__": "stoker_tamper"}
    for name in HOOK_FILES:
        _private(name, namespace)
    REWRITE["RESULT_POP"].append(namespace["install"](
        repo=os.path.realpath(args.repo),
        trusted_prefixes=tuple(p.rstrip("/") + "/" for p in prefixes),
        trusted_files=frozenset([*test_files, os.path.abspath(__file__),
                                 *(os.path.join(HERE, name) for name in (*HOOK_FILES, "harness_rewrite.py"))]),
        harness_file=os.path.abspath(__file__),
        socket_path=args.socket,
        reporter=[sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--send"],
        protected_fds=open_fds,
        guarded=GUARDED_STATE,
        watched=watched,
    ))
    del namespace  # from here on only the hook refers to its globals and state


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _run_cases(cases: list[Any], result: _Result) -> None:
    """Each test between the hook's begin and end, with unittest's class and module fixtures."""
    modules_done: dict[str, str] = {}  # module -> why its setUpModule failed ("" when it ran)
    classes: list[tuple[Any, list[Any]]] = []
    for case in cases:  # consecutive cases of one class share its setUpClass
        if classes and classes[-1][0] is type(case):
            classes[-1][1].append(case)
        else:
            classes.append((type(case), [case]))
    for cls, group in classes:
        module = LOADED.get(cls.__module__)
        if module is not None and cls.__module__ not in modules_done:
            modules_done[cls.__module__] = _fixture(getattr(module, "setUpModule", None), "setUpModule")
        problem = modules_done.get(cls.__module__, "")
        skipped = getattr(cls, "__unittest_skip__", False)
        if not problem and not skipped:
            problem = _fixture(cls.setUpClass, "setUpClass")
        for case in group:
            test_id = case.id()
            sys.audit("stoker.begin", test_id)
            if problem:
                result.outcomes[test_id] = ("skipped" if problem.startswith("skipped") else "error", problem)
            else:
                try:
                    case.run(result)
                except BaseException:  # noqa: BLE001 - a test raising SystemExit past unittest
                    result.outcomes[test_id] = ("error", traceback.format_exc(limit=3))
            kind, detail = result.outcomes.get(test_id, ("error", "the test reported no outcome"))
            sys.audit("stoker.end", test_id, kind, detail)
        if not problem and not skipped:
            _fixture(cls.tearDownClass, "tearDownClass")
            _fixture(cls.doClassCleanups, "doClassCleanups")
    for name in modules_done:
        _fixture(getattr(LOADED[name], "tearDownModule", None), "tearDownModule")


def _fixture(function: Any, name: str) -> str:
    if function is None:
        return ""
    try:
        function()
    except unittest.SkipTest as exc:
        return f"skipped in {name}: {exc}"
    except BaseException:  # noqa: BLE001 - the fixture's failure is its tests' error
        return f"{name} failed: {traceback.format_exc(limit=3)}"
    return ""


def _started(path: str) -> None:
    """Tell the judge this run got as far as the agent's code: from here on a missing report is the
    agent's doing, before it the sandbox's (retried by the judge)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(path)
        channel.sendall(STARTED)


def run(modules: list[str], test_files: dict[str, str], socket_path: str) -> list[str]:
    """Load and run the tests, telling the hook where each begins and ends; returns module errors."""
    result = _Result()
    errors: list[str] = []
    PRISTINE.update(test_files)
    compiled: dict[str, types.CodeType] = {}
    for name, path in test_files.items():
        try:
            compiled[name] = compile_test_module(name, path)
        except SyntaxError:
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
    REWRITE["RESULT_POP"].clear()  # the hook's pop is held by the compiled code only
    _started(socket_path)
    for name, code in compiled.items():
        try:
            load_test_module(name, test_files[name], code)
        except BaseException:  # noqa: BLE001 - SystemExit at import is the agent's code ending the run
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
    loader = unittest.loader.TestLoader()
    cases: list[Any] = []
    for name in modules:
        try:
            cases += _cases(load_tests(loader, name))
        except BaseException:  # noqa: BLE001
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
    _run_cases(cases, result)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--test-file", action="append", default=[])
    parser.add_argument("--file-limit", type=int, default=0, help="RLIMIT_FSIZE in bytes (0: unchanged)")
    parser.add_argument("--drop-to", type=int, default=0, help="uid to become after leaving the network (fallback as root)")
    parser.add_argument("modules", nargs="+")
    args = parser.parse_args()
    exit_now = os._exit
    repo = os.path.realpath(args.repo)
    test_files = {f.removesuffix(".py").replace("/", "."): os.path.join(repo, f) for f in args.test_file}
    if args.file_limit > 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_limit, args.file_limit))
    if args.drop_to and os.getuid() == 0:
        _leave_root(args.drop_to)
    _prctl(4, 0)  # PR_SET_DUMPABLE: the agent's processes cannot ptrace or read this one
    if os.getpid() != 1:
        _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the agent's processes stay ours to kill
    watched = REWRITE["stdlib_imports"](list(test_files.values()), repo)
    _arm(args, list(test_files.values()), watched)
    before = snapshot(WATCHED_MODULES)
    os.chdir(repo)
    sys.path.insert(0, repo)
    errors = run(args.modules, test_files, args.socket)
    for name in changed(before, WATCHED_MODULES):
        sys.audit("stoker.tampered", name)
    for stream in (sys.stdout, sys.stderr):  # the output is the agent's feedback (never the verdict)
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the agent's code replaced or closed
            pass
    try:
        sys.audit("stoker.final", errors)  # never returns: the hook execs the reporter
    finally:
        exit_now(3)


if __name__ == "__main__":
    main()
