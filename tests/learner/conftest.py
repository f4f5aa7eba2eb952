"""Fixtures for the learner's tests."""

from __future__ import annotations

import pytest

from stoker.learner.loop import Learner
from tests.learner.bandit import settings


@pytest.fixture(scope="module")
def grpo_learner() -> Learner:
    """One GRPO learner shared by the tests that only look at a single update's metrics."""
    return Learner(settings(buffer={"maxStaleness": 1}))
