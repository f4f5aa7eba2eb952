"""The ``stoker`` command line.

Each subcommand lives with its component, in a module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only dispatches. Component modules are imported only when their
subcommand runs, so ``stoker validate`` never pays for importing JAX.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from stoker import __version__
from stoker.manifest import ManifestError
from stoker.parent import stop_with_parent
from stoker.profile import profile_from_env

# subcommand -> (module providing add_arguments/main, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("stoker.runner.local", "run an RLJob manifest on this machine: buffer, actors and learner as local processes"),
    "validate": ("stoker.validate_cmd", "check RLJob manifests; exit 2 and one line per problem when invalid"),
    "explain": ("stoker.spec_reference", "describe an RLJob field (type, default, bounds, meaning): stoker explain spec.actors.sampling"),
    "crd": ("stoker.crd_cmd", "print (or write) the RLJob CustomResourceDefinition generated from the spec"),
    "buffer": ("stoker.buffer.cli", "serve the trajectory buffer (gRPC)"),
    "actor": ("stoker.actor.cli", "run an actor: episodes in sandboxes, trajectories to the buffer"),
    "rollout": ("stoker.rollout.cli", "serve generation to the actors (gRPC): continuous batching, weights from the learner"),
    "learner": ("stoker.learner.cli", "run the learner: pull batches, train, publish weights"),
    "operator": ("stoker.operator.cli", "run the Kubernetes operator (kopf) that reconciles RLJobs"),
    "sandbox": ("stoker.actor.sandbox_check", "check that a sandbox server keeps the stoker.v1.Sandbox contract"),
    "export": ("stoker.learner.export", "write a run's newest policy (or a checkpoint) as a Hugging Face-format directory"),
    "import": ("stoker.learner.import_gguf", "write a GGUF file (llama.cpp, Ollama) as a Hugging Face-format directory"),
    "audit": ("stoker.sizing.audit", "measure latencies and size the actor pool that keeps the learner fed"),
    "plan": ("stoker.sizing.plan", "compile the job's programs for its TPU slices: per-chip memory, fits or not, speed bound"),
    "bench": ("stoker.sizing.bench", "run the job's programs on this host's devices: seconds, tokens/s, MFU, peak memory beside the plan"),
}


class NotReady(Exception):
    """A subcommand whose component is not built yet."""


def _load(module_name: str) -> Any:
    """The subcommand's module; typed Any because each provides add_arguments/main by convention."""
    return importlib.import_module(module_name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    stop_with_parent()
    profile_from_env(args.command)  # stoker run --profile: each child samples its own stacks
    try:
        return int(_load(args._module).main(args) or 0)
    except NotReady as exc:
        print(f"stoker {args.command}: {exc}", file=sys.stderr)
        return 3
    except ManifestError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stoker {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; only the subcommand named first in ``argv`` gets its arguments loaded."""
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Decoupled, asynchronous agentic reinforcement learning on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module_name)
        if name == wanted:
            _load(module_name).add_arguments(command)
    return parser


if __name__ == "__main__":
    sys.exit(main())
