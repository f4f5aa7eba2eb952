"""The two Dockerfiles, parsed (dockerfile-parse) and checked for what a cluster relies on.

No image is built here (no daemon in CI); instead each property that would otherwise only show up
at `docker build` or pod start is checked from the files: pinned bases, a non-root numeric user,
a final stage without build tools, an entrypoint that is a real `stoker` subcommand, and a build
context (.dockerignore) that holds every path the Dockerfile copies and nothing else.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from stoker.cli import SUBCOMMANDS

IMAGES = {"Dockerfile.learner": "learner", "Dockerfile.actor": "actor"}
# An exact Python patch release on a named Debian release, optionally with a digest; never a
# floating tag such as python:3.11-slim or latest.
PINNED_BASE = re.compile(r"^python:\d+\.\d+\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?$")
BUILD_TOOLS = re.compile(r"\b(apt-get|apt|apk|gcc|g\+\+|clang|make|cmake|build-essential|git|curl|wget|pip3?|uv)\s+(install|add)\b|\bpip3? install\b")


# What a final stage may install: runtime packages the product needs (bubblewrap: the judge's sandbox).
RUNTIME_PACKAGES = {"bubblewrap"}


def apt_packages(command: str) -> set[str]:
    """The packages an ``apt-get install`` in a RUN line names."""
    found: set[str] = set()
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["apt-get", "install"]:
            found |= {w for w in words[2:] if not w.startswith("-")}
    return found


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


def stages(path: Path) -> list[Stage]:
    with path.open("rb") as handle:
        parser = DockerfileParser(fileobj=handle)
        structure = parser.structure
    out: list[Stage] = []
    for item in structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            parts = value.split()
            out.append(Stage(base=parts[0], name=parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None))
        elif instruction != "COMMENT":
            assert out, f"{path.name}: {instruction} before the first FROM"
            out[-1].instructions.append((instruction, value))
    return out


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)  # shell form would be a plain string and make signals miss PID 1
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed)
    return parsed


def dockerignore_allows(rules: list[str], relative: str) -> bool:
    """Docker's rule: the last pattern matching a path (or one of its parents) decides."""
    parts = relative.rstrip("/").split("/")
    allowed = True
    for raw in rules:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.rstrip("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(c, pattern) for c in candidates)
        if hit:
            allowed = negate
    return allowed


@pytest.fixture(scope="module")
def ignore_rules(repo: Path) -> list[str]:
    path = repo / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: the whole working tree (.venv, .git) would be sent"
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_every_base_image_is_pinned(repo: Path, dockerfile: str) -> None:
    for stage in stages(repo / dockerfile):
        assert PINNED_BASE.match(stage.base), f"{dockerfile}: base {stage.base!r} is not pinned to a patch release"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_final_stage_runs_as_a_numeric_non_root_user(repo: Path, dockerfile: str) -> None:
    final = stages(repo / dockerfile)[-1]
    users = final.values("USER")
    assert users, f"{dockerfile}: the final stage never leaves root"
    uid = users[-1].split(":")[0]
    # Kubernetes can only enforce runAsNonRoot against a numeric UID.
    assert uid.isdigit() and int(uid) > 0, f"{dockerfile}: USER {users[-1]} must be a numeric non-zero UID"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_final_stage_holds_no_build_tools(repo: Path, dockerfile: str) -> None:
    all_stages = stages(repo / dockerfile)
    assert len(all_stages) >= 2, f"{dockerfile}: build in one stage and copy the result into a clean one"
    final = all_stages[-1]
    for command in final.values("RUN"):
        runtime = apt_packages(command)
        assert runtime <= RUNTIME_PACKAGES, f"{dockerfile}: the final stage installs {sorted(runtime - RUNTIME_PACKAGES)}"
        if runtime:  # a runtime package only: no recommends, no package lists left behind
            assert "--no-install-recommends" in command and "rm -rf /var/lib/apt/lists/*" in command, command
            command = re.sub(r"apt-get (update|install)[^&]*", "", command)
        assert not BUILD_TOOLS.search(command), f"{dockerfile}: the final stage installs something: {command}"
    # The base image's pip/setuptools/wheel are removed, so nothing there can install packages.
    assert any("pip uninstall" in c and {"pip", "setuptools", "wheel"} <= set(shlex.split(c)) for c in final.values("RUN"))
    # Only the built virtual environment crosses over; no source tree, no build stage wholesale.
    copies = final.values("COPY")
    assert copies, f"{dockerfile}: the final stage copies nothing from the build stage"
    for value in copies:
        assert value.split()[0] == f"--from={all_stages[0].name}", value
        assert value.split()[1:] == ["/opt/stoker", "/opt/stoker"], value
    # The venv built in the first stage drops its own pip too before it is copied.
    assert any("pip uninstall" in c for c in all_stages[0].values("RUN"))


@pytest.mark.parametrize(("dockerfile", "subcommand"), IMAGES.items())
def test_entrypoint_is_a_real_stoker_subcommand(repo: Path, dockerfile: str, subcommand: str) -> None:
    final = stages(repo / dockerfile)[-1]
    entrypoint = exec_form(final.values("ENTRYPOINT")[-1])
    command = exec_form(final.values("CMD")[-1])
    # ENTRYPOINT is the bare `stoker`, so a pod's args (["buffer", ...], ["operator", ...]) pick
    # another subcommand from the same image.
    assert entrypoint == ["stoker"]
    assert command[0] == subcommand and subcommand in SUBCOMMANDS
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stoker"] == "stoker.cli:main", "the image's entrypoint is the console script of the package"
    # The venv's bin comes first on PATH: pods run `stoker ...`, and sandbox pods run
    # `python -m stoker.actor.sandbox_server`, which must be the venv's python, not the base image's.
    assert re.search(r"\bPATH=/opt/stoker/bin:\$PATH\b", " ".join(final.values("ENV"))), "PATH must start with /opt/stoker/bin"


def test_actor_image_carries_bubblewrap_for_the_judge(repo: Path) -> None:
    """Without it every judged run in an actor pod (`kind: process`/`inline`) refuses to start;
    it must be installed before the image drops root."""
    final = stages(repo / "Dockerfile.actor")[-1]
    installs = [i for i, (kind, value) in enumerate(final.instructions) if kind == "RUN" and "bubblewrap" in apt_packages(value)]
    user = [i for i, (kind, _) in enumerate(final.instructions) if kind == "USER"]
    assert installs and user and installs[0] < user[-1], "Dockerfile.actor: install bubblewrap in the final stage, before USER"
    assert not any(apt_packages(v) for v in stages(repo / "Dockerfile.learner")[-1].values("RUN")), "the learner judges nothing"
    assert apt_packages("apt-get update && apt-get install --yes --no-install-recommends bubblewrap") == {"bubblewrap"}


def test_actor_image_serves_every_cpu_role(repo: Path) -> None:
    """The chart and the operator start the buffer and the operator from the actor image."""
    for role in ("actor", "buffer", "operator"):
        assert role in SUBCOMMANDS
    actor_installs = " ".join(stages(repo / "Dockerfile.actor")[0].values("RUN"))
    learner_installs = " ".join(stages(repo / "Dockerfile.learner")[0].values("RUN"))
    assert "pip install ." in actor_installs and "[tpu]" not in actor_installs, "the actor image stays CPU-only"
    assert 'pip install ".[tpu]"' in learner_installs, "the learner image installs jax[tpu]"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_build_context_holds_every_copied_path_and_every_package(repo: Path, dockerfile: str, ignore_rules: list[str]) -> None:
    build = stages(repo / dockerfile)[0]
    copied: set[str] = set()
    for value in build.values("COPY"):
        args = [a for a in value.split() if not a.startswith("--")]
        for source in args[:-1]:
            copied.add(source.rstrip("/"))
            assert (repo / source).exists(), f"{dockerfile}: COPY {source} does not exist in the repository"
            assert dockerignore_allows(ignore_rules, source), f"{dockerfile}: .dockerignore excludes {source}"
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    package_dirs = {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}
    assert package_dirs <= copied, f"{dockerfile}: `pip install .` needs {sorted(package_dirs - copied)} too"
    readme = pyproject["project"].get("readme")
    if readme:
        assert readme in copied, f"{dockerfile}: pyproject names {readme} as the readme; the build needs it"


@pytest.mark.parametrize("path", [".venv", ".git", "tests", "runs", "docs", "helm", "examples", "stoker/__pycache__", "checkpoints"])
def test_build_context_leaves_out_local_state(ignore_rules: list[str], path: str) -> None:
    assert not dockerignore_allows(ignore_rules, path)


def test_dockerignore_matcher_follows_docker_semantics() -> None:
    """Guards the two tests above against a matcher that allows or refuses everything."""
    rules = ["*", "!src/", "**/__pycache__"]
    assert dockerignore_allows(rules, "src/app.py")
    assert not dockerignore_allows(rules, "src/__pycache__")
    assert not dockerignore_allows(rules, "notes.txt")


def build_context(repo: Path, rules: list[str], into: Path) -> int:
    """Copy what `docker build` would send (the repo filtered by .dockerignore) into ``into``."""
    reincluded = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    count = 0
    for directory, subdirs, files in os.walk(repo):
        relative_dir = Path(directory).relative_to(repo).as_posix()
        relative_dir = "" if relative_dir == "." else relative_dir + "/"
        # Prune folders that are excluded and hold nothing re-included (.git, .venv, runs/).
        subdirs[:] = [
            d for d in subdirs
            if dockerignore_allows(rules, relative_dir + d) or any(r.startswith(relative_dir + d + "/") for r in reincluded)
        ]
        for name in files:
            relative = relative_dir + name
            if dockerignore_allows(rules, relative):
                target = into / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(repo / relative, target)
                count += 1
    return count


def test_the_build_context_alone_builds_the_complete_package(repo: Path, ignore_rules: list[str], tmp_path: Path) -> None:
    """What the Dockerfiles' `pip install .` sees builds a wheel with every module and data file."""
    context = tmp_path / "context"
    assert build_context(repo, ignore_rules, context) > 0
    assert not (context / ".venv").exists() and not (context / "tests").exists()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(context)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("stoker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = set(archive.namelist())
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        prefix = package.replace(".", "/")
        for source in (repo / folder).glob("*.py"):
            assert f"{prefix}/{source.name}" in packaged, f"{prefix}/{source.name} is missing from the image's package"
    tasks = [p for p in (repo / "actor" / "tasks").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for task_file in tasks:
        assert "stoker/actor/tasks/" + task_file.relative_to(repo / "actor" / "tasks").as_posix() in packaged
