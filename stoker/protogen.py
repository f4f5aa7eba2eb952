"""Regenerate the ``stoker.v1`` stubs from ``protos/stoker/v1/*.proto`` (needs the dev extra).

    python -m stoker.protogen            # write the stubs beside the .proto files
    python -m stoker.protogen --out DIR  # write them elsewhere (the staleness test does this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) on every .proto; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "stoker" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_dir / "stoker" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
