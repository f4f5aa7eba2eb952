"""``stoker audit``: latency audit and actor-pool sizing."""

from __future__ import annotations

import argparse

from stoker.cli import NotReady


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="RLJob manifest")


def main(args: argparse.Namespace) -> int:
    raise NotReady("not available yet in this version")
