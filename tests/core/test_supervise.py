"""The restart policy of ``stoker run`` (runner/supervise.py): backoff, budget, and the messages."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from stoker.runner.children import Child
from stoker.runner.supervise import RestartPolicy, Supervisor, Unit, describe_exit, pin_port, restart_delay


def test_backoff_doubles_from_one_second_to_thirty() -> None:
    policy = RestartPolicy(max_restarts=8)
    deaths: list[float] = []
    delays = []
    for n in range(8):
        deaths.append(float(n))
        delays.append(restart_delay(policy, deaths, now=float(n)))
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


def test_the_budget_is_max_restarts_within_the_window() -> None:
    policy = RestartPolicy(max_restarts=2, window_seconds=600)
    assert restart_delay(policy, [0.0], 0.0) == 1
    assert restart_delay(policy, [0.0, 10.0], 10.0) == 2
    assert restart_delay(policy, [0.0, 10.0, 20.0], 20.0) is None  # a third death in 10 minutes: spent
    # Deaths older than the window are forgiven: the backoff and the budget start again.
    assert restart_delay(policy, [0.0, 10.0, 700.0], 700.0) == 1
    assert restart_delay(policy, [0.0, 10.0, 610.0], 610.0) == 1  # exactly 10 minutes after: out of it
    assert restart_delay(RestartPolicy(max_restarts=0), [5.0], 5.0) is None  # 0: no restarts at all


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts -1"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="initial_backoff <= max_backoff"):
        RestartPolicy(initial_backoff=40.0)


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"


def test_a_restarted_tcp_server_binds_the_port_its_clients_dial() -> None:
    argv = ["stoker", "buffer", "--host", "127.0.0.1", "--port", "0", "--ready-file", "r"]
    pinned = ["stoker", "buffer", "--host", "127.0.0.1", "--port", "4711", "--ready-file", "r"]
    assert pin_port(argv, "127.0.0.1:4711") == pinned
    unix = ["stoker", "buffer", "--listen", "unix:///run/b.sock"]
    assert pin_port(unix, "unix:///run/b.sock") == unix


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _crashing_unit(tmp_path: Path) -> Unit:
    """An 'actor' that writes a line to its log and exits 3, every time it starts."""
    code = "import sys; print('boom: the environment broke', flush=True); sys.exit(3)"
    child = Child("actor-0", [sys.executable, "-c", code], tmp_path / "actor-0.log")
    child.start({})
    return Unit("actor-0", [child], lambda: [{}])


def test_a_child_that_dies_is_restarted_after_its_backoff_until_its_budget_is_spent(tmp_path: Path) -> None:
    clock, said = _Clock(), list[str]()
    unit = _crashing_unit(tmp_path)
    supervisor = Supervisor(RestartPolicy(max_restarts=2), [unit], clock=clock, say=said.append)
    child = unit.children[0]
    child.wait(30)
    assert supervisor.check() is None
    assert "actor-0 died (exit code 3); restarting actor-0 in 1 s (restart 1 of 2 within 10 minutes)" in said[-1]
    assert "boom: the environment broke" in said[-1]  # its log's last lines
    assert supervisor.next_due() == 1.0
    first = child.process
    assert supervisor.check() is None and child.process is first  # not due yet: no restart
    clock.now += 1.0
    assert supervisor.check() is None
    assert child.process is not first and said[-1] == "stoker run: actor-0 restarted (restart 1)"
    child.wait(30)
    assert supervisor.check() is None
    assert "restarting actor-0 in 2 s (restart 2 of 2" in said[-1]
    clock.now += 2.0
    supervisor.check()
    child.wait(30)
    spent = supervisor.check()
    assert spent is not None
    assert spent.startswith(
        "actor-0 died (exit code 3), 3 time(s) within 10 minutes (--max-restarts 2); stopping the run"
    )
    assert "boom: the environment broke" in spent
    assert supervisor.summary() == "\nrestarts: actor-0 3"


def test_a_child_killed_by_a_signal_has_died(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    child = Child("buffer", [sys.executable, "-c", code], tmp_path / "buffer.log")
    child.start({})
    child.wait(30)
    said = list[str]()
    supervisor = Supervisor(RestartPolicy(), [Unit("buffer", [child], lambda: [{}])], clock=_Clock(), say=said.append)
    assert supervisor.check() is None
    assert said[-1].startswith("stoker run: buffer died (killed by SIGKILL); restarting buffer in 1 s")


def test_a_learner_that_finishes_is_not_restarted(tmp_path: Path) -> None:
    child = Child("learner", [sys.executable, "-c", "pass"], tmp_path / "learner.log")
    child.start({})
    child.wait(30)
    unit = Unit("learner", [child], lambda: [{}], may_finish=True)
    supervisor = Supervisor(RestartPolicy(), [unit], clock=_Clock(), say=lambda _: None)
    assert supervisor.check() is None and unit.due is None and supervisor.summary() == ""
    # An actor that exits 0 while the learner trains has died all the same.
    unit.may_finish = False
    assert supervisor.check() is None and unit.due is not None
