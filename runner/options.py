"""What ``stoker run`` takes on its command line, and the options it resolves from it once."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from stoker.actor.job_checks import environment_problems
from stoker.manifest import ManifestError, add_manifest_directory, load_job
from stoker.remote_checkpoint import LEARNER
from stoker.runner.placement import TRANSPORTS, UNIX
from stoker.runner.supervise import RestartPolicy
from stoker.spec import RLJob


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="RLJob manifest")
    parser.add_argument(
        "--mode",
        choices=("async", "sync"),
        default="async",
        help="async: buffer, actors and learner as processes (default); sync: the synchronous baseline loop",
    )
    parser.add_argument("--run-dir", type=Path, help="run directory (default: runs/<job name>); reused to resume")
    parser.add_argument("--max-minutes", type=float, help="stop after this much wall-clock time")
    parser.add_argument(
        "--target-success",
        type=float,
        help="stop once the rolling success rate reaches this value (e.g. 0.9)",
    )
    parser.add_argument("--max-steps", type=int, help="override spec.learner.maxSteps")
    parser.add_argument(
        "--learner-processes",
        type=int,
        default=1,
        metavar="N",
        help="run the learner as N JAX processes on loopback (jax.distributed, gloo), as on a multi-host slice",
    )
    parser.add_argument(
        "--learner-devices",
        type=int,
        default=1,
        metavar="D",
        help="CPU devices per learner process (--xla_force_host_platform_device_count) with --learner-processes",
    )
    parser.add_argument(
        "--rollout-processes",
        type=int,
        default=1,
        metavar="N",
        help="run the rollout server (spec.rollout) as N JAX processes on loopback, one mesh over all, as on a multi-host slice",
    )
    parser.add_argument(
        "--transport", choices=TRANSPORTS, default=UNIX,
        help="how the local processes talk: unix sockets in the run directory (default; no ports, works where "
        "inet sockets are refused) or tcp on loopback ports",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=RestartPolicy.max_restarts, metavar="N",
        help="restart a child that dies (after 1 s, doubling to 30 s) up to N times within 10 minutes; "
        "one more death stops the run (0: the first one does)",
    )
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live display")
    parser.add_argument(
        "--profile", action="store_true",
        help="sample every process's Python stacks 100 times a second (wall time, per thread) into "
        "RUN_DIR/profiles/<command>-<pid>.txt: where actors, buffer and learner spend or wait their time",
    )


@dataclass
class RunOptions:
    """What ``stoker run`` was asked to do, resolved once."""

    manifest: Path
    job: RLJob
    mode: str
    run_dir: Path
    max_minutes: float | None = None
    target_success: float | None = None
    max_steps: int | None = None
    live: bool = True
    learner_processes: int = 1
    learner_devices: int = 1
    rollout_processes: int = 1
    transport: str = UNIX
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    profile: bool = False

    @property
    def profiles_dir(self) -> Path:
        """``--profile``'s stack samples, a file per process (``stoker.profile``)."""
        return self.run_dir / "profiles"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "learner_metrics.jsonl"

    @property
    def weights_dir(self) -> Path:
        return self.run_dir / "weights"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def actor_stats_dir(self) -> Path:
        """Each actor's generation and failure snapshot (``stoker.actor.diagnostics``)."""
        return self.run_dir / "actors"


class UsageError(ValueError):
    """A command-line option that cannot work; the message says why."""


def resolve_options(args: argparse.Namespace) -> RunOptions:
    processes, devices = getattr(args, "learner_processes", 1), getattr(args, "learner_devices", 1)
    if processes < 1 or devices < 1:
        raise UsageError(f"--learner-processes {processes} --learner-devices {devices}; both must be >= 1")
    if processes > 1 and args.mode == "sync":
        raise UsageError("--learner-processes applies to --mode async (the sync baseline trains in this process)")
    rollout_processes = getattr(args, "rollout_processes", 1)
    max_restarts = getattr(args, "max_restarts", RestartPolicy.max_restarts)
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts}; expected >= 0")
    if rollout_processes < 1:
        raise UsageError(f"--rollout-processes {rollout_processes}; expected >= 1")
    job = load_job(args.file, fetch=LEARNER)  # gs:// checkpoints: fetched once here; the children find them cached
    if rollout_processes > 1 and (job.spec.rollout is None or args.mode == "sync"):
        raise UsageError("--rollout-processes needs spec.rollout and --mode async (a rollout server to split)")
    if job.spec.algorithm.trains_on_dataset and args.mode == "sync":
        raise UsageError("--mode sync plays episodes; a job that trains on a dataset file (sft, dpo on dpoDataset) has none")
    add_manifest_directory(args.file)  # plugins beside the manifest import here and in the children
    problems = environment_problems(job, str(args.file), local=True)
    if problems:
        raise ManifestError(problems)  # before any process starts: a bad plugin is a start-up error
    run_dir = args.run_dir or Path("runs") / job.metadata.name
    return RunOptions(
        manifest=Path(args.file).resolve(),
        job=job,
        mode=args.mode,
        run_dir=run_dir.resolve(),
        max_minutes=args.max_minutes,
        target_success=args.target_success,
        max_steps=args.max_steps,
        live=not args.no_progress and sys.stderr.isatty(),
        learner_processes=processes,
        learner_devices=devices,
        rollout_processes=rollout_processes,
        transport=getattr(args, "transport", UNIX),
        restarts=RestartPolicy(max_restarts=max_restarts),
        profile=getattr(args, "profile", False),
    )
