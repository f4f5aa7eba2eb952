"""What a run's report and progress tell a user about generation: throughput, failures by reason,
decoded samples; the duty cycle over a moving window; the wall time from the start; failed runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stoker.actor.diagnostics import ActorDiagnostics, write_snapshot
from stoker.conversation.tokenization import byte_tokenizer
from stoker.learner.samples import SAMPLES_FILE, SampleLog
from stoker.runner.local import RunOptions
from stoker.runner.progress import Progress
from stoker.runner.report import windowed_duty, write_report
from stoker.spec import RLJob
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2, trajectory_pb2


def _episode(status: int, reason: str = "", text: str = "8 8 8", reward: float = 0.0) -> Episode:
    tokenizer = byte_tokenizer()
    prompt = tokenizer.encode("3+5=", add_special_tokens=False).ids
    answer = tokenizer.encode(text, add_special_tokens=False).ids
    n = len(prompt) + len(answer)
    return Episode(
        episode_id="e", group_id="g", group_size=1, task_id="sum-1",
        token_ids=np.asarray(prompt + answer, np.int32), loss_mask=np.asarray([0] * len(prompt) + [1] * len(answer), np.uint8),
        logprobs=np.zeros(n, np.float32), policy_versions=np.zeros(n, np.int32),
        status=status, status_reason=reason, reward=reward, turn_rewards=[reward], num_turns=1,
    )


def _run_dir(tmp_path: Path) -> Path:
    """Records of a run that started at t=100, trained from t=160 to t=700 and ended at t=760."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs.jsonl").write_text(json.dumps({"started_unix": 100.0}) + "\n")
    rows = [
        {"time": 160.0 + 60 * i, "step": i + 1, "success_rate": 0.3, "duty_cycle": 0.5, "step_seconds": 1.0,
         "sampled_tokens": 60.0, "trained_tokens": 30.0, "group_seconds": 0.1 * (i + 1), "group_wait_seconds": 0.3}
        for i in range(10)
    ]
    (tmp_path / "learner_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "buffer_stats.jsonl").write_text(json.dumps({"time": 760.0, "fill": 0.1, "accepted_total": 9}) + "\n")
    actor = ActorDiagnostics("actor-0")
    trace = "environment raised RuntimeError: no tool 'calc'\nTraceback (most recent call last):\n  File \"env.py\", line 3"
    actor.add([_episode(trajectory_pb2.EPISODE_STATUS_FAILED, trace)] * 3 + [_episode(trajectory_pb2.EPISODE_STATUS_TRUNCATED)])
    write_snapshot(tmp_path / "actors" / "actor-0.json", actor.snapshot())
    tokenizer = byte_tokenizer()
    samples = SampleLog(tmp_path / SAMPLES_FILE, lambda ids: str(tokenizer.decode(list(ids))), every=1)
    samples.observe(10, [_episode(trajectory_pb2.EPISODE_STATUS_OK, text="8", reward=1.0), _episode(trajectory_pb2.EPISODE_STATUS_OK)])
    samples.close()
    return tmp_path


def test_the_report_shows_generation_failures_and_samples(tmp_path: Path) -> None:
    report_path = write_report(_run_dir(tmp_path))
    assert report_path is not None
    report = report_path.read_text()
    assert "- wall time: 11.0 min (first step 60 s after the start)" in report  # 100 -> 760, not 160 -> 700
    assert "## Generation" in report and "sampled tokens/s (all actors" in report
    assert "mean completion length: 5.0 sampled tokens per episode" in report
    assert "truncated episodes: 25.0%" in report
    assert "600 sampled, 300 trained on" in report
    assert "a group's latency (median over 10 steps): generated in 0.55 s" in report and "trained 0.30 s after" in report
    assert "| 3 | failed: environment raised RuntimeError: no tool 'calc' |" in report
    assert 'File "env.py", line 3' in report  # the example traceback
    assert "## Sample episodes" in report and "**best** of step 10" in report and "8 8 8" in report


def test_a_failed_run_with_nothing_recorded_writes_no_report(tmp_path: Path) -> None:
    assert write_report(tmp_path, failure="learner exited with code 1") is None
    assert not (tmp_path / "report.md").exists()
    run = _run_dir(tmp_path / "trained")
    report = write_report(run, failure="learner exited with code 1\nlast lines: OOM")
    assert report is not None and "**The run failed**" in report.read_text() and "OOM" in report.read_text()


def test_the_duty_cycle_plot_is_a_moving_window() -> None:
    # Busy for the first 10 s (ten 1 s steps), then one step at t=100 after 89 s of waiting.
    records = [{"time": float(t), "step_seconds": 1.0} for t in range(1, 11)] + [{"time": 100.0, "step_seconds": 1.0}]
    times, duty = windowed_duty(records, window=60.0)
    assert times[-1] == 100.0
    assert duty[9] == pytest.approx(1.0)  # busy the whole time so far
    assert duty[-1] == pytest.approx(1.0 / 60.0)  # only the last step lies in the last minute
    # The cumulative figure (11 busy seconds of 100) would still read 0.11.


def test_progress_shows_what_the_actors_generate(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    options = RunOptions(manifest=tmp_path / "job.yaml", job=RLJob(), mode="async", run_dir=run, live=False)
    with Progress(options) as progress:
        progress.refresh()
        line = progress.summary()
    assert "sampled tok/s " in line and "sampled tok/s -" not in line
    assert "len 5.0" in line and "truncated 0.25" in line and "failed 3" in line
    table = "\n".join(str(row) for row in progress.render().columns[1]._cells)
    assert "3 (top: 3 x failed: environment raised RuntimeError" in table


def test_stoker_run_that_fails_before_training_says_so_and_writes_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from stoker.runner import local

    manifest = tmp_path / "job.yaml"
    manifest.write_text("apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: t}\n")
    monkeypatch.setattr(local, "run_async", lambda options: local.Outcome(1, "learner exited with code 1; stopping the run."))
    args = argparse.Namespace(file=str(manifest), mode="async", run_dir=tmp_path / "run", max_minutes=None,
                              target_success=None, max_steps=None, no_progress=True)
    assert local.main(args) == 1
    assert not (tmp_path / "run" / "report.md").exists()
    assert "no report: nothing was trained; logs in" in capsys.readouterr().err


class _StarvedBuffer:
    """A buffer whose Stats say what the FrozenLake example with 0.5 s steps showed."""

    def stats(self) -> buffer_pb2.BufferStats:
        stats = buffer_pb2.BufferStats(put_rate=4.75, sample_rate=4.75, fill=0.02, committed_groups_total=60)
        # One actor reports a core busy sampling: CPU-bound, so replicas, not concurrency.
        stats.actor_loads["actor-0"].CopyFrom(buffer_pb2.ActorLoad(cpu_cores=0.97, episodes_in_flight=7.8, concurrency=8))
        return stats

    def close(self) -> None:
        pass


def test_progress_and_report_name_the_bottleneck_and_the_knob(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    options = RunOptions(manifest=tmp_path / "job.yaml", job=RLJob(), mode="async", run_dir=run, live=False)
    with Progress(options) as progress:
        progress._buffer_client = _StarvedBuffer()
        progress.state.fold({"step": 1, "duty_cycle": 0.02})
        progress._poll_buffer()
        assert "bottleneck" not in progress.summary()  # the first steps measure the compile
        progress.state.fold({"step": 5, "duty_cycle": 0.049, "time": 1.0, "success_rate": 0.1})
        progress._poll_buffer()
        line = progress.summary()
    assert "bottleneck: actors deliver 4.75 trajectories/s and a step needs 32, so the learner waits 95 %" in line
    assert "each actor uses 0.97 cores and runs 7.8 of its 8 episode slots: CPU-bound; raise actors.replicas from" in line
    assert "actors.concurrency) would not help" in line and "actors' CPU" not in line
    (run / "learner_metrics.jsonl").write_text('{"time": 1.0, "step": 5, "duty_cycle": 0.049, "success_rate": 0.1}\n')
    report = write_report(run)
    assert report is not None
    text = report.read_text()
    assert "what capped the learner (2 buffer samples): actors 50 %" in text
    assert "last bottleneck seen: actors deliver 4.75 trajectories/s" in text and "CPU-bound; raise actors.replicas" in text
    # The advice's knob and promise travel with each sample, for whoever follows it.
    sample = json.loads((run / "buffer_stats.jsonl").read_text().splitlines()[-1])
    assert sample["bottleneck"]["knob"] == "actors.replicas" and sample["bottleneck"]["factor"] > 1
    assert sample["actor_load"] == {"actors": 1, "cpu_cores": 0.97, "episodes_in_flight": 7.8, "slots": 8}
