"""The learner's outbox: after-step work runs in order on one thread, and an error reaches the
training thread."""

from __future__ import annotations

import threading

import pytest

from stoker.learner.outbox import Outbox


def test_tasks_run_in_the_order_sent_and_drain_waits_for_them() -> None:
    ran: list[int] = []
    with Outbox() as outbox:
        for i in range(50):
            outbox.send(lambda i=i: ran.append(i))
        outbox.drain()
        assert ran == list(range(50))


def test_an_error_is_raised_on_the_sending_thread() -> None:
    def fail() -> None:
        raise ConnectionError("buffer unreachable")

    outbox = Outbox()
    outbox.send(fail)
    with pytest.raises(ConnectionError, match="unreachable"):
        outbox.drain()
    outbox.close()  # the error was delivered once; closing is clean


def test_close_runs_what_is_queued() -> None:
    release = threading.Event()
    ran: list[int] = []
    outbox = Outbox()
    outbox.send(release.wait)
    outbox.send(lambda: ran.append(1))
    release.set()
    outbox.close()
    assert ran == [1]
    with pytest.raises(RuntimeError, match="closed"):
        outbox.send(lambda: None)


def test_close_with_a_timeout_abandons_a_task_that_never_ends() -> None:
    """A commit retrying against a buffer that is gone must not hold a stopping learner for minutes."""
    release = threading.Event()
    ran: list[int] = []
    outbox = Outbox()
    outbox.send(release.wait)  # blocked, like a commit retrying against a dead buffer
    outbox.send(lambda: ran.append(1))
    assert outbox.close(timeout=0.2) == 2  # the blocked task and the one behind it
    assert outbox.close() == 0  # closing again does nothing
    release.set()
    assert ran == []  # the abandoned task never runs
