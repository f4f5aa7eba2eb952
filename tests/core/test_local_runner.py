"""The local runner's pieces that do not need a model: supervision, metrics tailing, the report."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from stoker.procstat import proc_stat
from stoker.runner.children import Child, wait_for_ready_file
from stoker.runner.progress import MetricsTail, RunState
from stoker.runner.report import rolling_mean, time_to_reach, write_report

SPAWN_GRANDCHILD = r"""
import subprocess, sys, time, pathlib
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1]).write_text(str(grandchild.pid))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return proc_stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_child_takes_its_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    child = Child("worker", [sys.executable, "-c", SPAWN_GRANDCHILD, str(pid_file)], tmp_path / "worker.log")
    child.start(dict(os.environ))
    grandchild = int(wait_for_ready_file(pid_file, child, timeout=30))
    assert child.running and _alive(grandchild)
    child.stop(grace=5)
    assert not child.running
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        child.wait(0.05)
    assert not _alive(grandchild), "a grandchild (e.g. a sandbox) outlived its actor"


def test_a_child_that_dies_before_ready_is_reported_with_its_log(tmp_path: Path) -> None:
    child = Child("buffer", [sys.executable, "-c", "import sys; print('port in use'); sys.exit(3)"], tmp_path / "b.log")
    child.start(dict(os.environ))
    with pytest.raises(RuntimeError, match="exited with code 3 before it was ready:\n.*port in use"):
        wait_for_ready_file(tmp_path / "never", child, timeout=30)


def test_metrics_tail_reads_only_whole_new_records(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []
    with path.open("w") as out:
        out.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "succ')
    assert tail.read_new() == [{"step": 1}]
    with path.open("a") as out:
        out.write('ess_rate": 0.5}\n')
    assert tail.read_new() == [{"step": 2, "success_rate": 0.5}]
    assert tail.read_new() == []


def test_success_window_and_time_to_target() -> None:
    state = RunState()
    state.fold({"success_rate": 1.0})
    assert state.success_rate() == 1.0 and not state.reached(0.9)  # one lucky batch is not a window
    for value in [0.0] * 5 + [1.0] * 8:
        state.fold({"success_rate": value})
    assert not state.reached(0.9)
    for _ in range(2):
        state.fold({"success_rate": 1.0})
    assert state.success_rate() == 1.0 and state.reached(0.9)
    assert rolling_mean([0, 1, 1, 1], 2) == [0.0, 0.5, 1.0, 1.0]
    records = [{"time": 100.0 + i, "success_rate": 1.0 if i >= 3 else 0.0} for i in range(10)]
    assert time_to_reach(records, "success_rate", 0.9, window=2) == 4.0
    assert time_to_reach(records[:3], "success_rate", 0.9) is None


def test_report_is_written_from_partial_records(tmp_path: Path) -> None:
    assert "No training steps" in write_report(tmp_path).read_text()
    with (tmp_path / "learner_metrics.jsonl").open("w") as out:
        for step in range(20):
            record = {"time": 1000.0 + step, "step": step, "policy_version": step, "success_rate": step / 19, "duty_cycle": 0.97}
            out.write(json.dumps(record) + "\n")
        out.write('{"time": 10')  # torn last line of a killed learner
    with (tmp_path / "buffer_stats.jsonl").open("w") as out:
        for i in range(5):
            out.write(json.dumps({"time": 1000.0 + i, "fill": i / 10, "accepted_total": i, "staleness_histogram": {"0": 3, "1": i}}) + "\n")
    report = write_report(tmp_path).read_text()
    assert "steps: 19" in report and "mean learner duty cycle: 0.970" in report
    assert "time to 0.9 success:" in report
    for plot in ("success", "duty_cycle", "buffer_fill", "staleness"):
        assert (tmp_path / "plots" / f"{plot}.png").stat().st_size > 1000


def test_a_second_signal_does_not_cut_the_orderly_stop_short() -> None:
    import signal as signals

    from stoker.runner.children import terminate_on_signals as _terminate_on_signals

    # What the run found is what it leaves: default_int_handler in a terminal, SIG_IGN where a
    # shell without job control started it in the background (nohup ... &).
    before = {sig: signals.getsignal(sig) for sig in (signals.SIGINT, signals.SIGTERM)}
    stopped = []
    with _terminate_on_signals():
        try:
            signals.raise_signal(signals.SIGTERM)
            raise AssertionError("the first signal must interrupt the run")
        except KeyboardInterrupt:
            # Stopping the children: an impatient second Ctrl-C (or SIGTERM) is ignored.
            signals.raise_signal(signals.SIGINT)
            signals.raise_signal(signals.SIGTERM)
            stopped.append(True)
    assert stopped == [True]
    assert {sig: signals.getsignal(sig) for sig in before} == before


def test_the_progress_display_does_not_wait_on_a_buffer_that_is_gone(tmp_path: Path) -> None:
    """It polls the buffer on the loop that watches the children: a dead buffer must cost one quick
    failed call, or the run notices the death only after the client's minutes of retries."""
    import socket

    from stoker.runner.local import RunOptions
    from stoker.manifest import load_job
    from stoker.runner.progress import Progress

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manifest = Path(__file__).resolve().parents[2] / "examples" / "frozenlake.yaml"
    options = RunOptions(manifest, load_job(manifest), "async", tmp_path, live=False)
    progress = Progress(options)
    progress.attach_buffer(f"127.0.0.1:{port}")
    started = time.monotonic()
    progress.refresh()
    assert time.monotonic() - started < 5.0
    assert progress.state.buffer == {}  # nothing heard, nothing raised


RUNNER_THAT_DIES = r"""
import os, pathlib, subprocess, sys, time
from stoker.parent import PARENT_ENV
work = pathlib.Path(sys.argv[1])
env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
buffer = subprocess.Popen(
    [sys.executable, "-m", "stoker.cli", "buffer", "--port", "0", "--data-dir", str(work / "data"),
     "--ready-file", str(work / "ready")],
    env=env, start_new_session=True, stdout=open(work / "buffer.log", "wb"), stderr=subprocess.STDOUT,
)
(work / "pid").write_text(str(buffer.pid))
time.sleep(600)
"""


def test_children_stop_when_stoker_run_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) gives ``stoker run`` no chance to stop its children in order;
    they must notice and stop themselves rather than run on against a buffer nobody restarts."""
    import signal
    import subprocess

    runner = subprocess.Popen([sys.executable, "-c", RUNNER_THAT_DIES, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "buffer never became ready"
            time.sleep(0.1)
        child = int((tmp_path / "pid").read_text())
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the buffer outlived stoker run"
            time.sleep(0.1)
        log = (tmp_path / "buffer.log").read_text()
        assert "is gone: stopping" in log and "buffer stopped" in log  # its own graceful path
    finally:
        runner.kill()
        if (tmp_path / "pid").exists() and _alive(int((tmp_path / "pid").read_text())):
            os.kill(int((tmp_path / "pid").read_text()), 9)
