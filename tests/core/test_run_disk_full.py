"""A disk that fills mid-run stops ``stoker run`` with one clear error and nothing corrupted
(issue 53): no restart loop, no traceback, the last complete checkpoint restores and the buffer's
log replays once space is freed and the same command runs again.

The end-to-end run fills a small tmpfs holding the run directory (skipped where one cannot be
mounted, as tests/buffer/test_disk_full.py); the rest make real ENOSPC writes to ``/dev/full``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.learner.diskfull import EXIT_DISK_FULL, no_space
from stoker.runner.children import Child
from stoker.runner.diskfull import DiskFull, seal_torn_lines
from stoker.runner.supervise import RestartPolicy, Supervisor, Unit

VOLUME_BYTES = 64 << 20
FULL = Path("/dev/full")  # every write to it fails with ENOSPC
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")


@pytest.fixture
def volume(tmpfs: Callable[[int], Path]) -> Path:
    """A 64 MiB tmpfs mounted for the test: room for the tiny job's run, and quick to fill."""
    return tmpfs(VOLUME_BYTES)


def _fill(volume: Path) -> Path:
    """Take every byte left on ``volume``; the ballast file, to delete to free the space."""
    ballast = volume / "ballast"
    with ballast.open("ab", buffering=0) as out:
        for size in (1 << 20, 64 << 10, 4 << 10, 512, 1):
            try:
                while True:
                    out.write(bytes(size))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return ballast


def _checkpoints(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (Orbax renames a finished one to its step)."""
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


def _records(path: Path) -> tuple[list[dict[str, float]], int]:
    """The whole JSON records of a JSONL file, and how many lines are not one."""
    records, torn = [], 0
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    return records, torn


def _run(manifest: Path, run_dir: Path, max_steps: int, env: dict[str, str], stderr: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress",
         "--max-steps", str(max_steps)],
        stdout=subprocess.DEVNULL, stderr=stderr.open("w"), text=True, env={**os.environ, **env},
    )


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_it_clearly_and_the_run_resumes_once_space_is_freed(
    tmp_path: Path, volume: Path, tiny_job: str, jax_cache_env: dict[str, str]
) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_job)
    run_dir = volume / "run"
    first = tmp_path / "first.txt"
    runner = _run(manifest, run_dir, 1000, jax_cache_env, first)
    try:
        deadline = time.monotonic() + 120
        while len(_checkpoints(run_dir)) < 2:  # polling the run directory for progress
            assert runner.poll() is None, first.read_text()[-4000:]
            assert time.monotonic() < deadline, "no two checkpoints within 120 s"
            time.sleep(0.2)
        ballast = _fill(volume)
        runner.wait(timeout=90)
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(timeout=60)
    said = first.read_text()
    assert runner.returncode == EXIT_DISK_FULL, said[-4000:]
    # One message naming the run directory, its filesystem and what to do; nothing restarted.
    assert f"stoker run: the disk is full in {run_dir} (" in said, said[-4000:]
    assert f"bytes free on {volume})" in said
    assert "could not write" in said or "learner died for want of space" in said  # the runner's write or the learner's
    assert f"Free space on {volume} and run the same command again" in said
    assert "no report: the disk is full" in said
    assert "; restarting" not in said and " restarted" not in said and "Traceback" not in said, said[-4000:]
    complete = _checkpoints(run_dir)
    assert complete, "the full disk took the complete checkpoints with it"

    ballast.unlink()
    second = tmp_path / "second.txt"
    target = complete[-1] + 3
    resumed = _run(manifest, run_dir, target, jax_cache_env, second)
    resumed.wait(timeout=120)
    assert resumed.returncode == 0, second.read_text()[-4000:]
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"resumed from checkpoint step {complete[-1]}," in learner_log
    assert "write-ahead log replayed" in (run_dir / "logs" / "buffer.log").read_text()
    records, torn = _records(run_dir / "learner_metrics.jsonl")
    assert records[-1]["step"] == target and torn <= 1  # at most the line the full disk cut


@needs_dev_full
def test_a_child_that_dies_writing_to_a_full_disk_stops_the_run_without_spending_its_budget(tmp_path: Path) -> None:
    code = "open('/dev/full', 'w').write('x' * 8192)"  # a real ENOSPC: Python's traceback names it
    child = Child("learner", [sys.executable, "-c", code], tmp_path / "learner.log")
    child.start({})
    child.wait(30)
    unit = Unit("learner", [child], lambda: [{}], may_finish=True)
    said: list[str] = []
    supervisor = Supervisor(RestartPolicy(max_restarts=5), [unit], say=said.append, run_dir=tmp_path)
    with pytest.raises(DiskFull) as stop:
        supervisor.check()
    message = str(stop.value)
    assert message.startswith(f"the disk is full in {tmp_path} (")
    assert "learner could not write: OSError: [Errno 28] No space left on device" in message
    assert "Stopping the run instead of restarting learner" in message
    assert "(learner died (exit code 1)" in message
    assert unit.deaths == [] and unit.due is None and said == []  # no restart, no budget spent


def test_the_learners_disk_full_exit_code_stops_the_run_when_its_log_could_say_nothing(tmp_path: Path) -> None:
    child = Child("learner", [sys.executable, "-c", f"import os; os._exit({EXIT_DISK_FULL})"], tmp_path / "learner.log")
    child.start({})
    child.wait(30)
    unit = Unit("learner", [child], lambda: [{}], may_finish=True)
    supervisor = Supervisor(RestartPolicy(), [unit], say=lambda _: None, run_dir=tmp_path)
    with pytest.raises(DiskFull, match="learner died for want of space"):
        supervisor.check()
    assert unit.deaths == []


@needs_dev_full
def test_stoker_run_stops_with_the_disk_full_code_when_its_own_write_fails(tmp_path: Path, tiny_job: str) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_job)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "runs.jsonl").symlink_to(FULL)  # the runner's first write
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_DISK_FULL, done.stderr[-4000:]
    assert f"stoker run: the disk is full in {run_dir} (" in done.stderr
    assert f"stoker run could not write {run_dir / 'runs.jsonl'}" in done.stderr
    assert "no report: the disk is full" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_failed_write_is_found_however_the_library_wrapped_it() -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise enospc
        except OSError as exc:
            raise RuntimeError("async save failed") from exc
    except RuntimeError as wrapped:
        assert no_space(wrapped) is enospc
    tensorstore = ValueError("INTERNAL: Error writing file: [OS error 28: No space left on device]")
    assert no_space(tensorstore) is tensorstore
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None


def test_a_torn_last_line_is_ended_so_the_next_record_starts_whole(tmp_path: Path) -> None:
    torn, whole, empty = tmp_path / "torn.jsonl", tmp_path / "whole.jsonl", tmp_path / "empty.jsonl"
    torn.write_text('{"step": 1}\n{"step": 2, "lo')
    whole.write_text('{"step": 1}\n')
    empty.write_text("")
    seal_torn_lines(torn, whole, empty, tmp_path / "missing.jsonl")
    with torn.open("a") as out:
        out.write('{"step": 3}\n')
    assert _records(torn) == ([{"step": 1}, {"step": 3}], 1)
    assert whole.read_text() == '{"step": 1}\n' and empty.read_text() == ""
