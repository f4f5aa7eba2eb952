"""What an edit of an RLJob changed (from kopf's diff), and the Normal Events its lifecycle posts
for ``kubectl describe rljob``: children created or recreated, suspending, resumed, the rollout
tier's servers added or removed.

kopf's own posting level stays WARNING (``kopf_setup.configure``): at INFO every handler log line
of every look would become an Event. These are posted explicitly instead, one per change, as the
scaling Events are (``stoker.operator.control.Action``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from stoker.operator.control import Action
from stoker.spec import RLJobSpec

SUSPEND_PATH = ("spec", "suspend")
MAX_LISTED = 6
"""Children named in one Event; the rest are counted (Event messages are meant to be short)."""


def dig(value: Any, path: Sequence[str]) -> Any:
    for part in path:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def field_values(diff: Any, field: tuple[str, ...]) -> Iterator[tuple[Any, Any]]:
    """(old, new) of ``field`` for each diff item that changes it, however kopf reports it: the
    field itself, or a whole enclosing block added, removed or replaced; (None, None) for a change
    below it (the field is a mapping and only a part of it changed)."""
    for _, path, old, new in diff or ():
        path = tuple(path)
        if path[: len(field)] == field:
            yield (old, new) if len(path) == len(field) else (None, None)
            continue
        rest = field[len(path):]
        if field[: len(path)] == path and dig(old, rest) != dig(new, rest):
            yield dig(old, rest), dig(new, rest)


def resumed(diff: Any) -> bool:
    """Whether this edit lifted ``spec.suspend``."""
    return any(bool(old) and not new for old, new in field_values(diff, SUSPEND_PATH))


def listing(items: Sequence[str]) -> str:
    more = f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def children_created(created: Sequence[str], *, missing: bool = False) -> Action | None:
    """``created``: "Kind/name" of what the operator created; ``missing``: recreated by a look
    (deleted by hand, or gone while suspended)."""
    if not created:
        return None
    if missing:
        return Action("RecreatedChildren", f"created missing {listing(created)}")
    return Action("CreatedChildren", f"created {listing(created)}")


def _scaled_parts(spec: RLJobSpec) -> str | None:
    if spec.mode == "colocated":
        return None  # the learner is the whole job
    return "actors and rollout servers" if spec.rollout is not None else "actors"


def suspending(spec: RLJobSpec) -> Action:
    parts = _scaled_parts(spec)
    return Action("Suspending", (f"{parts} scaled to 0; " if parts else "") + "the learner checkpoints and stops")


def resuming(spec: RLJobSpec) -> Action:
    parts = _scaled_parts(spec)
    return Action("Resuming", "the learner is recreated and restores its latest checkpoint"
                  + (f"; {parts} scaled back" if parts else ""))


def rollout_changed(done: Sequence[str]) -> Action | None:
    """What a look did to the rollout tier's children, e.g. ``["deleted JobSet/lake-rollout-1"]``."""
    return Action("SyncedRolloutTier", "; ".join(done)) if done else None
