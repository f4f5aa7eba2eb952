"""The rewrite of a judged run's pristine test modules into calls the audit hook decides; stdlib only.

``harness.py`` executes this file into a private module (never in ``sys.modules``) and compiles
every test module with it before any of the agent's code runs; the judge imports it as
``stoker.actor.harness_rewrite`` to refuse, before a run, tests that use a form the hook does not
check (``unchecked_forms``). What the rewrite produces (see docs/environments.md, "Isolation"):

* ``self.assertX(...)``, ``self.fail``, ``self.skipTest`` and ``assert`` become
  ``sys.audit("stoker.assert"|"stoker.skip", ...)``, with ``sys.audit`` held as a code constant;
* ``with self.assertRaises[Regex](...) [as cm]`` becomes a try/except that hands the exception to
  the hook; ``with self.subTest(...)`` a try/except that records a failure and goes on;
  ``with self.assertWarns/assertLogs...`` (and the ``assertWarns(W, f, ...)`` call forms) keep
  unittest's context, made from its class held as a constant, with the hook guarding it;
* every comparison (``f(x) == 3`` inside any expression) is decided by the hook:
  ``(sys.audit("stoker.compare", ops, operands), pop())[1]`` with ``pop`` a method of a list only
  the hook holds;
* builtins the module reads and never binds (``len``, ``sorted``) become constants taken before
  the agent's code ran; each ``test*`` method ends with a "body reached its end" marker.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
import types
import unittest
import unittest._log
import unittest.case
from typing import Any

AUDIT = "__stoker_audit_sentinel_4b1f__"  # a code constant swapped for ``sys.audit`` after compiling
RESULT = "__stoker_result_sentinel_4b1f__"  # swapped for the hook's ``pop`` of comparison results
ALIASES = {
    "assertEquals": "assertEqual", "failUnlessEqual": "assertEqual", "assertNotEquals": "assertNotEqual",
    "failIfEqual": "assertNotEqual", "assert_": "assertTrue", "failUnless": "assertTrue", "failIf": "assertFalse",
    "assertAlmostEquals": "assertAlmostEqual", "failUnlessAlmostEqual": "assertAlmostEqual",
    "assertNotAlmostEquals": "assertNotAlmostEqual", "failIfAlmostEqual": "assertNotAlmostEqual",
    "failUnlessRaises": "assertRaises", "assertRaisesRegexp": "assertRaisesRegex",
    "assertRegexpMatches": "assertRegex", "assertNotRegexpMatches": "assertNotRegex",
}
ASSERTIONS = frozenset({
    "assertEqual", "assertNotEqual", "assertTrue", "assertFalse", "assertIs", "assertIsNot", "assertIsNone",
    "assertIsNotNone", "assertIn", "assertNotIn", "assertIsInstance", "assertNotIsInstance", "assertAlmostEqual",
    "assertNotAlmostEqual", "assertGreater", "assertGreaterEqual", "assertLess", "assertLessEqual",
    "assertListEqual", "assertTupleEqual", "assertDictEqual", "assertSetEqual", "assertSequenceEqual",
    "assertMultiLineEqual", "assertCountEqual", "assertRegex", "assertNotRegex", "fail",
})
# Every TestCase name that decides or skips a test: any left after the rewrite is an unchecked form.
MACHINERY = frozenset(
    n for n in dir(unittest.TestCase) if n.startswith(("assert", "fail")) and n != "failureException"
) | {"skipTest", "subTest", "addTypeEqualityFunc"}
COMPARISONS = {
    ast.Eq: "assertEqual", ast.NotEq: "assertNotEqual", ast.In: "assertIn", ast.NotIn: "assertNotIn",
    ast.Is: "assertIs", ast.IsNot: "assertIsNot", ast.Lt: "assertLess", ast.LtE: "assertLessEqual",
    ast.Gt: "assertGreater", ast.GtE: "assertGreaterEqual",
}
OPERATORS = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
             ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
GUARDED_CONTEXTS: dict[str, tuple[type, bool]] = {
    "assertWarns": (unittest.case._AssertWarnsContext, False),
    "assertWarnsRegex": (unittest.case._AssertWarnsContext, False),
    "assertLogs": (unittest._log._AssertLogsContext, False),
    "assertNoLogs": (unittest._log._AssertLogsContext, True),
}
RESULT_POP: list[Any] = []  # the hook's ``pop``, set by the harness before compiling
# Standard-library modules whose names honest code rebinds (sys.stdout, warnings.filters): never watched.
UNWATCHED = frozenset({"sys", "warnings", "builtins", "__main__", "importlib", "unittest"})


def _audit(*args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Constant(AUDIT), args=list(args), keywords=[])


def _machinery(func: ast.expr) -> str | None:
    """``self.assertEquals`` (any plain name as the receiver) -> ``assertEqual``; else None."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.attr in MACHINERY:
        return ALIASES.get(func.attr, func.attr)
    return None


def _truth(name: str, args: list[ast.expr]) -> tuple[str, list[ast.expr]]:
    """``assertTrue(x == y)`` is ``assertEqual(x, y)`` (and ``assert x in y`` is ``assertIn``)."""
    if name in ("assertTrue", "assertFalse") and len(args) == 1 and isinstance(args[0], ast.Compare):
        compare = args[0]
        mapped = COMPARISONS.get(type(compare.ops[0])) if len(compare.ops) == 1 else None
        if mapped is not None and (name == "assertTrue" or mapped in ("assertEqual", "assertIn", "assertIs")):
            negated = {"assertEqual": "assertNotEqual", "assertIn": "assertNotIn", "assertIs": "assertIsNot"}
            return (mapped if name == "assertTrue" else negated[mapped]), [compare.left, compare.comparators[0]]
    return name, args


def _kwargs(keywords: list[ast.keyword]) -> ast.Dict:
    return ast.Dict(keys=[ast.Constant(k.arg) if k.arg else None for k in keywords], values=[k.value for k in keywords])


def bound_names(tree: ast.AST) -> set[str] | None:
    """Every name the module binds anywhere (None with a star import: then nothing is folded)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            if node.name == "*":
                return None
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def builtin_folds(tree: ast.AST) -> dict[str, Any]:
    """The builtins the module reads and never binds, as they are now (before any agent code)."""
    bound = bound_names(tree)
    if bound is None:
        return {}
    table = vars(builtins)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {n: table[n] for n in read - bound if n in table and not n.startswith("__") and n != "super"}


class _MarkReturns(ast.NodeTransformer):
    """Put the end-of-test marker before each ``return`` of one function (not of nested ones)."""

    def visit_FunctionDef(self, node: Any) -> Any:
        return node

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

    def visit_Return(self, node: ast.Return) -> Any:
        return [ast.Expr(_audit(ast.Constant("stoker.done"))), node]


class Rewrite(ast.NodeTransformer):
    def __init__(self, folds: dict[str, Any] | None = None) -> None:
        self.count = 0
        self.folds = folds or {}
        self.constants: dict[str, Any] = {}  # code constants swapped in after compiling: no patch reaches them

    def const(self, value: Any) -> ast.Constant:
        sentinel = f"__stoker_constant_{len(self.constants)}_4b1f__"
        self.constants[sentinel] = value
        return ast.Constant(sentinel)

    def pattern(self, expr: ast.expr) -> ast.expr:
        """A literal pattern compiled now, before any of the agent's code can reach ``re``."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, (str, bytes)):
            return self.const(re.compile(expr.value))
        return expr

    def assertion(self, name: str, args: list[ast.expr], keywords: list[ast.keyword]) -> ast.Call:
        """``sys.audit("stoker.assert", name, args, kwargs)``, the arguments rewritten too."""
        name, args = _truth(name, args)
        args = [self.visit(a) for a in args]
        keywords = [ast.keyword(k.arg, self.visit(k.value)) for k in keywords]
        return _audit(ast.Constant("stoker.assert"), ast.Constant(name), ast.Tuple(elts=args, ctx=ast.Load()), _kwargs(keywords))

    def visit_Name(self, node: ast.Name) -> Any:
        if isinstance(node.ctx, ast.Load) and node.id in self.folds:
            return ast.copy_location(self.const(self.folds[node.id]), node)
        return node

    def visit_Call(self, node: ast.Call) -> Any:
        name = _machinery(node.func)
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        if name in ASSERTIONS:
            return self.assertion(name, node.args, node.keywords)
        if name == "assertRaises" and (len(node.args) >= 2 or starred):
            return self.assertion(name, node.args, node.keywords)
        if name == "assertRaisesRegex" and (len(node.args) >= 3 or starred):
            args = [node.args[0], self.pattern(node.args[1]), *node.args[2:]] if not starred else node.args
            return self.assertion(name, args, node.keywords)
        if name == "skipTest":
            self.generic_visit(node)
            return _audit(ast.Constant("stoker.skip"), ast.Tuple(node.args, ast.Load()), _kwargs(node.keywords))
        self.generic_visit(node)
        return node

    def visit_Compare(self, node: ast.Compare) -> Any:
        """Any comparison, decided by the hook (``is`` alone cannot be faked and stays)."""
        self.generic_visit(node)
        ops = tuple(OPERATORS[type(op)] for op in node.ops)
        if all(op in ("is", "is not") for op in ops):
            return node
        operators = ast.Constant(ops)  # type: ignore[arg-type]  # a tuple of str is a valid constant
        event = _audit(ast.Constant("stoker.compare"), operators, ast.Tuple([node.left, *node.comparators], ast.Load()))
        pick = ast.Call(func=ast.Constant(RESULT), args=[], keywords=[])
        return ast.Subscript(ast.Tuple([event, pick], ast.Load()), ast.Constant(1), ast.Load())

    def visit_Expr(self, node: ast.Expr) -> Any:
        """The call forms ``self.assertWarns(W, f, *args)`` / ``assertWarnsRegex(W, p, f, ...)``: a guarded with."""
        call = node.value
        name = _machinery(call.func) if isinstance(call, ast.Call) else None
        if name in ("assertWarns", "assertWarnsRegex") and isinstance(call, ast.Call):
            n = 1 if name == "assertWarns" else 2
            if len(call.args) > n and not any(isinstance(a, ast.Starred) for a in call.args[: n + 1]):
                context = ast.Call(func=call.func, args=call.args[:n], keywords=[])
                body = ast.Expr(ast.Call(func=call.args[n], args=call.args[n + 1:], keywords=call.keywords))
                return self.visit_With(ast.copy_location(ast.With(items=[ast.withitem(context, None)], body=[body]), node))
        self.generic_visit(node)
        return node

    def visit_With(self, node: ast.With) -> Any:
        """``with self.assertRaises/Warns/Logs...(...)`` and ``self.subTest(...)``, decided by the hook."""
        self.generic_visit(node)
        if len(node.items) != 1:
            return node
        call, bound = node.items[0].context_expr, node.items[0].optional_vars
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "self" and (bound is None or isinstance(bound, ast.Name))):
            return node
        name, args = ALIASES.get(call.func.attr, call.func.attr), call.args
        keywords = [k for k in call.keywords if k.arg != "msg"]
        if name in ("assertRaises", "assertRaisesRegex") and len(args) == (1 if name == "assertRaises" else 2) and not keywords:
            return self._raises(node, args[0], self.pattern(args[1]) if len(args) == 2 else ast.Constant(None), bound)
        if name in GUARDED_CONTEXTS and not any(isinstance(a, ast.Starred) for a in args) and all(k.arg for k in keywords):
            return self._guarded(node, name, args, keywords, bound)
        if name == "subTest" and bound is None:
            return self._subtest(node, call)
        return node

    @staticmethod
    def _subtest(node: ast.With, call: ast.Call) -> ast.Try:
        """A failure inside is recorded by the hook and the test goes on (unittest's own is never used)."""
        raised = ast.Name("stoker_subtest_", ast.Load())
        record = ast.Expr(_audit(ast.Constant("stoker.subtest"), raised, ast.Tuple(call.args, ast.Load()), _kwargs(call.keywords)))
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name="stoker_subtest_", body=[record])
        return ast.Try(body=node.body, handlers=[handler], orelse=[], finalbody=[])

    def _raises(self, node: ast.With, expected: ast.expr, pattern: ast.expr, bound: ast.Name | None) -> ast.Try:
        """try/except whose handler tells the hook what was raised; ``cm.exception`` from a builtin namespace."""
        raised = ast.Name("stoker_raised_", ast.Load())
        body: list[ast.stmt] = [ast.Expr(_audit(ast.Constant("stoker.raised"), expected, raised, pattern))]
        if bound is not None:
            namespace = ast.Call(func=self.const(types.SimpleNamespace), args=[], keywords=[
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
            ctor_args = [args[0], me, *([self.pattern(args[1])] if name == "assertWarnsRegex" and len(args) > 1 else [])]
        else:  # _AssertLogsContext(test_case, logger_name, level, no_logs)
            named = {k.arg: k.value for k in keywords}
            if len(args) > 2 or set(named) - {"logger", "level"}:
                return [node]
            given = [*args, *([ast.Constant(None)] * (2 - len(args)))]
            ctor_args = [me, named.get("logger", given[0]), named.get("level", given[1]), ast.Constant(made)]
        guard = ast.Expr(_audit(ast.Constant("stoker.guard"), ast.Name(ctx, ast.Load())))
        load = ast.Name(ctx, ast.Load())
        make = ast.Assign([ast.Name(ctx, ast.Store())], ast.Call(self.const(cls), ctor_args, []))
        enter = ast.Call(ast.Attribute(self.const(cls), "__enter__", ast.Load()), [load], [])
        entered: ast.stmt = ast.Assign([ast.Name(bound.id, ast.Store())], enter) if bound else ast.Expr(enter)
        exc = ast.Name("stoker_exc_", ast.Load())
        exit_with = ast.Call(ast.Attribute(self.const(cls), "__exit__", ast.Load()),
                             [load, ast.Call(self.const(type), [exc], []), exc, ast.Attribute(exc, "__traceback__", ast.Load())], [])
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name="stoker_exc_", body=[
            guard, ast.If(test=ast.UnaryOp(ast.Not(), exit_with), body=[ast.Raise()], orelse=[])])
        exit_clean = ast.Expr(ast.Call(ast.Attribute(self.const(cls), "__exit__", ast.Load()),
                                       [load, ast.Constant(None), ast.Constant(None), ast.Constant(None)], []))
        return [make, guard, entered, ast.Try(body=node.body, handlers=[handler], orelse=[guard, exit_clean], finalbody=[]), guard]

    def visit_Assert(self, node: ast.Assert) -> Any:
        keywords = [ast.keyword(arg="msg", value=node.msg)] if node.msg is not None else []
        return ast.copy_location(ast.Expr(self.assertion("assertTrue", [node.test], keywords)), node)

    def visit_FunctionDef(self, node: Any) -> Any:
        self.generic_visit(node)
        if node.name.startswith("test"):
            body = [_MarkReturns().visit(statement) for statement in node.body]
            flat = [s for item in body for s in (item if isinstance(item, list) else [item])]
            node.body = [*flat, ast.Expr(_audit(ast.Constant("stoker.done")))]
        return node


def unchecked(tree: ast.AST) -> list[str]:
    """The test machinery a rewritten tree still uses (``self.assertWarns (line 12)``)."""
    return sorted({f"{ast.unparse(n)} (line {n.lineno})" for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr in MACHINERY and hasattr(n, "lineno")})


@functools.lru_cache(maxsize=256)  # the judge asks again at every run of the same tests
def unchecked_forms(source: str, filename: str) -> tuple[str, ...]:
    """For the judge, before a run: the forms of ``source`` the hook would not decide."""
    try:
        tree = Rewrite().visit(ast.parse(source, filename))
    except SyntaxError:
        return ()  # reported by the run as the module's import error
    return tuple(unchecked(tree))


def _swap(value: Any, constants: dict[str, Any]) -> Any:
    if type(value) is str:
        if value == AUDIT:
            return sys.audit
        if value == RESULT:
            return RESULT_POP[0]
        return constants.get(value, value)
    if type(value) in (tuple, frozenset):  # the optimizer folds constant tuples and sets
        return type(value)(_swap(v, constants) for v in value)
    if isinstance(value, types.CodeType):
        return value.replace(co_consts=tuple(_swap(c, constants) for c in value.co_consts))
    return value


def compile_rewritten(source: str, path: str) -> types.CodeType:
    """A pristine test module compiled with its assertions, comparisons and builtins rewritten."""
    import warnings

    tree = ast.parse(source, path)
    rewrite = Rewrite(builtin_folds(tree))
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "'str' object is not callable": the constants swapped below
        code = compile(tree, path, "exec")
    swapped = _swap(code, rewrite.constants)
    assert isinstance(swapped, types.CodeType)
    return swapped


def stdlib_imports(test_files: list[str], repo: str) -> tuple[types.ModuleType, ...]:
    """The standard-library modules the tests import, imported now (before any agent code) to be
    watched; none when a test uses ``mock``, whose patches of them are the test's own."""
    names: set[str] = set()
    for path in test_files:
        try:
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
    if any(name == "mock" or name.startswith(("unittest.mock", "mock.")) for name in names):
        return ()
    stdlib = sysconfig.get_paths()["stdlib"].rstrip("/") + "/"
    found = []
    for name in sorted(names):
        top = name.split(".")[0]
        if top in UNWATCHED or os.path.exists(os.path.join(repo, top)) or os.path.exists(os.path.join(repo, top + ".py")):
            continue  # the agent's own module of that name would win on the path
        try:
            spec = importlib.util.find_spec(name)
            origin = (spec.origin or "") if spec is not None else ""
            if origin.startswith(stdlib) and "-packages/" not in origin:
                found.append(importlib.import_module(name))
        except (ImportError, ValueError):
            continue
    return tuple(found)
