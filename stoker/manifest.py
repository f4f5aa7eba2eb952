"""Load RLJob manifests from YAML and explain every problem in user terms.

Each problem names the field path as a user writes it (``spec.actors.maxReplicas``), what was
given and what was expected. Nothing a user can type produces a Python traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from stoker.checkpoint_files import weight_problems
from stoker.hfconfig import resolve_architecture
from stoker.remote_checkpoint import FetchPlan, is_remote, localize_document
from stoker.spec import API_VERSION, KIND, RLJob, cross_field_problems, name_problems

MAX_MANIFEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    source: str  # "FILE" or "FILE[doc N]"
    path: str  # field path, e.g. "spec.actors.maxReplicas"; "" for the whole document
    message: str

    def __str__(self) -> str:
        where = f"{self.source}: {self.path}" if self.path else self.source
        return f"{where}: {self.message}"


class ManifestError(Exception):
    """One or more problems in a manifest file."""

    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-after[", "function-before[", "function-wrap[")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _explain(error: Any) -> tuple[str, str]:
    """A pydantic error dict -> (path, 'got X; expected Y')."""
    path = _loc_path(tuple(error["loc"]))
    kind = error["type"]
    given = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return path, "unknown field"
    if kind == "missing":
        return path, "missing; required"
    if kind == "literal_error":
        return path, f"got {_short(given)}; expected one of {ctx.get('expected', '')}"
    if kind == "enum":
        return path, f"got {_short(given)}; expected one of {ctx.get('expected', '')}"
    if kind == "value_error":
        return path, f"{error['msg'].removeprefix('Value error, ')}"
    expected = error["msg"]
    for prefix in ("Input should be ", "String should ", "List should ", "Value should "):
        expected = expected.removeprefix(prefix)
    return path, f"got {_short(given)}; expected {expected}"


def _model_field(doc: Any, key: str) -> Any:
    spec = doc.get("spec") if isinstance(doc, dict) else None
    model = spec.get("model") if isinstance(spec, dict) else None
    return model.get(key) if isinstance(model, dict) else None


def validate_document(doc: Any, source: str, *, fetch: FetchPlan | None = None) -> tuple[RLJob | None, list[Problem]]:
    """Validate one parsed YAML document as an RLJob; with ``fetch``, its gs:// checkpoints are
    fetched first (``stoker.remote_checkpoint``) and the job names the local copies."""
    without_weights = False  # an actor fetched a gs:// checkpoint's config and tokenizer, not its weights
    if fetch is not None:
        first, first_problems = validate_document(doc, source)  # nothing is downloaded for a manifest that is wrong anyway
        if first is None:
            return None, first_problems
        without_weights = not fetch.weights and is_remote(_model_field(doc, "checkpoint"))
        doc, fetch_problems = localize_document(doc, fetch)
        if fetch_problems:
            return None, [Problem(source, f"spec.{path}", message) for path, message in fetch_problems]
    if not isinstance(doc, dict):
        return None, [Problem(source, "", f"expected a mapping (an RLJob manifest), got {type(doc).__name__}")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(Problem(source, "apiVersion", f"got {_short(doc.get('apiVersion'))}; expected '{API_VERSION}'"))
    if doc.get("kind") != KIND:
        problems.append(Problem(source, "kind", f"got {_short(doc.get('kind'))}; expected '{KIND}'"))
    if problems:
        return None, problems
    try:
        job = RLJob.model_validate(doc)
    except ValidationError as exc:
        for error in exc.errors():
            path, message = _explain(error)
            problems.append(Problem(source, path, message))
        return None, problems
    problems = [Problem(source, "metadata.name", message) for message in name_problems(job.metadata.name, job.spec)]
    # The checkpoint's config.json is the architecture; the cross-field rules then check that one.
    resolved, found = resolve_architecture(job.spec)
    if not without_weights and not any(path == "model.checkpoint" for path, _ in found):  # config.json read: check the weights
        found += weight_problems(resolved.model.checkpoint, resolved.model.architecture)
    job = job.model_copy(update={"spec": resolved})
    found += cross_field_problems(job.spec)
    problems += [Problem(source, f"spec.{path}", message) for path, message in found]
    return (None if problems else job), problems


def _is_uri(path: str) -> bool:
    return "://" in path


def model_path_problems(spec: Any, *, local: bool) -> list[tuple[str, str]]:
    """Model files named in the spec that are not on this machine (``local``: the job runs here --
    every ``stoker run``, and a manifest whose learner is ``accelerator: cpu``). A URI such as
    ``gs://...`` is left to whatever fetches it; so are the paths of a TPU job, which name its
    pods' filesystem."""
    if not local:
        return []
    model = spec.model
    out: list[tuple[str, str]] = []
    checkpoint = model.checkpoint
    if checkpoint and not _is_uri(checkpoint) and not Path(checkpoint).expanduser().is_dir():
        what = "is a file" if Path(checkpoint).expanduser().exists() else "does not exist"
        out.append((
            "model.checkpoint",
            f"{checkpoint!r} {what}; expected a Hugging Face checkpoint directory on this machine (config.json, "
            "*.safetensors, tokenizer.json), or a URI such as gs://bucket/model",
        ))
    tokenizer = model.tokenizer
    if tokenizer and tokenizer != "builtin" and not _is_uri(tokenizer) and not Path(tokenizer).expanduser().exists():
        out.append((
            "model.tokenizer",
            f"{tokenizer!r} does not exist; expected a tokenizer.json (or a directory holding one) on this machine, "
            "or 'builtin'",
        ))
    template = model.chat_template
    if template and template != "none" and not _is_uri(template) and not Path(template).expanduser().is_file():
        out.append(("model.chatTemplate", f"{template!r} is not a file on this machine; expected a Jinja template file, or 'none'"))
    return out


def add_manifest_directory(path: str | Path) -> str:
    """Make modules beside the manifest importable (environment and reward plugins named
    ``module:function``), in this process; returns the directory for the children's PYTHONPATH."""
    import sys

    directory = str(Path(path).resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return directory


def load_text(text: str, source: str, *, fetch: FetchPlan | None = None) -> tuple[list[RLJob], list[Problem]]:
    """Every RLJob in a (multi-document) YAML text, and every problem found."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return [], [Problem(source, "", f"malformed YAML{where}: {reason}")]
    if not docs:
        return [], [Problem(source, "", "empty; expected at least one RLJob document")]
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    for index, doc in enumerate(docs):
        job, found = validate_document(doc, source if len(docs) == 1 else f"{source}[doc {index + 1}]", fetch=fetch)
        problems.extend(found)
        if job is not None:
            jobs.append(job)
    return jobs, problems


def load_file(path: str | Path, *, fetch: FetchPlan | None = None) -> tuple[list[RLJob], list[Problem]]:
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        return [], [Problem(source, "", f"cannot read: {exc.strerror or exc}")]
    if len(raw) > MAX_MANIFEST_BYTES:
        return [], [Problem(source, "", f"{len(raw)} bytes; expected a manifest under {MAX_MANIFEST_BYTES} bytes")]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return [], [Problem(source, "", "not UTF-8 text; expected a YAML manifest")]
    if "\x00" in text:
        return [], [Problem(source, "", "binary data; expected a YAML manifest")]
    return load_text(text, source, fetch=fetch)


def load_job(path: str | Path, *, fetch: FetchPlan | None = None) -> RLJob:
    """Exactly one valid RLJob from a file, or ``ManifestError``; ``fetch``: the gs:// checkpoints
    this process reads are fetched into the local cache first (the components pass their plan)."""
    jobs, problems = load_file(path, fetch=fetch)
    if problems:
        raise ManifestError(problems)
    if len(jobs) != 1:
        raise ManifestError([Problem(str(path), "", f"{len(jobs)} RLJob documents; expected exactly one")])
    return jobs[0]
