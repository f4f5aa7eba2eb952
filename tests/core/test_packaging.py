"""The built wheel: every module imports as stoker.*, nothing shadows the standard library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

IMPORT_ALL = r"""
import importlib, json, sys
mods = json.loads(sys.argv[1])
for name in mods:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.argv[2]), (name, module.__file__)
import operator
assert operator.__file__.startswith(sys.base_prefix) or 'site-packages' not in operator.__file__, operator.__file__
assert hasattr(operator, "itemgetter")
for bare in ("buffer", "actor", "learner", "v1"):
    try:
        importlib.import_module(bare)
    except ImportError:
        pass
    else:
        raise SystemExit(f"bare module {bare!r} is importable")
print(len(mods))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("stoker-*.whl")
    return path


def _modules(wheel: Path) -> list[str]:
    names = []
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("stoker/") and name.endswith(".py"):
                module = name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
                names.append(module)
    return sorted(names)


def test_wheel_maps_every_component_into_the_stoker_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist() if not name.startswith("stoker-")}
        names = set(archive.namelist())
    assert tops == {"stoker"}
    for package in ("stoker/buffer/", "stoker/learner/", "stoker/actor/", "stoker/operator/", "stoker/v1/"):
        assert f"{package}__init__.py" in names
    assert "stoker/v1/trajectory.proto" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        assert "stoker = stoker.cli:main" in archive.read(entry_points).decode()


def test_every_module_imports_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    modules = _modules(wheel)
    assert "stoker.operator" in modules and "stoker.v1.buffer_pb2_grpc" in modules
    # Run from an empty directory with only the wheel's copy first on the path: dependencies come
    # from this interpreter's site-packages, stoker itself must come from the wheel.
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(modules), str(target)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.strip()) == len(modules)


def test_cli_lists_every_subcommand_and_each_has_help() -> None:
    from stoker.cli import SUBCOMMANDS

    top = subprocess.run([sys.executable, "-m", "stoker.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    for name in ("run", "validate", "crd", "buffer", "actor", "learner", "operator"):
        assert name in SUBCOMMANDS and name in top.stdout
    for name in SUBCOMMANDS:
        sub = subprocess.run(
            [sys.executable, "-m", "stoker.cli", name, "--help"], capture_output=True, text=True, timeout=120
        )
        assert sub.returncode == 0, (name, sub.stderr)
        assert "usage: stoker " + name in sub.stdout
