"""Task datasets: JSONL files of tasks, one JSON object a line with an ``id`` and its fields.

``environment.tasks`` mixes task ids and paths of JSONL files (entries ending in ``.jsonl``). For
the answers environment each record carries ``prompt`` and the verifier's fields (see
``stoker.actor.answers``); for a plugin only the ids are used, and the plugin reads its own data.
``environment.evalTasks`` takes the same entries for held-out evaluation (``resolve_eval_tasks``).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stoker.actor.environments import EnvironmentProblem, options_json
from stoker.actor.swe import bundled_tasks

MAX_TASK_FILE_BYTES = 256 * 1024 * 1024


def is_task_file(entry: str) -> bool:
    return entry.endswith(".jsonl")


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line, or ``EnvironmentProblem`` naming the line."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise EnvironmentProblem(f"{path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise EnvironmentProblem(f"{path}:{number}: not JSON: {exc.msg}") from None


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> tuple[dict[str, Any], ...]:
    del mtime_ns  # part of the cache key: an edited file is read again
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, record in jsonl_lines(path):
        if not isinstance(record, dict) or not isinstance(record.get("id"), str | int):
            raise EnvironmentProblem(f"{path}:{number}: expected an object with an id")
        record["id"] = str(record["id"])
        if record["id"] in seen:
            raise EnvironmentProblem(f"{path}:{number}: duplicate task id {record['id']!r}")
        seen.add(record["id"])
        records.append(record)
    if not records:
        raise EnvironmentProblem(f"{path}: no tasks")
    return tuple(records)


def load_task_file(path: str | Path) -> tuple[dict[str, Any], ...]:
    """Every record of a JSONL task file, or a clear ``EnvironmentProblem``."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise EnvironmentProblem(f"task file {path}: {exc.strerror or exc}") from None
    if stat.st_size > MAX_TASK_FILE_BYTES:
        raise EnvironmentProblem(f"task file {path}: {stat.st_size} bytes; expected under {MAX_TASK_FILE_BYTES}")
    return _load(str(Path(path).resolve()), stat.st_mtime_ns)


def records_by_id(files: list[str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in files:
        for record in load_task_file(path):
            found.setdefault(record["id"], record)
    return found


def split_entries(entries: list[str]) -> tuple[list[str], list[str]]:
    """(task ids, absolute paths of task files) from an ``environment.tasks`` list."""
    ids = [entry for entry in entries if not is_task_file(entry)]
    files = [str(Path(entry).resolve()) for entry in entries if is_task_file(entry)]
    return ids, files


def environment_tasks(env: Any) -> tuple[tuple[str, ...], str]:
    """The task ids to play and the options JSON a sandbox gets, for answers or a plugin."""
    ids, files = split_entries(list(env.tasks))
    for path in files:
        ids.extend(record["id"] for record in load_task_file(path))
    options = dict(env.options)
    if env.name == "answers":
        if not files:
            raise EnvironmentProblem("the answers environment needs environment.tasks to name a JSONL task file")
        options["taskFiles"] = files
    elif not ids:
        # Here, not at the top: plugins imports this module (a cycle), and pydantic, which a sandbox
        # playing the answers environment (answers imports this module) should not pay for.
        from stoker.actor.plugins import resolve

        with tempfile.TemporaryDirectory(prefix="stoker-tasks-") as workdir:
            ids = resolve(env.name).tasks(options, workdir)
    return tuple(dict.fromkeys(ids)), json.dumps(options)


# ------------------------------------------------------------- training and evaluation tasks


def training_tasks(env: Any) -> tuple[tuple[str, ...], str]:
    """The task ids the actors train on and the options JSON every sandbox gets."""
    if env.name == "frozenlake":
        return tuple(str(s) for s in env.frozenlake.map_seeds), options_json(env.frozenlake)
    if env.name == "swe":
        return tuple(env.tasks or env.swe.tasks) or tuple(bundled_tasks()), options_json(env.swe)
    if env.name == "swebench":
        from stoker.actor.swebench import instance_tasks  # here: swebench imports this module (a cycle)

        return instance_tasks(env)
    return environment_tasks(env)  # answers, or a plugin


def eval_problems(env: Any) -> list[tuple[str, str]]:
    """What ``stoker validate`` and ``stoker run`` report about ``environment.evalTasks``."""
    if not env.eval_tasks:
        return []
    try:
        tasks, options = training_tasks(env)
    except EnvironmentProblem:
        return []  # the training tasks' own problem is reported for environment.tasks
    try:
        resolve_eval_tasks(env, tasks, options)
    except EnvironmentProblem as exc:
        return [("environment.evalTasks", str(exc))]
    return []


def resolve_eval_tasks(env: Any, training: Sequence[str], options_json: str) -> tuple[tuple[str, ...], str]:
    """The evaluation task ids, and the sandbox options JSON extended with their task files.

    ``EnvironmentProblem`` for a missing or malformed file, an id no task file or bundled set
    holds, and an id that is also a training task (held out means never trained on)."""
    entries = list(env.eval_tasks)
    if not entries:
        return (), options_json
    options = json.loads(options_json)
    if env.name == "frozenlake":
        ids = entries  # map seeds: spec.cross_field_problems checked that they are integers
    elif env.name == "swe":
        bundled = set(bundled_tasks())
        unknown = [task for task in entries if task not in bundled]
        if unknown:
            raise EnvironmentProblem(f"unknown SWE tasks {unknown}; the bundled ones are {sorted(bundled)}")
        ids = entries
    elif env.name == "swebench":
        # Here, not at the top: both import this module (a cycle; see environment_tasks).
        from stoker.actor.plugins import TaskSection
        from stoker.actor.swebench import instance_tasks

        found, eval_options = instance_tasks(TaskSection(entries, env.options))
        ids = list(found)
        options["taskFiles"] = list(dict.fromkeys([*options.get("taskFiles", []), *json.loads(eval_options)["taskFiles"]]))
    else:
        ids, files = split_entries(entries)
        for path in files:
            ids.extend(record["id"] for record in load_task_file(path))
        if env.name == "answers":
            task_files = list(dict.fromkeys([*options.get("taskFiles", []), *files]))
            known = records_by_id(task_files)
            unknown = [task for task in ids if task not in known]
            if unknown:
                raise EnvironmentProblem(f"unknown tasks {unknown[:5]}; not in {', '.join(task_files)}")
            options["taskFiles"] = task_files
    trained = set(training)
    overlap = [task for task in dict.fromkeys(ids) if task in trained]
    if overlap:
        raise EnvironmentProblem(f"{overlap[:5]} are also training tasks; held-out tasks must not be trained on")
    return tuple(dict.fromkeys(ids)), json.dumps(options)

