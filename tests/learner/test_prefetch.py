"""The learner's batch prefetcher: one batch ahead, errors and empty polls handed to the loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from stoker.learner.prefetch import Prefetcher


@dataclass
class Batch:
    batch_id: str
    groups: list[Any] = field(default_factory=lambda: ["group"])


class ScriptedSource:
    """Answers Sample from a script; each call sets an event so tests can wait for it."""

    def __init__(self, answers: list[Any]):
        self.answers = answers
        self.calls = [threading.Event() for _ in range(len(answers) + 1)]
        self.count = 0
        self.release_last = threading.Event()

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> Any:
        self.calls[self.count].set()
        self.count += 1
        if self.count > len(self.answers):
            self.release_last.wait(timeout)  # an empty buffer: Sample waits out its timeout
            return None
        answer = self.answers[self.count - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_the_next_batch_is_fetched_while_the_current_one_trains() -> None:
    source = ScriptedSource([Batch("b1"), Batch("b2")])
    with Prefetcher(source, max_groups=4, min_groups=4, timeout=5.0) as prefetcher:
        assert prefetcher.get().batch_id == "b1"
        # Without asking again, the second Sample is already under way.
        assert source.calls[1].wait(5.0)
        assert prefetcher.get().batch_id == "b2"
        source.release_last.set()


def test_an_empty_poll_returns_none_and_fetching_goes_on() -> None:
    source = ScriptedSource([Batch("", groups=[]), Batch("b2")])
    with Prefetcher(source, max_groups=4, min_groups=4, timeout=5.0) as prefetcher:
        assert prefetcher.get() is None  # the loop reports itself idle and checks for a stop
        assert prefetcher.get().batch_id == "b2"
        source.release_last.set()


def test_an_error_from_the_buffer_reaches_the_training_loop() -> None:
    source = ScriptedSource([Batch("b1"), ConnectionError("buffer gone")])
    with Prefetcher(source, max_groups=4, min_groups=4, timeout=5.0) as prefetcher:
        assert prefetcher.get().batch_id == "b1"
        with pytest.raises(ConnectionError, match="buffer gone"):
            prefetcher.get()


def test_close_returns_with_a_fetched_batch_left_uncommitted() -> None:
    source = ScriptedSource([Batch("b1"), Batch("b2")])
    prefetcher = Prefetcher(source, max_groups=4, min_groups=4, timeout=5.0)
    assert source.calls[1].wait(5.0)  # b1 is waiting in the slot, b2 fetched and waiting to be handed over
    source.release_last.set()
    prefetcher.close()
    assert not prefetcher._thread.is_alive()
