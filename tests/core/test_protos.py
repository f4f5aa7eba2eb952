"""The committed stoker.v1 stubs are exactly what grpcio-tools generates from the .proto files."""

from __future__ import annotations

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
