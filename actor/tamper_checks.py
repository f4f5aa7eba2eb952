"""How the audit hook decides an assertion or a comparison; standard library only.

Executed by the harness into the hook's private namespace, beside ``tamper.py`` (whose ``install``
calls ``make_checks``). Builtin values are compared as plain data (and those JSON carries
unchanged are recorded for the judge to compare again); for any other value the hook asks
``x == y`` and then probes ``x == <a value it cannot equal>``: true means "always-equal value",
tampering. An assertion's arguments are bound to unittest's own signature (``msg=`` and the other
keywords as in ``unittest``).
"""

from __future__ import annotations

import math
from typing import Any

# unittest's parameter names; the optional ones (msg, places, delta, seq_type) default to None.
SIGNATURES: dict[str, tuple[str, ...]] = {
    **{n: ("first", "second", "msg") for n in ("assertEqual", "assertNotEqual", "assertMultiLineEqual", "assertCountEqual")},
    **{n: ("expr", "msg") for n in ("assertTrue", "assertFalse")},
    **{n: ("expr1", "expr2", "msg") for n in ("assertIs", "assertIsNot")},
    **{n: ("obj", "msg") for n in ("assertIsNone", "assertIsNotNone")},
    **{n: ("member", "container", "msg") for n in ("assertIn", "assertNotIn")},
    **{n: ("obj", "cls", "msg") for n in ("assertIsInstance", "assertNotIsInstance")},
    **{n: ("first", "second", "places", "msg", "delta") for n in ("assertAlmostEqual", "assertNotAlmostEqual")},
    **{n: ("a", "b", "msg") for n in ("assertGreater", "assertGreaterEqual", "assertLess", "assertLessEqual")},
    "assertListEqual": ("list1", "list2", "msg"), "assertTupleEqual": ("tuple1", "tuple2", "msg"),
    "assertDictEqual": ("d1", "d2", "msg"), "assertSetEqual": ("set1", "set2", "msg"),
    "assertSequenceEqual": ("seq1", "seq2", "msg", "seq_type"),
    "assertRegex": ("text", "expected_regex", "msg"), "assertNotRegex": ("text", "unexpected_regex", "msg"),
    "fail": ("msg",), "assert": ("expr", "msg"),
}
OPTIONAL = frozenset({"msg", "places", "delta", "seq_type"})


def bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments of ``self.<name>(...)`` in unittest's order; a TypeError as unittest would raise."""
    params = SIGNATURES[name]
    if len(args) > len(params):
        raise TypeError(f"{name}() takes at most {len(params)} arguments ({len(args)} given)")
    values: dict[str, Any] = dict(zip(params, args))
    for key, value in kwargs.items():
        if key not in params or key in values:
            raise TypeError(f"{name}() got an unexpected or repeated keyword argument {key!r}")
        values[key] = value
    missing = [p for p in params if p not in values and p not in OPTIONAL]
    if missing:
        raise TypeError(f"{name}() missing required argument {missing[0]!r}")
    return [values.get(p) for p in params]


def make_checks(call_agent: Any, refuse: Any, record: Any, compile_pattern: Any, pattern_type: Any) -> tuple[dict[str, Any], Any, Any, Any]:
    """(checkers by assertion name, ``compare(ops, operands)``, ``matches(pattern, text)``, ``plain(value)``).

    ``call_agent`` runs code that may be the agent's with the hook watching it; ``record(a, b, same)``
    keeps a plain-data comparison for the judge; ``refuse(kind, detail)`` raises."""
    plain_scalars = (int, float, complex, str, bytes, bool, type(None))
    isfinite = math.isfinite

    def plain(value: Any, depth: int = 0) -> bool:
        kind = type(value)
        if kind in plain_scalars:
            return True
        if depth > 20:
            return False
        if kind in (list, tuple, set, frozenset):
            return all(plain(item, depth + 1) for item in value)
        if kind is dict:
            return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
        return False

    class _Probe:  # equal to nothing but itself
        __hash__ = object.__hash__

    def perturbed(value: Any) -> Any:
        kind = type(value)
        if kind is bool:
            return not value
        if kind in (int, float, complex):
            return value + 1.5 if isfinite(abs(value)) else 0
        if kind in (str, bytes):
            return value + ("\x00" if kind is str else b"\x00")
        if kind in (list, tuple):
            return kind([*value, _Probe()])
        if kind is dict:
            return {**value, _Probe(): 0}
        return _Probe()

    def truth(value: Any) -> Any:
        """``bool(value)``, or the value itself when it has no truth (an elementwise array)."""
        try:
            return bool(call_agent(bool, value))
        except (TypeError, ValueError):
            return value

    def equal(a: Any, b: Any) -> Any:
        if plain(a) and plain(b):
            same = a == b
            record(a, b, same)
            return same
        result = truth(call_agent(lambda: a == b))
        if result is True:
            for value, other in ((a, b), (b, a)):
                if not plain(value) and (
                    truth(call_agent(lambda: value == _Probe())) is True or truth(call_agent(lambda: value == perturbed(other))) is True
                ):
                    refuse("always-equal value", f"a {type(value).__name__} equal to values it cannot equal")
        return result

    def contains(container: Any, item: Any) -> bool:
        if plain(container) and type(container) is not str and type(container) is not bytes:
            return any(equal(item, element) is True for element in (container.keys() if type(container) is dict else container))
        return bool(call_agent(lambda: bool(item in container)))

    def close(a: Any, b: Any, places: Any = None, delta: Any = None) -> bool:
        if equal(a, b) is True:
            return True
        diff = call_agent(lambda: (lambda d: d if type(d) in (int, float) else None)(abs(a - b)))
        if diff is None:
            return False
        return bool(diff <= delta) if delta is not None else round(diff, 7 if places is None else places) == 0

    def ordered(a: Any, b: Any, op: str) -> Any:
        forward = {"<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b}[op]
        result = truth(call_agent(forward))
        if result is True and not (plain(a) and plain(b)) and op in ("<", ">"):
            reverse = {"<": lambda: a > b, ">": lambda: a < b}[op]
            if truth(call_agent(reverse)) is True:
                refuse("always-true comparison", f"a {type(a).__name__} both less and greater")
        return result

    def count_equal(first: Any, second: Any) -> bool:
        """Each element of one matched to an equal element of the other (unittest's assertCountEqual)."""
        left, right = list(call_agent(list, first)), list(call_agent(list, second))
        for item in left:
            index = next((i for i, other in enumerate(right) if equal(item, other) is True), None)
            if index is None:
                return False
            right.pop(index)
        return not right

    def matches(pattern: Any, text: Any) -> bool:
        if type(pattern) is not pattern_type:  # not a literal: compiled now (re's own code is guarded only by guard())
            pattern = compile_pattern(pattern)
        return pattern.search(call_agent(str, text)) is not None

    def typed(kind: Any) -> Any:
        return lambda a, b, msg: issubclass(type(a), kind) and issubclass(type(b), kind) and equal(a, b) is True

    checkers: dict[str, Any] = {
        "assertEqual": lambda a, b, msg: equal(a, b) is True, "assertNotEqual": lambda a, b, msg: equal(a, b) is False,
        "assertTrue": lambda x, msg: truth(x) is True, "assertFalse": lambda x, msg: truth(x) is False,
        "assertIs": lambda a, b, msg: a is b, "assertIsNot": lambda a, b, msg: a is not b,
        "assertIsNone": lambda x, msg: x is None, "assertIsNotNone": lambda x, msg: x is not None,
        "assertIn": lambda a, b, msg: contains(b, a), "assertNotIn": lambda a, b, msg: not contains(b, a),
        "assertIsInstance": lambda a, c, msg: issubclass(type(a), c),
        "assertNotIsInstance": lambda a, c, msg: not issubclass(type(a), c),
        "assertAlmostEqual": lambda a, b, places, msg, delta: close(a, b, places, delta),
        "assertNotAlmostEqual": lambda a, b, places, msg, delta: not close(a, b, places, delta),
        "assertGreater": lambda a, b, msg: ordered(a, b, ">") is True, "assertGreaterEqual": lambda a, b, msg: ordered(a, b, ">=") is True,
        "assertLess": lambda a, b, msg: ordered(a, b, "<") is True, "assertLessEqual": lambda a, b, msg: ordered(a, b, "<=") is True,
        "assertListEqual": typed(list), "assertTupleEqual": typed(tuple), "assertDictEqual": typed(dict),
        "assertSetEqual": lambda a, b, msg: equal(a, b) is True, "assertMultiLineEqual": typed(str),
        "assertSequenceEqual": lambda a, b, msg, kind: (kind is None or (issubclass(type(a), kind) and issubclass(type(b), kind)))
        and equal(list(call_agent(list, a)), list(call_agent(list, b))) is True,
        "assertCountEqual": lambda a, b, msg: count_equal(a, b),
        "assertRegex": lambda text, pattern, msg: matches(pattern, text),
        "assertNotRegex": lambda text, pattern, msg: not matches(pattern, text),
        "fail": lambda msg: False,
    }
    checkers["assert"] = checkers["assertTrue"]

    def compare(ops: tuple[str, ...], operands: tuple[Any, ...]) -> Any:
        """A comparison in a test's expression (``f(x) == 3 and ...``), chained ones left to right."""
        result: Any = True
        for op, a, b in zip(ops, operands, operands[1:]):
            if op == "==":
                result = equal(a, b)
            elif op == "!=":
                same = equal(a, b)
                result = (not same) if type(same) is bool else call_agent(lambda: a != b)
            elif op in ("in", "not in"):
                result = contains(b, a) == (op == "in")
            elif op in ("is", "is not"):
                result = (a is b) == (op == "is")
            else:
                result = ordered(a, b, op)
            if result is not True:
                return result
        return result

    return checkers, compare, matches, plain
