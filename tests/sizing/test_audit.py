"""``stoker audit``: the sizing arithmetic, and the command measuring a real job on this machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.sizing.audit import Audit, admission_warnings, render
from stoker.manifest import load_text

MANIFEST = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: audit}
spec:
  environment:
    name: frozenlake
    maxTurns: 8
    stepLatency: {distribution: fixed, seconds: %(latency)s}
  actors: {concurrency: 192}
  buffer: {groupSize: 8, maxStaleness: %(stale)d}
  learner: {batchGroups: %(batch)d}
"""


def spec(stale: int, batch: int, latency: float = 0.5):  # type: ignore[no-untyped-def]
    jobs, problems = load_text(MANIFEST % {"stale": stale, "batch": batch, "latency": latency}, "job.yaml")
    assert problems == []
    return jobs[0].spec


def audit(step_seconds: float) -> Audit:
    """8 turns of 0.5 s environment + 0.05 s sampling: a 4.4 s episode."""
    return Audit(
        env_step_seconds=[0.5] * 16, turns=[8, 8], tokens=[150, 150], sample_turn_seconds=0.05, sampler_batch=192,
        train_step_seconds=step_seconds, compile_seconds=1.0,
    )


def test_sizing_is_littles_law_and_the_admission_bound() -> None:
    s = audit(0.275).sizing(spec(stale=16, batch=4))
    assert s["episode_seconds"] == pytest.approx(4.4)
    assert s["demand"] == pytest.approx(32 / 0.275)  # 116 episodes/s
    assert s["per_actor"] == pytest.approx(192 / 4.4)
    assert s["actors"] == 4  # ceil(1.25 * 116.4 / 43.6)
    assert s["in_flight"] == pytest.approx(32 / 0.275 * 4.4)  # 512 episodes
    assert s["admission"] == 17 * 32 and s["versions_per_episode"] == pytest.approx(16.0)
    assert s["fed_fraction"] == 1.0  # 17 batches may be outstanding, 16 are needed


def test_a_max_staleness_too_small_for_the_latency_is_flagged_with_its_ceiling() -> None:
    """The FrozenLake utilisation job at maxStaleness 8: each 4.4 s episode spans 16 updates of 0.275
    s, admission lets 9 batches be outstanding, so the learner is busy at most 9/16 of the time."""
    job = spec(stale=8, batch=4)
    s = audit(0.275).sizing(job)
    assert s["fed_fraction"] == pytest.approx(9 / 16)
    (warning,) = admission_warnings(s, job)
    assert "busy at most 56%" in warning and "batchGroups to >= 10" in warning and "maxStaleness to >= 17" in warning
    assert "warning: an episode spans 16.0 learner updates" in render(audit(0.275), job)
    # Four times the batch, four times the step: 4 updates per episode, fed within maxStaleness 4.
    assert admission_warnings(audit(1.1).sizing(spec(stale=4, batch=16)), spec(stale=4, batch=16)) == []
    # maxStaleness 0 is on-policy: waiting for each batch is the point, not a misconfiguration.
    assert admission_warnings(audit(0.275).sizing(spec(stale=0, batch=4)), spec(stale=0, batch=4)) == []


def test_frequent_weight_swaps_over_slow_turns_suggest_a_longer_poll_period() -> None:
    """A 4.4 s episode and a swap every second: ~4 full prefills per episode with between-turns."""
    job = spec(stale=16, batch=4)
    s = audit(0.275).sizing(job)
    assert s["swaps_per_episode"] == pytest.approx(4.4)
    assert "note: an episode sees episode time / actors.weightPollSeconds = 4.40 / 1 s = 4.4 weight swaps" in render(
        audit(0.275), job
    )
    assert "actors.weightPollSeconds: 1.5 (about a third of an episode)" in render(audit(0.275), job)
    # Already about a third of an episode, or episodes keeping their first weights: nothing to say.
    for actors in ({"weight_poll_seconds": 1.5}, {"weight_sync": "between-episodes"}):
        changed = job.model_copy(update={"actors": job.actors.model_copy(update=actors)})
        assert "weight swaps" not in render(audit(0.275), changed)
    # Fast environments: a few swaps per second of turns cost nothing worth a note.
    fast = spec(stale=16, batch=4, latency=0.0)
    assert "note:" not in render(Audit([0.001] * 16, [8, 8], [150, 150], 0.05, 192, 0.275, 1.0), fast)


def test_a_slow_episode_suggests_sampling_the_newest_groups_first() -> None:
    job = spec(stale=16, batch=4)
    assert "note: with 16.0 updates per episode" in render(audit(0.275), job)
    assert "buffer.sampleOrder: oldest-first adds every complete group" in render(audit(0.275), job)
    newest = job.model_copy(update={"buffer": job.buffer.model_copy(update={"sample_order": "newest-first"})})
    assert "sampleOrder" not in render(audit(0.275), newest)
    # Four updates per episode (a 1.1 s step): the data is fresh enough that the order matters little.
    assert "sampleOrder" not in render(audit(1.1), spec(stale=4, batch=16))


TINY = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: tiny}
spec:
  model:
    architecture: {vocabSize: 27}
  environment:
    name: frozenlake
    maxTurns: 2
    frozenlake: {size: 4, mapSeeds: [0]}
    stepLatency: {distribution: fixed, seconds: 0.1}
  actors:
    concurrency: 2
    conversationCacheMiB: 0  # fewer sampler programs to compile
    sampling: {maxNewTokens: 1, allowedTokens: [left, down, right, up]}
  buffer: {groupSize: 2, maxStaleness: 1}
  learner: {batchGroups: 1, sequenceBuckets: [64]}
"""


def test_audit_measures_the_job_and_prints_the_arithmetic(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(TINY)
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "audit", str(job), "--groups", "1", "--train-steps", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    step_ms = float(re.search(r"environment step\s+([\d.]+) ms mean", out.stdout).group(1))  # type: ignore[union-attr]
    assert step_ms >= 100.0  # the injected latency is part of what the audit measures
    assert re.search(r"actors\s+= ceil\(1\.25 x [\d.]+ / [\d.]+\) = \d+", out.stdout)
    assert "= (1 + 1) x 2 = 4 episodes outstanding at most" in out.stdout
    # The admission check is fed by what was measured (whether it warns depends on this machine's
    # speed; the warning itself is tested above).
    found = re.search(r"staleness\s+= episode time / learner step = ([\d.]+) / ([\d.]+) s = ([\d.]+) updates", out.stdout)
    assert found is not None, out.stdout
    episode, step, versions = (float(x) for x in found.groups())
    assert episode >= 0.1 and versions == pytest.approx(episode / step, rel=0.1, abs=0.06)  # printed rounded


def test_rollout_sizing_against_hand_computed_numbers() -> None:
    """8 turns of 4 sampled tokens, 0.5 s environment steps, a 32-episode batch every 0.275 s and
    servers of 2400 tokens/s with 32 sequences each:

    demand 32 / 0.275 = 116.36 episodes/s x 32 tokens = 3723.6 tokens/s -> ceil(1.25 x 3723.6 / 2400)
    = ceil(1.94) = 2 servers; a turn 4 x 32 / 2400 = 0.0533 s, an episode 8 x 0.5533 = 4.427 s, in
    flight 116.36 x 4.427 = 515.1 episodes -> ceil(1.25 x 515.1 / 192) = ceil(3.35) = 4 actors."""
    from stoker.sizing.audit_rollout import size_rollout

    s = size_rollout(tokens_per_turn=4, turns=8, env_step_seconds=0.5, server_tokens_per_second=2400, step_seconds=0.275,
                     episodes_per_step=32, concurrency=192, max_batch=32, headroom=1.25)
    assert s["demand"] == pytest.approx(116.3636, rel=1e-4) and s["token_demand"] == pytest.approx(3723.636, rel=1e-4)
    assert s["servers"] == 2 and s["actors"] == 4
    assert s["turn_seconds"] == pytest.approx(0.053333, rel=1e-4) and s["episode_seconds"] == pytest.approx(4.42667, rel=1e-4)
    # Servers half as fast: 3.88 -> 4 servers; turns twice as long, a 4.85 s episode -> ceil(3.68) = 4 actors.
    slow = size_rollout(tokens_per_turn=4, turns=8, env_step_seconds=0.5, server_tokens_per_second=1200, step_seconds=0.275,
                        episodes_per_step=32, concurrency=192, max_batch=32, headroom=1.25)
    assert slow["servers"] == 4 and slow["episode_seconds"] == pytest.approx(8 * (4 * 32 / 1200 + 0.5))


def test_audit_prints_the_rollout_arithmetic_and_the_chip_ratio() -> None:
    from stoker.spec import LearnerSpec, RolloutSpec

    job = spec(stale=16, batch=4).model_copy(update={
        "rollout": RolloutSpec(accelerator="tpu-v6e-slice", topology="2x4", max_replicas=1),
        "learner": LearnerSpec(accelerator="tpu-v6e-slice", topology="4x4", batch_groups=4),
    })
    measured = Audit(env_step_seconds=[0.5] * 16, turns=[8, 8], tokens=[150, 150], sample_turn_seconds=0.05, sampler_batch=192,
                     train_step_seconds=0.275, compile_seconds=1.0, sampled=[32, 32])
    assert measured.tokens_per_turn == 4.0
    out = render(measured, job, rollout_tokens_per_second=2400, rollout_source="as given")
    assert "rollout servers    = ceil(1.25 x 3724 / 2400) = 2" in out
    assert "actors             = ceil(1.25 x 116.4 episodes/s x 4.43 s / concurrency 192) = 4" in out
    assert "= 2 servers x 8 chips : 16 learner chips = 1.00 rollout chips per trainer chip" in out
    assert "warning: rollout.maxReplicas 1 is below the 2 servers the learner needs" in out
    # Without a server figure, a job with a rollout tier is told how to get one.
    assert "pass --rollout-tokens-per-second" in render(measured, job)


def test_the_server_figure_is_read_from_a_running_servers_stats() -> None:
    from concurrent import futures

    import grpc

    from stoker.sizing.audit import server_tokens_per_second
    from stoker.v1 import rollout_pb2, rollout_pb2_grpc

    class Serving(rollout_pb2_grpc.RolloutServicer):
        tokens_per_second = 1800.0

        def Stats(self, request: object, context: object) -> rollout_pb2.RolloutStats:
            return rollout_pb2.RolloutStats(tokens_per_second=self.tokens_per_second, ready=True)

    servicer = Serving()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert server_tokens_per_second(f"127.0.0.1:{port}") == 1800.0
        servicer.tokens_per_second = 0.0  # idle: no figure to size from
        with pytest.raises(ValueError, match="reports 0 tokens/s"):
            server_tokens_per_second(f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="did not answer Stats: UNAVAILABLE"):
        server_tokens_per_second(f"127.0.0.1:{port}", timeout=2.0)
