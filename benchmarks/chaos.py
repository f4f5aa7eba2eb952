"""Chaos: kill -9 a child of a local run every N seconds and measure what the kills cost (issue 53).

    python benchmarks/chaos.py --kills 6 --interval 15 -- --target-success 0.9

runs ``stoker run examples/frozenlake.yaml`` (options after ``--`` go to it) and, once it trains,
kills a child every ``--interval`` seconds after the learner trained again since the previous kill: each of buffer,
learner and an actor once first (shuffled), then any. The learner dies while a checkpoint is being
written (Orbax's temporary folder in ``checkpoints/``), the buffer while Puts arrive (its log just
grew). Written to ``RUN_DIR/chaos.json`` and ``chaos.md``, the figures: acknowledged trajectories
lost, steps trained again per learner restart, the learner's longest stall after each kill, and
processes and sandboxes left behind. ``tests/core/test_chaos.py`` runs it small.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoker.buffer.core import BufferCore
from stoker.buffer.core_state import CHECKPOINT, CONSUME, PUT
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wal_format import SEGMENT_RE, read_segment
from stoker.manifest import load_job
from stoker.parent import PARENT_ENV
from stoker.procstat import proc_stat
from stoker.runner.report import read_jsonl
from stoker.v1 import buffer_pb2, trajectory_pb2

REPO = Path(__file__).resolve().parent.parent
ROLES = ("actor", "learner", "buffer")
POLL = 0.01  # seconds between looks at the run directory while waiting for a kill's moment


@dataclass
class Kill:
    role: str
    name: str  # the child: buffer, learner, actor-1
    at: float  # unix time of the SIGKILL
    moment: str  # what was under way: the checkpoint being written, how recently the log grew
    on_cue: bool  # that state was seen at the kill (else the wait for it ran out)
    restarted: bool = False
    checkpoint: int | None = None  # a learner kill: the newest complete checkpoint then (0: none)
    actor_put_retries: int = 0  # Puts the actors had to resend after it (the buffer's)


class WalLedger:
    """Every trajectory the buffer made durable (its log's PUT records, read while the run goes
    on, before compaction deletes consumed segments) and every consumption (CONSUME, CHECKPOINT)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.durable: dict[str, str] = {}  # episode id -> actor id
        self.consumed: dict[str, str] = {}  # episode id -> reason ("" from a checkpoint's list)
        self._seen: dict[Path, tuple[int, int]] = {}  # segment -> (mtime_ns, records read)
        self.grew_at = 0.0  # monotonic time the newest segment last changed

    def poll(self) -> None:
        paths = sorted(p for p in self.directory.glob("*.wal") if SEGMENT_RE.match(p.name)) if self.directory.exists() else []
        for path in paths:
            try:
                stamp = path.stat().st_mtime_ns
                if self._seen.get(path, (None, 0))[0] == stamp:
                    continue
                records, _, _ = read_segment(path.read_bytes(), str(path), 1 << 30)
            except FileNotFoundError:
                continue  # compacted away since the listing: its records were all consumed
            done = self._seen.get(path, (0, 0))[1]
            for kind, payload in records[done:]:
                self._record(kind, bytes(payload))
            self._seen[path] = (stamp, len(records))
            if path == paths[-1]:
                self.grew_at = time.monotonic()

    def _record(self, kind: int, payload: bytes) -> None:
        if kind == PUT:
            trajectory = trajectory_pb2.Trajectory.FromString(payload)
            self.durable[trajectory.episode_id] = trajectory.actor_id
        elif kind == CONSUME:
            consume = buffer_pb2.LogConsume.FromString(payload)
            self.consumed.update(dict.fromkeys(consume.episode_ids, consume.reason))
        elif kind == CHECKPOINT:
            for episode_id in buffer_pb2.LogCheckpoint.FromString(payload).consumed_episode_ids:
                self.consumed.setdefault(episode_id, "")


def child_pid(runner: int, role: str) -> int | None:
    """The pid of ``stoker run``'s child running ``stoker <role>`` (an actor: ``actor-0``), if any."""
    command, _, actor_id = role.partition("-")
    for pid in children(runner):
        words = cmdline(pid)
        if "stoker.cli" in words and command in words and (not actor_id or role in words):
            return pid
    return None


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def started(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells it from a later one with its pid."""
    try:
        return proc_stat(pid)[19]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def descendants(root: int) -> dict[int, tuple[str | None, bool]]:
    """Every process below ``root``: pid -> (start time, whether its parent is an actor: a sandbox)."""
    found: dict[int, tuple[str | None, bool]] = {}
    stack = [(root, False)]
    while stack:
        pid, parent_is_actor = stack.pop()
        for child in children(pid):
            found[child] = (started(child), parent_is_actor)
            stack.append((child, "actor" in cmdline(child) and "stoker.cli" in cmdline(child)))
    return found


def survivors(seen: dict[int, tuple[str | None, bool]], runner: int) -> tuple[list[int], list[int]]:
    """(processes, sandboxes) of the run still alive: those seen below it, and any process still
    carrying its ``STOKER_PARENT_PID`` (an orphan reparented before it was seen)."""
    alive = {pid for pid, (start, _) in seen.items() if start is not None and started(pid) == start}
    marker = f"{PARENT_ENV}={runner}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    alive.add(int(proc.name))
            except OSError:
                continue  # gone, or not ours to read
    return sorted(alive), sorted(pid for pid in alive if seen.get(pid, (None, False))[1])


@dataclass
class ChaosRun:
    """One ``stoker run`` under chaos; ``run`` it, then read ``figures``."""

    manifest: Path
    run_dir: Path
    options: Sequence[str] = ()
    kills: int = 3
    interval: float = 10.0
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
    done: list[Kill] = field(default_factory=list)
    acked: Counter[str] = field(default_factory=Counter)  # actor id -> acknowledged, over its processes
    returncode: int | None = None

    def run(self, timeout: float = 1800.0) -> dict[str, Any]:
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        (self.run_dir / "tmp").mkdir(parents=True)  # the sandboxes' temporary folders, to count leftovers
        self.stderr = self.run_dir / "stoker-run.stderr"
        command = [sys.executable, "-m", "stoker.cli", "run", str(self.manifest.resolve()), "--run-dir",
                   str(self.run_dir.resolve()), "--no-progress", *self.options]
        self.command = " ".join(command)
        env = {**os.environ, **self.env, "TMPDIR": str((self.run_dir / "tmp").resolve())}
        self.ledger = WalLedger(self.run_dir / "buffer")
        self.seen: dict[int, tuple[str | None, bool]] = {}
        with self.stderr.open("w") as err:
            self.runner = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.run_dir)
        self.deadline = time.monotonic() + timeout
        try:
            self._kill_all()
            while self.runner.poll() is None:
                self._look(0.2)
        finally:
            if self.runner.poll() is None:
                self.runner.send_signal(signal.SIGINT)
                self.runner.wait(120)
        self.returncode = self.runner.returncode
        self._read_acked()
        return self.figures()

    def _look(self, pause: float) -> None:
        """One round of watching: the log, the processes; then a pause (polling a file system)."""
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"stoker run still going after its time; its stderr: {self.stderr}")
        self.ledger.poll()
        self.seen.update(descendants(self.runner.pid))
        time.sleep(pause)

    def _until(self, ready: Callable[[], bool], most: float) -> bool:
        end = time.monotonic() + most
        while not ready():
            if self.runner.poll() is not None or time.monotonic() > end:
                return False
            self._look(POLL)
        return True

    def _kill_all(self) -> None:
        rng = random.Random(self.seed)
        plan = [*rng.sample(ROLES, len(ROLES)), *(rng.choice(ROLES) for _ in range(max(0, self.kills - len(ROLES))))]
        if not self._until(lambda: bool(read_jsonl(self.run_dir / "learner_metrics.jsonl")), 600):
            return
        for role in plan[: self.kills]:
            self._until(lambda: False, self.interval)  # the interval, watching the run meanwhile
            retries = self._put_retries()
            kill = self._kill(role, rng)
            if kill is None:
                return  # the run ended (its target reached) before this kill
            self.done.append(kill)
            restarted = f"stoker run: {kill.name} restarted (restart "
            kill.restarted = self._until(lambda: self.stderr.read_text().count(restarted) >= self._deaths(kill.name), 300)
            # The next kill once the learner trains again: each stall is then this kill's alone.
            self._until(lambda: any(s["time"] > kill.at for s in read_jsonl(self.run_dir / "learner_metrics.jsonl")), 300)
            kill.actor_put_retries = self._put_retries() - retries  # a buffer kill: Puts it cut short

    def _put_retries(self) -> int:
        """The actors' "buffer put failed" warnings so far (their logs span their restarts)."""
        return sum(log.read_text(errors="replace").count("buffer put failed") for log in (self.run_dir / "logs").glob("actor-*.log"))

    def _deaths(self, name: str) -> int:
        return sum(1 for k in self.done if k.name == name)

    def _kill(self, role: str, rng: random.Random) -> Kill | None:
        """Wait for the role's moment, then SIGKILL it; None if the run ended first."""
        if role == "actor":
            actors = sorted(w for pid in children(self.runner.pid) for w in cmdline(pid) if w.startswith("actor-"))
            name, moment, on_cue = (rng.choice(actors) if actors else "actor-0"), "episodes in flight", True
        elif role == "learner":
            name = "learner"
            folder = self.run_dir / "checkpoints"

            def temporary() -> dict[str, int]:  # Orbax writes into a temporary folder, renamed to the step once done
                return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.isdigit()} if folder.exists() else {}

            left = temporary()  # one an earlier learner died writing is no cue: a new or changed one is

            def writing() -> list[str]:
                return [name for name, stamp in temporary().items() if left.get(name) != stamp]

            on_cue = self._until(lambda: bool(writing()), 300)
            moment = f"checkpoint being written: {writing() or 'none seen (finished first)'}"
        else:
            name = "buffer"
            on_cue = self._until(lambda: time.monotonic() - self.ledger.grew_at < 2 * POLL, 120)
            moment = f"its log grew {1000 * (time.monotonic() - self.ledger.grew_at):.0f} ms before"
        pid = child_pid(self.runner.pid, name)
        if pid is None or self.runner.poll() is not None:
            return None
        for actor in (self.run_dir / "actors").glob("actor-*.json") if role == "actor" else ():
            if actor.stem == name:  # its count of acknowledged episodes, as near the kill as it wrote it
                self.acked[name] += _snapshot_episodes(actor)
        folder = self.run_dir / "checkpoints"
        complete = max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=0) if folder.exists() else 0
        os.kill(pid, signal.SIGKILL)
        self.say(f"chaos: killed {name} (pid {pid}): {moment}")
        return Kill(role, name, time.time(), moment, on_cue, checkpoint=complete if role == "learner" else None)

    def _read_acked(self) -> None:
        for path in (self.run_dir / "actors").glob("actor-*.json"):
            self.acked[path.stem] += _snapshot_episodes(path)  # the last processes, written as they stopped

    def figures(self) -> dict[str, Any]:
        processes, sandboxes = survivors(self.seen, self.runner.pid)
        left_dirs = sorted(p.name for p in (self.run_dir / "tmp").iterdir())
        steps = sorted(read_jsonl(self.run_dir / "learner_metrics.jsonl"), key=lambda r: r["time"])
        return {
            "command": self.command,
            "exit_code": self.returncode,
            "steps": steps[-1]["step"] if steps else 0,
            "final_success": steps[-1].get("success_rate") if steps else None,
            "kills": [asdict(k) | _after(k, steps, self.done) for k in self.done],
            "trajectories": account(self.run_dir, self.ledger, self.acked),
            "leftover_processes": processes,
            "leftover_sandbox_processes": sandboxes,
            "leftover_sandbox_dirs": left_dirs,
            # A checkpoint the learner died writing stays as Orbax's temporary folder.
            "leftover_checkpoint_tmp": sorted(p.name for p in (self.run_dir / "checkpoints").glob("*") if not p.name.isdigit()),
        }


def _snapshot_episodes(path: Path) -> int:
    try:
        return int(json.loads(path.read_text()).get("episodes", 0))
    except (OSError, ValueError):
        return 0


def _after(kill: Kill, steps: list[dict[str, Any]], kills: list[Kill]) -> dict[str, Any]:
    """The learner's longest stall from its last step before ``kill`` until the next kill, and for
    a learner kill the steps trained again (recorded before it, recorded again after)."""
    later = [k.at for k in kills if k.at > kill.at]
    until = min(later) if later else float("inf")
    before = [s for s in steps if s["time"] <= kill.at]
    after = [s for s in steps if kill.at < s["time"] < until]
    times = [before[-1]["time"]] if before else [kill.at]
    times += [s["time"] for s in after]
    stall = max((b - a for a, b in zip(times, times[1:])), default=None)
    out: dict[str, Any] = {"stall_seconds": None if stall is None else round(stall, 2)}
    if not after:
        out["stall_seconds"] = None  # no step before the next kill: unbounded here
    if kill.role == "learner" and before and after:
        out["restored_from"] = int(after[0]["step"] - 1)  # it trains the step after its checkpoint's first
        out["steps_lost"] = int(before[-1]["step"] - out["restored_from"])
    return out


def account(run_dir: Path, ledger: WalLedger, acked: Counter[str]) -> dict[str, Any]:
    """What became of every trajectory the buffer made durable, and of those the actors were told
    were stored: consumed (trained, or dropped by policy), held (replayed from the log now, as the
    buffer itself would), or lost."""
    ledger.poll()
    spec = load_job(next(iter(read_jsonl(run_dir / "runs.jsonl")))["manifest"]).spec
    with tempfile.TemporaryDirectory() as copy:  # replay a copy: opening compacts the log
        shutil.copytree(run_dir / "buffer", Path(copy) / "buffer")
        core = BufferCore(BufferSettings.from_spec(spec), Path(copy) / "buffer")
        logging.getLogger("stoker.buffer").setLevel(logging.WARNING)
        core.open()
        held = set(core.state.live)
        consumed = set(ledger.consumed) | {e for e in ledger.durable if e in core.state.consumed_episodes}
        core.close()
    lost = sorted(set(ledger.durable) - held - consumed)
    durable_by_actor = Counter(ledger.durable.values())
    unseen = {a: n - durable_by_actor[a] for a, n in acked.items() if n > durable_by_actor[a]}
    reasons = Counter(ledger.consumed[e] or "consumed" for e in ledger.durable if e in ledger.consumed)
    return {
        "acknowledged_lower_bound": sum(acked.values()),  # the actors' own counts (their last snapshots)
        "durable": len(ledger.durable),
        "held_at_end": len(held & set(ledger.durable)),
        "consumed": dict(reasons),
        "lost_durable": len(lost),
        "acknowledged_not_durable": sum(unseen.values()),
        "lost": len(lost) + sum(unseen.values()),
        "lost_examples": lost[:5],
    }


def markdown(figures: dict[str, Any]) -> str:
    t = figures["trajectories"]
    rows = [f"| {k['name']} | {k['moment']} | {k['stall_seconds']} | {k.get('steps_lost', '')} |" for k in figures["kills"]]
    return "\n".join([
        f"`{figures['command']}`: exit {figures['exit_code']}, {figures['steps']} steps, success {figures['final_success']}",
        "",
        "| killed | when | learner's longest stall after (s) | steps trained again |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Trajectories: {t['acknowledged_lower_bound']} acknowledged (actors' counts, at least), {t['durable']} durable "
        f"in the buffer's log, {t['held_at_end']} held at the end, consumed {t['consumed']}; lost: {t['lost']}.",
        f"Left behind: {len(figures['leftover_processes'])} processes, "
        f"{len(figures['leftover_sandbox_processes'])} sandbox processes, {len(figures['leftover_sandbox_dirs'])} sandbox folders.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "chaos")
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--interval", type=float, default=15.0, help="seconds from one child's restart to the next kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("options", nargs="*", help="options for stoker run (after --)")
    args = parser.parse_args()
    chaos = ChaosRun(args.manifest, args.run_dir, args.options, args.kills, args.interval, args.seed)
    figures = chaos.run()
    (args.run_dir / "chaos.json").write_text(json.dumps(figures, indent=1))
    (args.run_dir / "chaos.md").write_text(markdown(figures) + "\n")
    print(markdown(figures))


if __name__ == "__main__":
    main()
