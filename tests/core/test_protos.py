"""The committed stoker.v1 stubs are exactly what grpcio-tools generates from the .proto files."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from stoker.protogen import PROTO_ROOT, generate


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    committed_dir = PROTO_ROOT / "stoker" / "v1"
    stale = [p.name for p in fresh if (committed_dir / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python -m stoker.protogen`"
    extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not extra, f"stubs without a .proto: {extra}"


def test_wire_contract_is_versioned() -> None:
    from stoker.v1 import buffer_pb2, trajectory_pb2

    assert trajectory_pb2.DESCRIPTOR.package == "stoker.v1"
    assert "Buffer" in buffer_pb2.DESCRIPTOR.services_by_name


def _floor(requirement: str) -> tuple[int, ...]:
    """The version after ``>=`` or ``==`` in a pyproject requirement, as a tuple of ints."""
    match = re.search(r"(?:>=|==)\s*([0-9.]+)", requirement)
    assert match, f"{requirement!r} states no lower bound"
    return tuple(int(part) for part in match.group(1).split("."))


def test_the_declared_runtime_floors_admit_only_versions_the_committed_stubs_import_under() -> None:
    # The stubs refuse to import under an older grpcio / protobuf than the generator's own; a
    # user whose resolver picks the declared floor must not meet that RuntimeError.
    project = tomllib.loads((PROTO_ROOT.parent / "pyproject.toml").read_text())
    requirements = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0]: r for r in project["project"]["dependencies"]}
    stub_dir = PROTO_ROOT / "stoker" / "v1"
    grpc_stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (stub_dir / "buffer_pb2_grpc.py").read_text())
    protobuf_stamp = re.search(
        r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", (stub_dir / "buffer_pb2.py").read_text()
    )
    assert grpc_stamp and protobuf_stamp
    assert _floor(requirements["grpcio"]) >= tuple(int(p) for p in grpc_stamp.group(1).split("."))
    assert _floor(requirements["protobuf"]) >= tuple(int(p) for p in protobuf_stamp.groups())
