"""Environments by reference: ``package.module:factory`` or a ``stoker.environments`` entry point.

A reference resolves to a factory, called once per episode inside the sandbox::

    def make(options, workdir) -> Environment      # or make(options)

``options`` is the job's ``environment.options``: the mapping itself, or an instance of the
factory's ``options_model`` (a pydantic model) when it declares one; ``stoker validate`` then
checks the options against that model and reports field paths. The task list is
``environment.tasks`` when the job sets it, else ``factory.tasks(options)`` (a callable attribute),
else the ``tasks`` attribute of an environment the factory makes. ``environment_plugin`` sets those
attributes. docs/environments.md walks through a complete plugin.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from stoker.actor.datasets import is_task_file, load_task_file
from stoker.actor.environments import Environment, EnvironmentProblem
from stoker.actor.swebench import instance_tasks

BUILTIN = ("frozenlake", "swe", "swebench", "answers")
ENTRY_POINT_GROUP = "stoker.environments"

F = TypeVar("F", bound=Callable[..., Any])


def environment_plugin(
    *, options: type[BaseModel] | None = None, tasks: Callable[[Any], list[str]] | None = None
) -> Callable[[F], F]:
    """Declare a factory's options model and task list (both optional)."""

    def mark(factory: F) -> F:
        factory.options_model = options  # type: ignore[attr-defined]
        factory.tasks = tasks  # type: ignore[attr-defined]
        return factory

    return mark


@dataclass(frozen=True)
class Plugin:
    reference: str
    factory: Callable[..., Environment]
    options_model: type[BaseModel] | None
    task_lister: Callable[[Any], list[str]] | None
    takes_workdir: bool

    def parse_options(self, options: dict[str, Any]) -> Any:
        """The options the factory receives, or ``OptionsProblem`` naming each bad field."""
        if self.options_model is None:
            return dict(options)
        try:
            return self.options_model.model_validate(options)
        except ValidationError as exc:
            raise OptionsProblem(
                self.reference,
                [(".".join(str(part) for part in error["loc"]), error["msg"]) for error in exc.errors()],
            ) from None

    def make(self, options: dict[str, Any], workdir: str) -> Environment:
        parsed = self.parse_options(options)
        env = self.factory(parsed, workdir) if self.takes_workdir else self.factory(parsed)
        for method in ("reset", "step", "close"):
            if not callable(getattr(env, method, None)):
                raise EnvironmentProblem(f"environment {self.reference!r}: its factory returned {type(env).__name__}, "
                                         f"which has no {method}(); expected an Environment (reset/step/close)")
        return env

    def tasks(self, options: dict[str, Any], workdir: str) -> list[str]:
        """The plugin's own task ids (used when the job lists none)."""
        if self.task_lister is not None:
            return [str(task) for task in self.task_lister(self.parse_options(options))]
        env = self.make(options, workdir)
        try:
            listed = getattr(env, "tasks", None)
            found = listed() if callable(listed) else listed
        finally:
            env.close()
        if not found:
            raise EnvironmentProblem(
                f"environment {self.reference!r} lists no tasks; set environment.tasks, or give the factory "
                "a tasks(options) attribute or its environments a tasks list"
            )
        return [str(task) for task in found]


@dataclass(frozen=True)
class TaskSection:
    """An environment section holding just these tasks and options (for ``instance_tasks``)."""

    tasks: list[str]
    options: dict[str, Any]


class OptionsProblem(EnvironmentProblem):
    """A plugin's options model rejected ``environment.options``: one (field path, message) each."""

    def __init__(self, reference: str, fields: list[tuple[str, str]]):
        self.fields = fields
        detail = "; ".join(f"options.{path}: {message}" for path, message in fields)
        super().__init__(f"environment {reference!r} rejected its options: {detail}")


def resolve(name: str) -> Plugin:
    """The plugin a non-built-in ``environment.name`` refers to, or a clear ``EnvironmentProblem``."""
    if ":" in name:
        target = import_reference(name)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            registered = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            known = ", ".join([*BUILTIN, *registered])
            raise EnvironmentProblem(
                f"unknown environment {name!r}; expected one of {known}, or an import reference package.module:factory"
            )
        try:
            target = found[0].load()
        except Exception as exc:  # noqa: BLE001 - a plugin's import error, reported to the user
            raise EnvironmentProblem(f"environment {name!r} (entry point {found[0].value}) cannot be imported: "
                                     f"{type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise EnvironmentProblem(f"environment {name!r} is a {type(target).__name__}; expected a factory function or class")
    model = getattr(target, "options_model", None)
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise EnvironmentProblem(f"environment {name!r}: options_model is not a pydantic model")
    return Plugin(
        reference=name,
        factory=target,
        options_model=model,
        task_lister=getattr(target, "tasks", None) if callable(getattr(target, "tasks", None)) else None,
        takes_workdir=_takes_two(target),
    )


def import_reference(reference: str, kind: str = "environment") -> Any:
    """``package.module:attribute`` imported; ``kind`` names what it is in the errors (an
    environment factory, a reward function)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise EnvironmentProblem(f"{kind} {reference!r}: expected an import reference package.module:attribute")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        hint = ""
        if exc.name and module_name.startswith(exc.name):
            hint = (
                "; stoker run and stoker validate find modules beside the manifest, anything else must be "
                "installed or on PYTHONPATH (in the actor image for a cluster)"
            )
        raise EnvironmentProblem(
            f"{kind} {reference!r}: cannot import {module_name}: ModuleNotFoundError: {exc}{hint}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is the user's to see
        raise EnvironmentProblem(
            f"{kind} {reference!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise EnvironmentProblem(f"{kind} {reference!r}: module {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _takes_two(factory: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def environment_problems(name: str, options: dict[str, Any], tasks: list[str]) -> list[tuple[str, str]]:
    """What ``stoker validate`` reports about an environment: (field path under spec, message).

    Task files must load; a plugin must import and accept its options.
    """
    problems: list[tuple[str, str]] = []
    if name == "swebench":
        try:
            instance_tasks(TaskSection(tasks, options))
        except EnvironmentProblem as exc:
            problems.append(("environment.tasks", str(exc)))
        return problems
    for index, entry in enumerate(tasks):
        if is_task_file(entry):
            try:
                load_task_file(entry)
            except EnvironmentProblem as exc:
                problems.append((f"environment.tasks[{index}]", str(exc)))
    if name == "answers" and not any(is_task_file(entry) for entry in tasks):
        problems.append(("environment.tasks", "missing; the answers environment needs a JSONL task file"))
    if name in BUILTIN:
        return problems
    try:
        plugin = resolve(name)
    except EnvironmentProblem as exc:
        return [*problems, ("environment.name", str(exc))]
    try:
        plugin.parse_options(options)
    except OptionsProblem as exc:
        problems += [(f"environment.options.{path}", message) for path, message in exc.fields]
    return problems
