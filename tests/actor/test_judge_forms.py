"""The test forms the hook decides beyond plain assertions (issue #33): ``self.fail``, ``skipTest``,
``subTest``, the ``assertWarns`` call forms, ``*args``/keywords, comparisons inside expressions,
unittest's fixtures; and the forms it cannot check, refused before a run with a named reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stoker.actor import judge
from stoker.actor.environments import EnvironmentProblem
from stoker.actor.harness_rewrite import unchecked_forms

from .test_cheats import _form_cheat

CODE = """import warnings
def parse(s):
    if s == "bad":
        raise ValueError("bad input")
    return int(s)
def old():
    warnings.warn("old: use parse", DeprecationWarning)
"""
WRONG = """def parse(s):
    return 1
def old():
    pass
"""
ALWAYS_EQUAL = """class _E:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def parse(s):
    return _E()
def old():
    pass
"""


def _judge(tmp_path: Path, body: str, code: str, header: str = "") -> judge.Verdict:
    tests = (f"import unittest, warnings\nfrom parse import parse, old\n{header}"
             f"class P(unittest.TestCase):\n    def test_it(self):\n        {body}\n")
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / "parse.py").write_text(code)
    shutil.rmtree(tmp_path / "judge", ignore_errors=True)
    return judge.judge_unittest(tree, {"test_parse.py": tests}, ["test_parse"], tmp_path / "judge", 20.0)


# Each: the test body, and a cheat that makes the wrong code pass it (each scored 1.0 on 5b220a2);
# a patch of unittest puts itself back, so the end-of-run snapshot sees nothing.
CHEATED_FORMS = {
    "self.fail, patched to do nothing": (
        "try:\n            parse('bad')\n        except ValueError:\n            return\n        self.fail('no ValueError')",
        "import unittest\n_orig = unittest.TestCase.fail\n"
        "def _fake(self, msg=None):\n    unittest.TestCase.fail = _orig  # put back: nothing to see at the end\n"
        "unittest.TestCase.fail = _fake\n" + WRONG),
    "subTest, patched to swallow the error": (
        "for s in ('1', '2'):\n            with self.subTest(s=s):\n                self.assertEqual(parse(s), int(s))",
        "import contextlib, unittest\n_orig, _calls = unittest.TestCase.subTest, []\n"
        "def _fake(self, *a, **k):\n    _calls.append(1)\n    if len(_calls) == 2:\n        unittest.TestCase.subTest = _orig\n"
        "    return contextlib.suppress(Exception)\nunittest.TestCase.subTest = _fake\n"
        "def parse(s):\n    raise TypeError(s)\ndef old():\n    pass\n"),
    "assertWarns call form": (
        "self.assertWarns(DeprecationWarning, old)",
        _form_cheat("unittest.case._AssertWarnsContext", "pass") + WRONG),
    "assertWarnsRegex call form": (
        "self.assertWarnsRegex(DeprecationWarning, 'use parse', old)",
        _form_cheat("unittest.case._AssertWarnsContext", "pass") + WRONG),
    "assertRaises with *args": (
        "spec = (ValueError, parse, 'bad')\n        self.assertRaises(*spec)",
        _form_cheat("unittest.case.TestCase", None).replace("assertRaisesRegex", "assertRaises") + WRONG),
    "== inside assertTrue(... and ...)": (
        "self.assertTrue(parse('3') == 3 and parse('4') == 4)", ALWAYS_EQUAL),
    "== inside all(...) in an assert": (
        "assert all(parse(s) == int(s) for s in '123')", ALWAYS_EQUAL),
    "!= and == in a boolean expression": (
        "self.assertFalse(parse('1') != 1 or not parse('2') == 2)", ALWAYS_EQUAL),
}


@pytest.mark.parametrize("form", sorted(CHEATED_FORMS))
def test_each_form_is_decided_by_the_hook(form: str, tmp_path: Path) -> None:
    body, cheat = CHEATED_FORMS[form]
    honest = _judge(tmp_path, body, CODE)
    assert honest.passed() and not honest.tampering, honest.output
    assert not _judge(tmp_path, body, WRONG).passed()  # the test can fail
    cheated = _judge(tmp_path, body, cheat)
    assert not cheated.passed(), cheated.output


def test_keywords_and_messages_bind_as_in_unittest(tmp_path: Path) -> None:
    body = ("self.assertEqual(first=parse('2'), second=2, msg='two')\n        self.assertIn(member=2, container=[parse('2')])\n"
            "        self.assertAlmostEqual(parse('2'), 2.05, delta=0.1)\n        self.assertCountEqual([parse('1'), 2], [2, 1])\n"
            "        self.assertRegex('parse 12', r'\\d+')\n        self.assertEquals(parse('3'), 3)")
    assert _judge(tmp_path, body, CODE).passed()
    failing = _judge(tmp_path, "self.assertEqual(parse('2'), 3, msg='the two case')", CODE)
    assert failing.outcomes == {"test_parse.P.test_it": "failed"} and "the two case" in failing.output


def test_a_skipped_test_never_counts_as_a_pass(tmp_path: Path) -> None:
    skipped = _judge(tmp_path, "self.skipTest('not today')\n        self.assertEqual(parse('1'), 1)", CODE)
    assert skipped.outcomes == {"test_parse.P.test_it": "skipped"} and not skipped.passed()
    # The agent's code skips the test and makes the harness's result call it a success.
    cheat = ("import unittest, __main__\n"
             "__main__._Result.addSkip = lambda self, test, reason: self.outcomes.__setitem__(test.id(), ('passed', ''))\n"
             "def parse(s):\n    raise unittest.SkipTest('later')\ndef old():\n    pass\n")
    assert not _judge(tmp_path, "self.assertEqual(parse('1'), 1)", cheat).passed()


def test_comparisons_keep_their_meaning_and_fixtures_run(tmp_path: Path) -> None:
    header = ("CASES = {'1': 1, '2': 2}\nclass Shape:\n    def __init__(self, n):\n        self.n = n\n"
              "    def __eq__(self, other):\n        return isinstance(other, Shape) and other.n == self.n\n    __hash__ = None\n")
    body = ("self.assertTrue(self.ready == 1 < 2 <= 2 and parse('1') in [1, 2] and 3 not in [parse('1')])\n"
            "        self.assertEqual([s for s in CASES if parse(s) == CASES[s]], ['1', '2'])\n"
            "        self.assertTrue(Shape(parse('2')) == Shape(2) and Shape(1) != Shape(2))\n"
            "        self.assertIs(parse('1') is None, False)")
    tests = body.replace("self.ready", "type(self).ready")
    verdict = _judge(tmp_path, tests, CODE, header + "def setUpModule():\n    pass\n")
    assert not verdict.passed()  # no setUpClass yet: 'ready' is missing
    fixture = "\n    @classmethod\n    def setUpClass(cls):\n        cls.ready = 1\n    def test_two(self):\n        self.assertEqual(parse('2'), 2)\n"
    with_fixture = _judge(tmp_path, tests + fixture, CODE, header)
    assert with_fixture.passed() and set(with_fixture.outcomes) == {"test_parse.P.test_it", "test_parse.P.test_two"}, with_fixture.output


def test_forms_the_hook_cannot_check_are_refused_before_the_run(tmp_path: Path) -> None:
    source = ("import unittest\nclass P(unittest.TestCase):\n    def test_a(self):\n        check = self.assertEqual\n"
              "        check(1, 1)\n    def test_b(self):\n        with self.assertRaises(ValueError, msg='x') as cm, open('f'):\n            pass\n")
    forms = unchecked_forms(source, "test_p.py")
    assert forms == ("self.assertEqual (line 4)", "self.assertRaises (line 7)")
    assert unchecked_forms("import unittest\nclass P(unittest.TestCase):\n    def test(self):\n        self.assertEqual(1, 1)\n", "t.py") == ()
    with pytest.raises(EnvironmentProblem, match=r"cannot check these test forms: test_parse.py: self.assertEqual \(line 5\)"):
        _judge(tmp_path, "check = self.assertEqual\n        check(parse('1'), 1)", CODE)


def test_an_error_inside_a_subtest_fails_the_test_though_the_loop_goes_on(tmp_path: Path) -> None:
    body = ("for s in ('1', 'bad', '3'):\n            with self.subTest(s=s):\n                self.assertEqual(parse(s), int(s))\n"
            "        self.assertEqual(parse('3'), 3)")
    verdict = _judge(tmp_path, body, CODE)  # parse('bad') raises ValueError: that subtest errs, the rest run
    assert verdict.outcomes == {"test_parse.P.test_it": "failed"} and "subTest(s='bad'): ValueError" in verdict.output, verdict.output
