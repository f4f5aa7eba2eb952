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
import ast  # noqa: E402
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

AUDIT = "__stoker_audit_sentinel_4b1f__"  # a code constant swapped for ``sys.audit`` after compiling
ASSERTIONS = frozenset({
    "assertEqual", "assertNotEqual", "assertTrue", "assertFalse", "assertIs", "assertIsNot", "assertIsNone",
    "assertIsNotNone", "assertIn", "assertNotIn", "assertIsInstance", "assertNotIsInstance", "assertAlmostEqual",
    "assertNotAlmostEqual", "assertGreater", "assertGreaterEqual", "assertLess", "assertLessEqual",
    "assertListEqual", "assertTupleEqual", "assertDictEqual", "assertSetEqual", "assertSequenceEqual",
    "assertMultiLineEqual",
})
COMPARISONS = {
    ast.Eq: "assertEqual", ast.NotEq: "assertNotEqual", ast.In: "assertIn", ast.NotIn: "assertNotIn",
    ast.Is: "assertIs", ast.IsNot: "assertIsNot", ast.Lt: "assertLess", ast.LtE: "assertLessEqual",
    ast.Gt: "assertGreater", ast.GtE: "assertGreaterEqual",
}
WATCHED_MODULES: tuple[types.ModuleType, ...] = (
    unittest, unittest.case, unittest.loader, unittest.result, unittest.suite, unittest.util, builtins, os,
)


GUARDED_CONTEXTS: dict[str, tuple[type, bool]] = {
    "assertWarns": (unittest.case._AssertWarnsContext, False),
    "assertWarnsRegex": (unittest.case._AssertWarnsContext, False),
    "assertLogs": (unittest._log._AssertLogsContext, False),
    "assertNoLogs": (unittest._log._AssertLogsContext, True),
}
# What a guarded context's __enter__/__exit__ run through: checked unchanged by identity and code at each.
GUARDED_STATE: tuple[Any, ...] = (
    unittest.case, unittest._log, unittest.case.TestCase, unittest.case._BaseTestCaseContext,
    unittest.case._AssertRaisesBaseContext, unittest.case._AssertWarnsContext, unittest._log._AssertLogsContext,
    getattr(unittest._log, "_CapturingHandler"), warnings.catch_warnings, re,
    sys.modules["re._compiler"], sys.modules["re._parser"], builtins,
)
CONSTANTS: dict[str, Any] = {}  # code constants swapped in after compiling: objects no patch can replace


def _const(value: Any) -> ast.Constant:
    sentinel = f"__stoker_constant_{len(CONSTANTS)}_4b1f__"
    CONSTANTS[sentinel] = value
    return ast.Constant(sentinel)


def _pattern(expr: ast.expr) -> ast.expr:
    """A literal pattern compiled now, before any of the agent's code can reach ``re``."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, (str, bytes)):
        return _const(re.compile(expr.value))
    return expr


def _audit(*args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Constant(AUDIT), args=list(args), keywords=[])


def _assertion(name: str, args: list[ast.expr], keywords: list[ast.keyword]) -> ast.Call:
    """``sys.audit("stoker.assert", name, args, kwargs)``; ``x == y`` tested as truth is assertEqual."""
    if name in ("assertTrue", "assertFalse") and len(args) == 1 and isinstance(args[0], ast.Compare):
        compare = args[0]
        mapped = COMPARISONS.get(type(compare.ops[0])) if len(compare.ops) == 1 else None
        if mapped is not None and (name == "assertTrue" or mapped in ("assertEqual", "assertIn", "assertIs")):
            negated = {"assertEqual": "assertNotEqual", "assertIn": "assertNotIn", "assertIs": "assertIsNot"}
            name = mapped if name == "assertTrue" else negated[mapped]
            args = [compare.left, compare.comparators[0]]
    kwargs = ast.Dict(keys=[ast.Constant(k.arg) if k.arg else None for k in keywords], values=[k.value for k in keywords])
    return _audit(ast.Constant("stoker.assert"), ast.Constant(name), ast.Tuple(elts=args, ctx=ast.Load()), kwargs)


class _MarkReturns(ast.NodeTransformer):
    """Put the end-of-test marker before each ``return`` of one function (not of nested ones)."""

    def visit_FunctionDef(self, node: Any) -> Any:
        return node

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

    def visit_Return(self, node: ast.Return) -> Any:
        return [ast.Expr(_audit(ast.Constant("stoker.done"))), node]


class _Rewrite(ast.NodeTransformer):
    def __init__(self) -> None:
        self.count = 0

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            if func.attr in ASSERTIONS or (func.attr == "assertRaises" and len(node.args) >= 2):
                return _assertion(func.attr, node.args, node.keywords)
            if func.attr == "assertRaisesRegex" and len(node.args) >= 3:
                return _assertion(func.attr, [node.args[0], _pattern(node.args[1]), *node.args[2:]], node.keywords)
        return node

    def visit_With(self, node: ast.With) -> Any:
        """``with self.assertRaises/Warns/Logs...(...) [as cm]: body``, decided by the hook (see below)."""
        self.generic_visit(node)
        if len(node.items) != 1:
            return node
        call, bound = node.items[0].context_expr, node.items[0].optional_vars
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "self" and (bound is None or isinstance(bound, ast.Name))):
            return node
        name, args = call.func.attr, call.args
        keywords = [k for k in call.keywords if k.arg != "msg"]
        if name in ("assertRaises", "assertRaisesRegex") and len(args) == (1 if name == "assertRaises" else 2) and not keywords:
            return self._raises(node, args[0], _pattern(args[1]) if len(args) == 2 else ast.Constant(None), bound)
        if name in GUARDED_CONTEXTS and not any(isinstance(a, ast.Starred) for a in args) and all(k.arg for k in keywords):
            return self._guarded(node, name, args, keywords, bound)
        return node

    @staticmethod
    def _raises(node: ast.With, expected: ast.expr, pattern: ast.expr, bound: ast.Name | None) -> ast.Try:
        """try/except whose handler tells the hook what was raised; ``cm.exception`` from a builtin namespace."""
        raised = ast.Name("stoker_raised_", ast.Load())
        body: list[ast.stmt] = [ast.Expr(_audit(ast.Constant("stoker.raised"), expected, raised, pattern))]
        if bound is not None:
            namespace = ast.Call(func=_const(types.SimpleNamespace), args=[], keywords=[
                ast.keyword("exception", raised), ast.keyword("expected", expected)])
            body.append(ast.Assign(targets=[ast.Name(bound.id, ast.Store())], value=namespace))
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name="stoker_raised_", body=body)
        not_raised = _audit(ast.Constant("stoker.assert"), ast.Constant("fail"), ast.Tuple([ast.Constant("no exception raised")], ast.Load()), ast.Dict([], []))
        return ast.Try(body=node.body, handlers=[handler], orelse=[ast.Expr(not_raised)], finalbody=[])

    def _guarded(self, node: ast.With, name: str, args: list[ast.expr], keywords: list[ast.keyword], bound: ast.Name | None) -> list[ast.stmt]:
        """unittest's own context, made from classes held as constants, with the hook checking before
        ``__enter__`` and ``__exit__`` that unittest, ``warnings``, ``re`` and the builtins are as loaded."""
        self.count += 1
        ctx = f"stoker_ctx_{self.count}_"
        cls, made = GUARDED_CONTEXTS[name]
        me = ast.Name("self", ast.Load())
        if name in ("assertWarns", "assertWarnsRegex"):
            if not args or len(args) > 2 or keywords:
                return [node]
            ctor_args = [args[0], me, *([_pattern(args[1])] if name == "assertWarnsRegex" and len(args) > 1 else [])]
        else:  # _AssertLogsContext(test_case, logger_name, level, no_logs)
            named = {k.arg: k.value for k in keywords}
            if len(args) > 2 or set(named) - {"logger", "level"}:
                return [node]
            given = [*args, *([ast.Constant(None)] * (2 - len(args)))]
            ctor_args = [me, named.get("logger", given[0]), named.get("level", given[1]), ast.Constant(made)]
        guard = ast.Expr(_audit(ast.Constant("stoker.guard"), ast.Name(ctx, ast.Load())))
        load = ast.Name(ctx, ast.Load())
        make = ast.Assign([ast.Name(ctx, ast.Store())], ast.Call(_const(cls), ctor_args, []))
        enter = ast.Call(ast.Attribute(_const(cls), "__enter__", ast.Load()), [load], [])
        entered: ast.stmt = ast.Assign([ast.Name(bound.id, ast.Store())], enter) if bound else ast.Expr(enter)
        exc = ast.Name("stoker_exc_", ast.Load())
        exit_with = ast.Call(ast.Attribute(_const(cls), "__exit__", ast.Load()),
                             [load, ast.Call(_const(type), [exc], []), exc, ast.Attribute(exc, "__traceback__", ast.Load())], [])
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name="stoker_exc_", body=[
            guard, ast.If(test=ast.UnaryOp(ast.Not(), exit_with), body=[ast.Raise()], orelse=[])])
        exit_clean = ast.Expr(ast.Call(ast.Attribute(_const(cls), "__exit__", ast.Load()),
                                       [load, ast.Constant(None), ast.Constant(None), ast.Constant(None)], []))
        return [make, guard, entered, ast.Try(body=node.body, handlers=[handler], orelse=[guard, exit_clean], finalbody=[]), guard]

    def visit_Assert(self, node: ast.Assert) -> Any:
        self.generic_visit(node)
        keywords = [ast.keyword(arg="msg", value=node.msg)] if node.msg is not None else []
        return ast.Expr(_assertion("assertTrue", [node.test], keywords))

    def visit_FunctionDef(self, node: Any) -> Any:
        self.generic_visit(node)
        if node.name.startswith("test"):
            body = [_MarkReturns().visit(statement) for statement in node.body]
            flat = [s for item in body for s in (item if isinstance(item, list) else [item])]
            node.body = [*flat, ast.Expr(_audit(ast.Constant("stoker.done")))]
        return node


def _with_audit(code: types.CodeType) -> types.CodeType:
    consts = tuple(
        sys.audit if type(c) is str and c == AUDIT else CONSTANTS[c] if type(c) is str and c in CONSTANTS else _with_audit(c) if isinstance(c, types.CodeType) else c
        for c in code.co_consts
    )
    return code.replace(co_consts=consts)


def _trust(code: types.CodeType, module: str) -> None:
    sys.audit("stoker.trust", code, module)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _trust(const, module)


def compile_test_module(name: str, path: str) -> types.CodeType:
    """A pristine test module with its assertions rewritten; all are compiled before any agent code runs."""
    source = open(path, encoding="utf-8").read()
    tree = ast.fix_missing_locations(_Rewrite().visit(ast.parse(source, path)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "'str' object is not callable": the constant swapped below
        code = _with_audit(compile(tree, path, "exec"))
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


def _arm(args: argparse.Namespace, test_files: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    tamper_file = os.path.join(here, "tamper.py")
    paths = sysconfig.get_paths()
    prefixes = {os.path.dirname(os.__file__), paths["stdlib"], paths["platstdlib"]}
    prefixes |= {os.path.realpath(p) for p in prefixes}
    open_fds = frozenset(fd for fd in range(3, 256) if _is_open(fd))
    namespace: dict[str, Any] = {"__builtins__": dict(vars(builtins)), "__name__": "stoker_tamper"}
    with open(tamper_file, encoding="utf-8") as handle:
        exec(compile(handle.read(), tamper_file, "exec"), namespace)
    namespace["install"](
        repo=os.path.realpath(args.repo),
        trusted_prefixes=tuple(p.rstrip("/") + "/" for p in prefixes),
        trusted_files=frozenset([*test_files, os.path.abspath(__file__), tamper_file]),
        harness_file=os.path.abspath(__file__),
        socket_path=args.socket,
        reporter=[sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--send"],
        protected_fds=open_fds,
        guarded=GUARDED_STATE,
    )
    del namespace  # from here on only the hook refers to its globals and state


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def run(modules: list[str], test_files: dict[str, str]) -> list[str]:
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
    for name, code in compiled.items():
        try:
            load_test_module(name, test_files[name], code)
        except BaseException:  # noqa: BLE001 - SystemExit at import is the agent's code ending the run
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
    loader = unittest.loader.TestLoader()
    for name in modules:
        try:
            cases = _cases(load_tests(loader, name))
        except BaseException:  # noqa: BLE001
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")
            continue
        for case in cases:
            test_id = case.id()
            sys.audit("stoker.begin", test_id)
            try:
                case.run(result)
            except BaseException:  # noqa: BLE001 - a test raising SystemExit past unittest
                result.outcomes[test_id] = ("error", traceback.format_exc(limit=3))
            kind, detail = result.outcomes.get(test_id, ("error", "the test reported no outcome"))
            sys.audit("stoker.end", test_id, kind, detail)
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
    _arm(args, list(test_files.values()))
    before = snapshot(WATCHED_MODULES)
    os.chdir(repo)
    sys.path.insert(0, repo)
    errors = run(args.modules, test_files)
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
