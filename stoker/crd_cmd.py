"""``stoker crd [--write]``: the CRD generated from the spec, to stdout or to crds/rljob.yaml."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stoker.crd import CRD_PATH, render_crd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--write",
        nargs="?",
        const=str(CRD_PATH),
        metavar="PATH",
        help=f"write the CRD to PATH instead of stdout (default PATH: {CRD_PATH})",
    )


def main(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
