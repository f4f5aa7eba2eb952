"""``stoker validate FILE...``: exit 0 when every manifest is valid, else 2 and one line per problem."""

from __future__ import annotations

import argparse
import sys

from stoker.manifest import add_manifest_directory, load_file
from stoker.actor.job_checks import environment_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="RLJob manifests (YAML, one or many documents)")


def main(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        jobs, problems = load_file(path)
        if jobs:
            add_manifest_directory(path)
        for job in jobs:
            problems += environment_problems(job, path)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed = True
        else:
            names = ", ".join(job.metadata.name for job in jobs)
            print(f"{path}: valid ({len(jobs)} RLJob{'s' if len(jobs) != 1 else ''}: {names})")
    return 2 if failed else 0
