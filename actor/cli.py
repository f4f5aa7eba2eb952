"""``stoker actor``: command-line entry point."""

from __future__ import annotations

import argparse

from stoker.cli import NotReady


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def main(args: argparse.Namespace) -> int:
    raise NotReady("not available yet in this version")
