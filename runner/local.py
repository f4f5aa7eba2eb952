"""``stoker run``: an RLJob on this machine, with no cluster.

``--mode async`` (the default) starts the same processes a cluster would run -- the buffer, the
learner and the actors (``spec.actors.replicas``, or as many as the cores feed) -- as local
subprocesses talking gRPC, and supervises them: a child that dies is restarted within a budget
(``runner/supervise.py``), a live progress display, a run directory with metrics and checkpoints, a
report at the end, and a clean stop on completion, on error and on Ctrl-C (learner first so it
writes its final checkpoint, then actors with their sandboxes, then the buffer).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stoker.endpoints import ready_address
from stoker.parent import PARENT_ENV
from stoker.profile import PROFILE_ENV, StackSampler
from stoker.runner.children import STOP_GRACE_SECONDS, Child, terminate_on_signals, wait_for_ready_file
from stoker.learner.diskfull import no_space
from stoker.runner.diskfull import EXIT_DISK_FULL, DiskFull, disk_full_error, is_no_space, seal_torn_lines
from stoker.runner.options import RunOptions, UsageError, add_arguments, resolve_options
from stoker.runner.placement import UNIX, Placement, PlacementError, jax_process_envs, plan
from stoker.runner.progress import Progress
from stoker.runner.supervise import Supervisor, Unit, pin_port

__all__ = [
    "DEFAULT_COMPILATION_CACHE", "AsyncRun", "Outcome", "RunOptions", "UsageError", "add_arguments", "child_env",
    "compilation_cache_dir", "main", "resolve_options", "run_async",
]


def main(args: argparse.Namespace) -> int:
    try:
        options = resolve_options(args)
    except UsageError as exc:
        print(f"stoker run: {exc}", file=sys.stderr)
        return 2
    options.run_dir.mkdir(parents=True, exist_ok=True)
    options.logs_dir.mkdir(exist_ok=True)
    # This process too: with --mode sync it is the learner and the actors.
    sampler = StackSampler(options.profiles_dir / f"run-{os.getpid()}.txt", "stoker run").start() if options.profile else None
    outcome = _run(options)
    if sampler is not None:
        sampler.stop()
        print(f"profiles: {options.profiles_dir}", file=sys.stderr)
    if outcome.exit_code == EXIT_DISK_FULL:
        # A report now would take what little space is left and come out torn; the resumed run writes it.
        print(f"stoker run: {outcome.message}\nno report: the disk is full", file=sys.stderr)
        return outcome.exit_code
    # matplotlib takes ~0.4 s to import: not for `stoker run --help` or a bad flag.
    from stoker.runner.report import write_report

    failed = outcome.exit_code not in (0, 130)  # 130: interrupted, its report is what it did so far
    report = write_report(options.run_dir, failure=outcome.message if failed else None)
    where = f"report: {report}" if report is not None else f"no report: nothing was trained; logs in {options.logs_dir}"
    print(f"{outcome.message}\n{where}", file=sys.stderr)
    return outcome.exit_code


def _run(options: RunOptions) -> Outcome:
    """The run in its mode; a write of this process's own that finds the disk full ends it as
    ``EXIT_DISK_FULL`` (the children's such deaths are the supervisor's to see)."""
    try:
        # A resume appends to what a full disk (or a kill) may have cut mid-line.
        seal_torn_lines(options.metrics_path, options.run_dir / "buffer_stats.jsonl", options.run_dir / "samples.jsonl")
        _write_run_record(options)
        if options.mode == "sync":
            # The sync loop trains in this process: JAX. An async run's parent only supervises its
            # children and never imports it.
            from stoker.runner.sync import run_sync

            return run_sync(options)
        return run_async(options)
    except DiskFull as exc:
        return Outcome(EXIT_DISK_FULL, str(exc))
    except (OSError, RuntimeError, ValueError) as exc:  # the sync loop's checkpoints: tensorstore wraps the OSError
        full = no_space(exc)
        if full is None:
            raise
        return Outcome(EXIT_DISK_FULL, str(disk_full_error(None, full, options.run_dir)))


def _write_run_record(options: RunOptions) -> None:
    record = {
        "manifest": str(options.manifest),
        "mode": options.mode,
        "started_unix": time.time(),
        "spec": options.job.spec.model_dump(by_alias=True, mode="json"),
    }
    path = options.run_dir / "runs.jsonl"
    try:
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")
    except OSError as exc:
        if not is_no_space(exc):
            raise
        raise disk_full_error(path, exc, options.run_dir) from exc


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
    units: list[Unit] = field(default_factory=list)  # what restarts together when one of it dies

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
        def learner_envs() -> list[dict[str, str]]:
            return jax_process_envs(env, o.learner_processes, o.learner_devices)

        for index, learner_env in enumerate(learner_envs()):
            name, log_name = ("learner", "learner.log") if index == 0 else (f"learner-{index}", f"learner-{index}.log")
            learner = Child(name, learner_argv, o.logs_dir / log_name)
            learner.start(learner_env)
            self.learners.append(learner)
        self.units.append(Unit("learner", self.learners, learner_envs, may_finish=True))
        if address is None:
            return None
        sampling = ["--weights", str(o.weights_dir)]
        actor_env = cpu_env
        if o.job.spec.rollout is not None:
            sampling = ["--rollout", self._start_rollout(cpu_env)]
        else:
            actor_env = self.placement.actor_env(cpu_env)
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
            actor.start(actor_env)
            self.actors.append(actor)
            self.units.append(Unit(actor.name, [actor], lambda: [actor_env]))
        return address

    def _start_rollout(self, env: dict[str, str]) -> str:
        """One ``stoker rollout`` on loopback following the learner's weights (over
        ``--rollout-processes`` JAX processes, process 0 serving); its address."""
        o = self.options

        def followers_first() -> list[dict[str, str]]:  # the unit's order: process 0 serves, started last
            envs = jax_process_envs(env, o.rollout_processes, 1)
            return [*envs[1:], envs[0]]

        envs = followers_first()
        weights = ("--weights", str(o.weights_dir))
        for index, follower_env in enumerate(envs[:-1], start=1):
            follower = Child(
                f"rollout-{index}",
                _stoker("rollout", "--manifest", str(o.manifest), *weights, *self.placement.listen(f"rollout-{index}")),
                o.logs_dir / f"rollout-{index}.log",
            )
            follower.start(follower_env)
            self.rollout_followers.append(follower)
        return self._serve("rollout", envs[-1], *weights, unit_envs=followers_first, peers=self.rollout_followers)

    def _serve(
        self, command: str, env: dict[str, str], *args: str,
        unit_envs: Callable[[], list[dict[str, str]]] | None = None, peers: list[Child] | None = None,
    ) -> str:
        """Start a ``stoker COMMAND`` server where the placement says (a unix socket, or a free
        loopback port) as ``self.<command>`` (set before it is ready, so a failed start is still
        stopped); its address once ready. It restarts with ``peers`` (started before it, each
        with its environment from ``unit_envs``) on the same socket or port."""
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
        address = ready_address(wait_for_ready_file(ready, child))  # the file holds the port or the socket
        child.argv = pin_port(child.argv, address)
        self.units.append(Unit(command, [*(peers or ()), child], unit_envs or (lambda: [env]), ready=(ready, child)))
        return address

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
    if options.profile:
        env[PROFILE_ENV] = str(options.profiles_dir)
    return env


def run_async(options: RunOptions) -> Outcome:
    run = AsyncRun(options)
    deadline = time.monotonic() + options.max_minutes * 60 if options.max_minutes else None
    with terminate_on_signals(), Progress(options) as progress:
        supervisor = Supervisor(options.restarts, run.units, say=progress.note, run_dir=options.run_dir)
        try:
            address = run.start(child_env(options))
            if address is not None:
                progress.attach_buffer(address, run.placement)
            while True:
                progress.refresh()
                if run.learners and all(learner.returncode == 0 for learner in run.learners):
                    return Outcome(0, f"done: learner finished ({progress.summary()}){supervisor.summary()}")
                spent = supervisor.check()  # restarts what died, within its budget
                if spent is not None:
                    return Outcome(1, spent)
                if options.target_success is not None and progress.reached(options.target_success):
                    done = f"done: success rate reached {options.target_success}"
                    return Outcome(0, f"{done} ({progress.summary()}){supervisor.summary()}")
                if deadline is not None and time.monotonic() > deadline:
                    done = f"stopped after {options.max_minutes} minutes"
                    return Outcome(0, f"{done} ({progress.summary()}){supervisor.summary()}")
                assert run.learner is not None
                supervisor.wait(run.learner, 0.5)
        except KeyboardInterrupt:
            kept = f"interrupted; checkpoint and buffer kept in {options.run_dir}"
            return Outcome(130, f"{kept} ({progress.summary()}){supervisor.summary()}")
        except DiskFull as exc:  # a child's death, or the progress's own write (stopped below, before the children)
            return Outcome(EXIT_DISK_FULL, f"{exc}{supervisor.summary()}")
        except (UsageError, PlacementError) as exc:
            return Outcome(2, f"stoker run: {exc}")
        except RuntimeError as exc:
            return Outcome(1, str(exc))
        finally:
            progress.stop_display()
            run.stop()
