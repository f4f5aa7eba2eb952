"""The learner's step programs compiled ahead of time on a background thread (learner/precompile.py):
the step then takes them from the persistent cache instead of compiling, for its first bucket and
for a longer one met later."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from stoker.compilation_cache import cache_enabled, disable_compilation_cache
from stoker.learner import precompile
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from tests.learner.bandit import PROMPT, bandit_groups, settings, with_reward_spread

LONG = 12  # tokens: past the bandit's first bucket (8), inside its second (16)


@pytest.fixture
def cached_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Learner]:
    """A bandit learner with its own (empty) persistent cache, compiling ahead as on an accelerator."""
    monkeypatch.setattr(precompile, "wanted", lambda platform: cache_enabled())
    learner = Learner(dataclasses.replace(settings(None), compilation_cache_dir=str(tmp_path / "cache")), resume=False)
    try:
        yield learner
    finally:
        learner.close()
        disable_compilation_cache()


def longer(groups: list[Group]) -> list[Group]:
    """The same episodes with their prompts padded to ``LONG`` tokens (bucket 16)."""
    for group in groups:
        for episode in group.episodes:
            pad = LONG - len(episode.token_ids)
            episode.token_ids = np.concatenate([np.full(pad, PROMPT[0], np.int32), episode.token_ids])
            episode.loss_mask = np.concatenate([np.zeros(pad, np.uint8), episode.loss_mask])
            episode.logprobs = np.concatenate([np.zeros(pad, np.float32), episode.logprobs])
            episode.policy_versions = np.concatenate([np.full(pad, -1, np.int32), episode.policy_versions])
    return groups


def test_every_bucket_is_compiled_ahead_and_the_steps_read_them_from_the_cache(cached_learner: Learner) -> None:
    learner = cached_learner
    ahead = learner._precompile
    assert ahead is not None
    ahead.wait_for(learner.rows)
    assert ahead.compiled == ["grad 16x8", "apply", "grad 8x16", "accumulate"]
    hits = learner.compiles.cache_hits
    rng = np.random.default_rng(0)
    first = learner.train_on(with_reward_spread(bandit_groups(learner, rng)))
    later = learner.train_on(longer(with_reward_spread(bandit_groups(learner, rng))))
    assert first["trained"] and later["trained"]
    # Each bucket's grad and the apply came from the cache the thread filled: no compile of their own.
    assert learner.compiles.cache_hits - hits >= 3


def test_a_step_waits_for_its_bucket_still_compiling_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = precompile.AheadOfTime._run

    def held(self: precompile.AheadOfTime) -> None:
        gate.wait()
        real(self)

    monkeypatch.setattr(precompile.AheadOfTime, "_run", held)
    monkeypatch.setattr(precompile, "wanted", lambda platform: cache_enabled())
    learner = Learner(dataclasses.replace(settings(None), compilation_cache_dir=str(tmp_path / "cache")), resume=False)
    try:
        groups = with_reward_spread(bandit_groups(learner, np.random.default_rng(0)))
        step = threading.Thread(target=learner.train_on, args=(groups,))
        step.start()
        step.join(5)  # the tiny step compiles in ~1.5 s here: alive after 5 s, it is waiting
        assert step.is_alive() and learner.steps == 0
        gate.set()
        step.join(60)
        assert learner.steps == 1 and learner.compiles.cache_hits >= 2  # its grad and apply from the cache
    finally:
        gate.set()
        learner.close()
        disable_compilation_cache()


def test_no_cache_or_the_cpu_compiles_nothing_ahead(tmp_path: Path) -> None:
    disable_compilation_cache()
    assert not precompile.wanted("tpu")  # nothing would keep the programs
    learner = Learner(settings(None), resume=False)
    assert learner._precompile is None  # on the CPU, with or without a cache
    learner.close()


def test_a_failed_compile_is_logged_and_left_to_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stoker.learner.precompile")

    class Broken:
        def programs(self, rows: int, length: int) -> dict[str, object]:
            raise RuntimeError("RESOURCE_EXHAUSTED: compiling")

    ahead = precompile.AheadOfTime(Broken(), {8: 16, 16: 8}).start()
    ahead.wait_for([8, 16])  # returns: a failure never leaves a step waiting
    ahead._thread.join(10)
    assert ahead.compiled == [] and "each compiles when first needed" in caplog.text
    assert jax.devices()  # the process goes on
