"""``stoker run``: an RLJob on this machine, with no cluster.

``--mode async`` (the default) starts the same processes a cluster would run -- the buffer, the
learner and the actors (``spec.actors.replicas``, or as many as the cores feed) -- as local
subprocesses talking gRPC, and supervises them: a live progress display, a run directory with
metrics and checkpoints, a report at the end, and a clean stop on completion, on error and on
Ctrl-C (learner first so it writes its final checkpoint, then actors with their sandboxes, then
the buffer).

``--mode sync`` runs the classic synchronous loop in this process (generate, step environments,
train, repeat) with the same model and environment: the on-policy baseline.

Running again with the same ``--run-dir`` resumes: the learner restores its latest checkpoint and
the buffer replays its log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stoker.actor.job_checks import environment_problems
from stoker.endpoints import ready_address
from stoker.manifest import ManifestError, add_manifest_directory, load_job
from stoker.parent import PARENT_ENV
from stoker.remote_checkpoint import LEARNER
from stoker.runner.placement import TRANSPORTS, UNIX, Placement, PlacementError, jax_process_envs, plan
from stoker.runner.children import STOP_GRACE_SECONDS, Child, terminate_on_signals, wait_for_ready_file
from stoker.runner.progress import Progress
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
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live display")


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
    )


def main(args: argparse.Namespace) -> int:
    try:
        options = resolve_options(args)
    except UsageError as exc:
        print(f"stoker run: {exc}", file=sys.stderr)
        return 2
    options.run_dir.mkdir(parents=True, exist_ok=True)
    options.logs_dir.mkdir(exist_ok=True)
    _write_run_record(options)
    if options.mode == "sync":
        # The sync loop trains in this process: JAX. An async run's parent only supervises its
        # children and never imports it.
        from stoker.runner.sync import run_sync

        outcome = run_sync(options)
    else:
        outcome = run_async(options)
    # matplotlib takes ~0.4 s to import: not for `stoker run --help` or a bad flag.
    from stoker.runner.report import write_report

    failed = outcome.exit_code not in (0, 130)  # 130: interrupted, its report is what it did so far
    report = write_report(options.run_dir, failure=outcome.message if failed else None)
    where = f"report: {report}" if report is not None else f"no report: nothing was trained; logs in {options.logs_dir}"
    print(f"{outcome.message}\n{where}", file=sys.stderr)
    return outcome.exit_code


def _write_run_record(options: RunOptions) -> None:
    record = {
        "manifest": str(options.manifest),
        "mode": options.mode,
        "started_unix": time.time(),
        "spec": options.job.spec.model_dump(by_alias=True, mode="json"),
    }
    with (options.run_dir / "runs.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------------ supervision


@dataclass
class Outcome:
    exit_code: int
    message: str


def _stoker(*args: str) -> list[str]:
    return [sys.executable, "-m", "stoker.cli", *args]


@dataclass
class AsyncRun:
    options: RunOptions
    buffer: Child | None = None
    learners: list[Child] = field(default_factory=list)  # process 0 (the primary) first
    actors: list[Child] = field(default_factory=list)
    rollout: Child | None = None  # with spec.rollout: one generation server the actors call
    rollout_followers: list[Child] = field(default_factory=list)  # its other processes (--rollout-processes)
    placement: Placement = field(default_factory=lambda: Placement(UNIX, None))  # set by start

    @property
    def learner(self) -> Child | None:
        return self.learners[0] if self.learners else None

    def children(self) -> list[Child]:
        return [
            c for c in (*self.learners, *self.actors, self.rollout, *self.rollout_followers, self.buffer) if c is not None
        ]

    def start(self, env: dict[str, str]) -> str | None:
        """Start the children; the buffer's address, or None for a job that trains on a dataset
        file (SFT, DPO on pairs) or runs colocated: then the learner runs alone, with no buffer or
        actors."""
        o = self.options
        self.placement = plan(o.run_dir, o.job.spec, transport=o.transport, learner_processes=o.learner_processes,
                              rollout_processes=o.rollout_processes if o.job.spec.rollout is not None else 0)
        print(self.placement.describe(), file=sys.stderr)
        cpu_env = {**env, **self.placement.cpu_only_env}  # every child but the learner
        manifest = str(o.manifest)
        # Alone: a job that trains on a dataset file, or one whose learner plays its own episodes
        # (mode: colocated: one process samples and trains on the same chips, runner/sync.py).
        alone = o.job.spec.algorithm.trains_on_dataset or o.job.spec.mode == "colocated"
        if o.job.spec.mode == "colocated":
            print("stoker run: mode colocated: the learner's process plays the episodes and samples on its own devices",
                  file=sys.stderr)
        address = None if alone else self._serve("buffer", cpu_env, "--data-dir", str(o.run_dir / "buffer"))
        learner_argv = _stoker(
            "learner",
            "--manifest", manifest,
            *(("--buffer", address) if address is not None else ()),
            "--run-dir", str(o.run_dir),
            "--weights-dir", str(o.weights_dir),
        )
        if o.max_steps is not None:
            learner_argv += ["--max-steps", str(o.max_steps)]
        for index, learner_env in enumerate(jax_process_envs(env, o.learner_processes, o.learner_devices)):
            name, log_name = ("learner", "learner.log") if index == 0 else (f"learner-{index}", f"learner-{index}.log")
            learner = Child(name, learner_argv, o.logs_dir / log_name)
            learner.start(learner_env)
            self.learners.append(learner)
        if address is None:
            return None
        sampling = ["--weights", str(o.weights_dir)]
        if o.job.spec.rollout is not None:
            sampling = ["--rollout", self._start_rollout(cpu_env)]
        for index in range(self.placement.actors.replicas):
            actor = Child(
                f"actor-{index}",
                _stoker(
                    "actor",
                    "--manifest", manifest,
                    "--buffer", address,
                    *sampling,
                    "--actor-id", f"actor-{index}",
                    "--stats-file", str(o.actor_stats_dir / f"actor-{index}.json"),
                ),
                o.logs_dir / f"actor-{index}.log",
            )
            actor.start(cpu_env)
            self.actors.append(actor)
        return address

    def _start_rollout(self, env: dict[str, str]) -> str:
        """One ``stoker rollout`` on loopback following the learner's weights (over
        ``--rollout-processes`` JAX processes, process 0 serving); its address."""
        o = self.options
        envs = jax_process_envs(env, o.rollout_processes, 1)
        weights = ("--weights", str(o.weights_dir))
        for index, follower_env in enumerate(envs[1:], start=1):
            follower = Child(
                f"rollout-{index}",
                _stoker("rollout", "--manifest", str(o.manifest), *weights, *self.placement.listen(f"rollout-{index}")),
                o.logs_dir / f"rollout-{index}.log",
            )
            follower.start(follower_env)
            self.rollout_followers.append(follower)
        return self._serve("rollout", envs[0], *weights)

    def _serve(self, command: str, env: dict[str, str], *args: str) -> str:
        """Start a ``stoker COMMAND`` server where the placement says (a unix socket, or a free
        loopback port) as ``self.<command>`` (set before it is ready, so a failed start is still
        stopped); its address once ready."""
        o = self.options
        ready = o.run_dir / f"{command}.ready"
        ready.unlink(missing_ok=True)
        child = Child(
            command,
            _stoker(
                command, "--manifest", str(o.manifest), *args,
                *self.placement.listen(command), "--ready-file", str(ready),
            ),
            o.logs_dir / f"{command}.log",
        )
        setattr(self, command, child)
        child.start(env)
        return ready_address(wait_for_ready_file(ready, child))  # the file holds the port or the socket

    def stop(self) -> None:
        # Learner first (final checkpoint), then actors (and their sandboxes), the buffer last so
        # in-flight Puts still land. The actors stop together: one grace period for all of them.
        # Every learner process at once: they agree on the stop and checkpoint together.
        for learner in self.learners:
            learner.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for learner in self.learners:
            learner.finish(max(0.0, deadline - time.monotonic()))
        for actor in self.actors:
            actor.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for actor in self.actors:
            actor.finish(max(0.0, deadline - time.monotonic()))
        if self.rollout is not None:
            self.rollout.stop()  # its other processes stop when it does
        for follower in self.rollout_followers:
            follower.finish(STOP_GRACE_SECONDS)
        if self.buffer is not None:
            self.buffer.stop()

    def failed_child(self) -> Child | None:
        for child in self.children():
            code = child.returncode
            if code is not None and code != 0:
                return child
            if code == 0 and child not in self.learners:
                return child  # only the learner is expected to finish
        return None


# Where compiled XLA programs persist between local runs when the spec names no cache: the second
# run of a job (and every actor after the first) then skips compilation.
DEFAULT_COMPILATION_CACHE = Path.home() / ".cache" / "stoker" / "jax"


def compilation_cache_dir(options: RunOptions) -> str:
    """The spec's cache, else the one JAX_COMPILATION_CACHE_DIR names (as JAX reads it in the
    children), else the default: the sync run's in-process learner uses the same one."""
    return (options.job.spec.learner.compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
            or str(DEFAULT_COMPILATION_CACHE))


def child_env(options: RunOptions) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[PARENT_ENV] = str(os.getpid())  # children stop if this process is killed (stoker.parent)
    # Plugins beside the manifest (module:function) import in the actors as they did in validation.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(options.manifest.parent), env.get("PYTHONPATH")) if p)
    # JAX reads these itself, so the learner, the actors and their samplers all share the cache.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", compilation_cache_dir(options))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def run_async(options: RunOptions) -> Outcome:
    run = AsyncRun(options)
    deadline = time.monotonic() + options.max_minutes * 60 if options.max_minutes else None
    with terminate_on_signals(), Progress(options) as progress:
        try:
            address = run.start(child_env(options))
            if address is not None:
                progress.attach_buffer(address, run.placement)
            while True:
                progress.refresh()
                if run.learners and all(learner.returncode == 0 for learner in run.learners):
                    return Outcome(0, f"done: learner finished ({progress.summary()})")
                failed = run.failed_child()
                if failed is not None:
                    return Outcome(
                        1,
                        f"{failed.name} exited with code {failed.returncode}; stopping the run.\n"
                        f"last lines of {failed.log_path}:\n{failed.tail()}",
                    )
                if options.target_success is not None and progress.reached(options.target_success):
                    return Outcome(0, f"done: success rate reached {options.target_success} ({progress.summary()})")
                if deadline is not None and time.monotonic() > deadline:
                    return Outcome(0, f"stopped after {options.max_minutes} minutes ({progress.summary()})")
                assert run.learner is not None
                run.learner.wait(0.5)
        except KeyboardInterrupt:
            return Outcome(130, f"interrupted; checkpoint and buffer kept in {options.run_dir} ({progress.summary()})")
        except (UsageError, PlacementError) as exc:
            return Outcome(2, f"stoker run: {exc}")
        except RuntimeError as exc:
            return Outcome(1, str(exc))
        finally:
            progress.stop_display()
            run.stop()
