"""What the audit hook checks is still as loaded while the tests run; standard library only.

Executed by the harness into the hook's private namespace, beside ``tamper.py``. Python 3.11
raises no audit event for rebinding a module global, a builtin or a class attribute, so the hook
compares, by identity (and a function's code), what the tests' verdict runs through against what
it was before any of the agent's code ran:

* ``guard``: before a guarded context's ``__enter__``/``__exit__`` (``assertWarns``, ``assertLogs``),
  every name of ``unittest.case``, its context classes, ``warnings.catch_warnings``, ``re`` and the
  builtins;
* ``check_state``/``note_state``: at every event of a test (an assertion, a comparison, its end)
  and between tests, the builtins, the standard-library modules the tests import, and each test
  module's globals (their objects, and mutable plain data by value).
"""

from __future__ import annotations

import builtins as builtins_module
import sys
from typing import Any


def make_state(guarded: tuple[Any, ...], watched: tuple[Any, ...], plain: Any, refuse: Any, note: Any) -> tuple[Any, Any, Any, Any]:
    """(``guard(ctx)``, ``loaded(name, globals)``, ``check_state()``, ``note_state()``); taken now."""
    modules = sys.modules
    module_type, function_type = type(sys), type(make_state)
    missing = object()

    def state_of(owner: Any) -> dict[str, Any]:
        """Each name of a guarded module or class, its object, and a function's code (by identity)."""
        taken: dict[str, Any] = {}
        for key, value in dict(vars(owner)).items():
            if key == "__warningregistry__":
                continue
            taken[key] = value
            if type(value) is function_type:
                taken[key + ".__code__"] = value.__code__
                taken[key + ".__defaults__"] = value.__defaults__
        if type(owner) is not module_type:
            taken["__bases__"] = owner.__bases__
        else:
            taken["sys.modules"] = modules.get(owner.__name__)
        return taken

    guarded_state = [(owner, state_of(owner)) for owner in guarded]
    guarded_classes = tuple(owner for owner in guarded if type(owner) is not module_type)

    def guard(ctx: Any) -> None:
        """Before a guarded context's __enter__ and __exit__: unittest, warnings, re, builtins as loaded."""
        if type(ctx) not in guarded_classes:
            refuse("patched test machinery", f"a {type(ctx).__name__} as a guarded context")
        for owner, before in guarded_state:
            now = state_of(owner)
            keys = before if owner is builtins_module else set(before) | set(now)
            for key in keys:
                if before.get(key, missing) is not now.get(key, missing):
                    refuse("patched test machinery", f"{getattr(owner, '__name__', owner)}.{key} changed during a test")

    builtins_before = dict(vars(builtins_module))
    watched_before = [(module, dict(vars(module))) for module in watched]
    test_globals: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = []  # name, globals, ids, plain copies
    reported: set[str] = set()

    def copy_plain(value: Any) -> Any:
        kind = type(value)
        if kind is list or kind is set:
            return kind(copy_plain(v) for v in value)
        if kind is dict:
            return {k: copy_plain(v) for k, v in value.items()}
        return value

    def loaded(name: str, namespace: dict[str, Any]) -> None:
        """A test module's globals once it has run: each name's object, and mutable plain data by value."""
        ids = dict(namespace)
        values = {k: copy_plain(v) for k, v in ids.items() if type(v) in (list, dict, set) and plain(v)}
        test_globals.append((name, namespace, ids, values))

    def changes() -> tuple[list[str], list[str]]:
        """(what was rebound since the agent's code could first run, the names of it not seen before):
        one change is one attempt, however many events see it."""
        found: list[str] = []
        table = vars(builtins_module)
        for key, value in builtins_before.items():
            if table.get(key, missing) is not value:
                found.append(f"builtins.{key}")
        for module, before in watched_before:
            now = vars(module)
            for key, value in before.items():
                if now.get(key, missing) is not value and key != "__warningregistry__":
                    found.append(f"{module.__name__}.{key}")
        for name, namespace, ids, values in test_globals:
            for key in set(ids) | set(namespace):
                now = namespace.get(key, missing)
                if now is not ids.get(key, missing) or (key in values and not (type(now) is type(values[key]) and now == values[key])):
                    found.append(f"{name}.{key}")
        fresh = [key for key in found if key not in reported]
        reported.update(fresh)
        return found, fresh

    def check_state() -> None:
        """At an event of a test's own code: a change is refused there (the test errors too)."""
        changed, fresh = changes()
        if fresh:
            refuse("patched test state", f"{', '.join(fresh[:5])} changed while the tests ran")
        if changed:  # counted already; every later check of a test still fails
            raise RuntimeError(f"stoker: refused (patched test state): {', '.join(changed[:5])}")

    def note_state() -> None:
        """At a test's start and end (the harness's events): recorded, not raised."""
        fresh = changes()[1]
        if fresh:
            note("patched test state", f"{', '.join(fresh[:5])} changed while the tests ran")

    return guard, loaded, check_state, note_state
