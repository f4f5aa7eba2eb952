"""The learner's run loop on the CPU: it commits, publishes, checkpoints and resumes, survives a
slow publisher, a lost lease and a dead buffer; and the settings it runs with."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.buffer.client import SampledBatch
from stoker.learner.batches import load_dpo_pairs
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import TINY_ARCHITECTURE, tiny_spec
from stoker.spec import RLJobSpec
from stoker.weights.channel import WeightSubscriber
from tests.learner.bandit import (
    GOOD,
    PROMPT,
    ScriptedBuffer,
    bandit_groups,
    next_token_probs,
    settings,
    with_reward_spread,
)

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared across learners


def test_checkpoint_resume_continues_the_version(tmp_path: Path) -> None:
    first = Learner(settings(tmp_path))
    rng = np.random.default_rng(4)
    for _ in range(3):
        first.train_on(with_reward_spread(bandit_groups(first, rng)))
    first.save(wait=True)
    probs = next_token_probs(first)
    groups = with_reward_spread(bandit_groups(first, np.random.default_rng(5)))

    second = Learner(settings(tmp_path))
    assert second.resumed and second.version == 3 and second.steps == 3
    np.testing.assert_allclose(next_token_probs(second), probs, rtol=1e-6)
    restored_params = jax.tree.map(jnp.copy, second.trainer.params)
    # Adam's moments came back too: the next update equals the one the first learner makes ...
    first.train_on(groups)
    second.train_on(groups)
    assert second.version == first.version == 4
    expected = [np.asarray(x) for x in jax.tree.leaves(first.trainer.params)]
    for a, b in zip(expected, jax.tree.leaves(second.trainer.params), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
    # ... which the same parameters with a fresh optimizer state would not reproduce.
    no_moments = Learner(settings())
    no_moments.trainer.params = restored_params
    no_moments.train_on(groups)
    got = [np.asarray(x) for x in jax.tree.leaves(no_moments.trainer.params)]
    assert not all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(expected, got, strict=True))
    first.close()
    second.close()


def test_run_loop_commits_publishes_checkpoints_and_resumes(tmp_path: Path) -> None:
    from stoker.learner.metrics import MetricsSink
    from stoker.weights.channel import WeightPublisher

    weights_dir = tmp_path / "weights"
    buffer = ScriptedBuffer()
    learner = Learner(settings(tmp_path, learner={"publishIntervalSteps": 2}))
    buffer.learner_ref.append(learner)
    with WeightPublisher(directory=weights_dir, keep=2) as publisher, MetricsSink(tmp_path / "m.jsonl") as sink:
        made = learner.run(buffer, publisher, max_steps=4, sink=sink)
        assert sink.registry.get_sample_value("stoker_learner_policy_version") == 4
        assert 0 < sink.registry.get_sample_value("stoker_learner_duty_cycle") <= 1  # type: ignore[operator]
        assert sink.registry.get_sample_value("stoker_learner_steps_total") == 4
    learner.close()
    assert made == 4 and learner.version == 4
    assert len(buffer.committed) == 4
    # Every second version, reported after it is published; newest wins if publishing falls behind.
    assert buffer.versions[0] == 0 and buffer.versions[-1] == 4 and set(buffer.versions) <= {0, 2, 4}
    assert buffer.versions == sorted(set(buffer.versions))
    # A published version is reported before the commit of the batch that made it: the commit
    # frees admission credit, and the actors' next groups must start on the new weights.
    for version in (2, 4):
        made_it = buffer.committed[version - 1]
        assert buffer.calls.index(f"version {version}") < buffer.calls.index(f"commit {made_it}")
    reported_before_restart = len(buffer.versions)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["policy_version"] for line in lines] == [1, 2, 3, 4]
    assert all(0 < line["duty_cycle"] <= 1 for line in lines)
    assert {"tokens_per_second", "compilations", "padding_waste", "is_weight_mean", "reward_mean"} <= set(lines[0])
    with WeightSubscriber(directory=weights_dir) as sub:
        version, flat = sub.fetch_latest()  # type: ignore[misc]
    assert version == 4
    np.testing.assert_allclose(flat["model.norm.weight"], np.asarray(learner.trainer.params["policy"]["norm"]["weight"][...]))

    # A restarted learner picks up at step 4 and keeps counting.
    resumed = Learner(settings(tmp_path, learner={"publishIntervalSteps": 2}))
    buffer.learner_ref[0] = resumed
    with WeightPublisher(directory=weights_dir, keep=2) as publisher:
        stop = threading.Event()
        assert resumed.run(buffer, publisher, max_steps=6, stop=stop) == 2
    assert resumed.version == 6
    assert buffer.versions[reported_before_restart:] in ([4, 6], [6])
    resumed.close()


def test_run_loop_logs_sample_episodes_and_what_was_sampled(tmp_path: Path) -> None:
    from stoker.learner.metrics import MetricsSink
    from stoker.learner.samples import SampleLog

    buffer = ScriptedBuffer()
    learner = Learner(settings())
    buffer.learner_ref.append(learner)
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        sink.attach_samples(SampleLog(tmp_path / "samples.jsonl", lambda ids: " ".join(map(str, ids)), every=1))
        assert learner.run(buffer, max_steps=2, sink=sink) == 2
    learner.close()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in samples] == [(1, "best"), (1, "worst"), (2, "best"), (2, "worst")]
    assert all(r["completion"] and r["prompt"] for r in samples) and samples[0]["reward"] > samples[1]["reward"]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(line["sampled_tokens"] >= line["trained_tokens"] > 0 for line in lines)
    assert all(line["completion_tokens_mean"] > 0 and "truncation_rate" in line for line in lines)


def test_publishing_that_falls_behind_skips_to_the_newest_weights(tmp_path: Path) -> None:
    """Training goes on while weights are published; a slow publisher gets the newest version next,
    not a backlog, and the buffer still hears of every version, each after weights that new."""
    published: list[int] = []
    release = threading.Event()

    class SlowPublisher:
        latest_version = -1

        def publish(self, version: int, flat: object) -> None:
            release.wait(timeout=60)  # a slow disk or network: the first publish outlasts 3 steps
            published.append(version)
            self.latest_version = version

    class ReleaseAfter:
        def record(self, metrics: dict[str, float]) -> None:
            if metrics.get("policy_version") == 3:
                release.set()

    buffer = ScriptedBuffer()
    learner = Learner(settings(tmp_path))
    buffer.learner_ref.append(learner)
    assert learner.run(buffer, SlowPublisher(), max_steps=3, sink=ReleaseAfter()) == 3
    assert published == [3] or published == [0, 3]  # v0 may start before training does
    assert buffer.versions == [0, 1, 2, 3]
    assert len(buffer.committed) == 3
    learner.close()


def test_a_lost_lease_is_not_fatal(grpo_learner: Learner) -> None:
    """A batch whose lease ran out during training is redelivered by the buffer; keep going."""
    from stoker.buffer.client import LeaseLostError

    class LosingBuffer(ScriptedBuffer):
        def commit(self, batch_id: str) -> None:
            raise LeaseLostError(f"batch {batch_id} is not leased")

    buffer = LosingBuffer()
    buffer.learner_ref.append(grpo_learner)
    start = grpo_learner.steps
    assert grpo_learner.run(buffer, max_steps=start + 2) == 2
    assert buffer.versions[-1] == grpo_learner.version


def test_a_stop_with_the_buffer_gone_checkpoints_and_returns(tmp_path: Path) -> None:
    """``stoker run`` stops the learner when the buffer dies; every commit would then retry for the
    client's whole deadline. The learner must still write its final checkpoint and exit promptly."""
    stop, gone = threading.Event(), threading.Event()

    class DyingBuffer(ScriptedBuffer):
        def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
            if gone.is_set():
                threading.Event().wait(120)  # retrying against an unreachable buffer
            return super().sample(max_groups, min_groups, timeout)

        def commit(self, batch_id: str) -> None:
            if len(self.committed) == 1:  # the buffer dies after the first commit ...
                gone.set()
                stop.set()  # ... and the runner stops the learner
            if gone.is_set():
                threading.Event().wait(120)
            super().commit(batch_id)

    buffer = DyingBuffer()
    learner = Learner(settings(tmp_path, learner={"checkpoint": {"intervalSteps": 100}}))
    buffer.learner_ref.append(learner)
    started = time.monotonic()
    learner.run(buffer, max_steps=50, stop=stop)
    assert time.monotonic() - started < 60  # two stop waits, not the buffer's 120 s
    assert 2 <= learner.steps < 50
    steps = learner.steps
    learner.close()
    resumed = Learner(settings(tmp_path, learner={"checkpoint": {"intervalSteps": 100}}))
    assert resumed.resumed and resumed.steps == steps  # the final checkpoint was written
    resumed.close()


def test_settings_from_spec_resolve_paths(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate(
        {"learner": {"compilationCacheDir": "cache", "checkpoint": {"dir": "ck"}}, "algorithm": {"name": "gspo"}}
    )
    s = LearnerSettings.from_spec(spec, run_dir=tmp_path)
    assert s.checkpoint_dir == str(tmp_path / "ck")
    assert s.compilation_cache_dir == str(tmp_path / "cache")
    assert s.algorithm == "gspo" and s.microbatch_tokens_on("cpu") == 4 * max(spec.learner.sequence_buckets)
    assert s.loss.clip_high == spec.algorithm.clip_epsilon


def test_settings_hold_the_spec_and_only_what_it_cannot_say(tmp_path: Path) -> None:
    """A value the spec holds is read from it, never overridden beside it; --max-steps stops the
    run early but leaves the schedule decaying over learner.maxSteps."""
    spec = tiny_spec(algorithm={"learningRateSchedule": {"kind": "cosine"}}, learner={"maxSteps": 40})
    s = LearnerSettings.from_spec(spec, run_dir=tmp_path, max_steps=3, checkpoint_dir=None)
    assert s.spec is spec and s.max_steps == 3 and s.checkpoint_dir is None
    assert s.optimizer.decay_steps == 40 and s.buckets == (8, 16) and s.architecture == TINY_ARCHITECTURE
    with pytest.raises(TypeError):
        LearnerSettings.from_spec(spec, buckets=(8,))
    sft = LearnerSettings.from_spec(tiny_spec(algorithm={"name": "sft", "sft": {"dataset": "d.jsonl"}},
                                              actors={"sampling": {"temperature": 0.7}}))
    assert sft.sft is not None and sft.sft.dataset == "d.jsonl" and sft.temperature == 1.0


def test_dpo_dataset_pairs(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt_ids": PROMPT, "chosen_ids": [GOOD], "rejected_ids": [t]}) for t in (0, 4, 5, 6))
    )
    pairs = load_dpo_pairs(path)
    learner = Learner(settings(algorithm={"name": "dpo", "dpoDataset": str(path)}, learner={"batchGroups": 4}))
    before = next_token_probs(learner)[GOOD]
    assert learner.run(None, max_steps=8) == 8
    assert next_token_probs(learner)[GOOD] > max(before + 0.2, 0.5)
    assert len(pairs) == 4 and pairs[0][0].pair_sign == 1 and not pairs[0][0].behaviour_known
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1], "chosen_ids": "x", "rejected_ids": [2]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: chosen_ids must be a list"):
        load_dpo_pairs(bad)
