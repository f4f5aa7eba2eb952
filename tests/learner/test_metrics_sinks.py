"""The metrics sinks: JSONL, TensorBoard event files beside it (read back), and an optional W&B run."""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2

from stoker.learner.metrics import MetricsSink
from stoker.runner.progress import RunState
from stoker.runner.report import time_to_reach, write_report


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(directory: Path) -> dict[tuple[str, int], float]:
    """Every scalar of the TFRecord event files under ``directory`` (framing CRCs checked)."""
    out: dict[tuple[str, int], float] = {}
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {directory}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            (length_crc,) = struct.unpack_from("<I", data, offset + 8)
            assert length_crc == _masked_crc(data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]
            (record_crc,) = struct.unpack_from("<I", data, offset + 12 + length)
            assert record_crc == _masked_crc(record)
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out[(value.tag, event.step)] = value.simple_value
    return out


def test_tensorboard_events_beside_the_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with MetricsSink(tmp_path / "learner_metrics.jsonl") as sink:
        sink.record({"step": 1, "loss": 0.5, "learning_rate": 1e-3, "trained": 1.0})
        sink.record({"step": 2, "loss": 0.25, "learning_rate": 2e-3, "grad_norm": float("nan")})
    lines = [json.loads(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in lines] == [0.5, 0.25]
    scalars = read_scalars(tmp_path / "tensorboard" / "learner_metrics")
    assert scalars[("loss", 1)] == 0.5 and scalars[("loss", 2)] == 0.25
    assert scalars[("learning_rate", 2)] == pytest.approx(2e-3)
    assert ("step", 1) in scalars and ("grad_norm", 2) not in scalars  # NaN stays in the JSONL only


def strict_json(line: str) -> Any:
    """Parse as jq, JavaScript and Go do: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_null_and_every_reader_skips_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    nan, inf = float("nan"), float("inf")
    with MetricsSink(tmp_path / "learner_metrics.jsonl") as sink:
        sink.record({"step": 1, "success_rate": 0.5, "grad_norm": nan, "loss": inf, "pg_loss": -inf})
        sink.record({"step": 2, "success_rate": nan, "loss": 0.25, "eval_policy_version": 0,
                     "eval_success_rate": 0.75, "eval_reward_mean": nan, "eval_episodes": 4})
    lines = [strict_json(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert [(r["grad_norm"], r["loss"], r["pg_loss"]) for r in lines[:1]] == [(None, None, None)]
    assert (lines[1]["success_rate"], lines[1]["loss"], lines[1]["eval_reward_mean"]) == (None, 0.25, None)
    assert time_to_reach(lines, "success_rate", 0.5) == 0.0
    report = write_report(tmp_path).read_text()
    assert "final rolling success rate: 0.500" in report
    assert "| 0 | 0.750 | 0.000 | 4 |" in report  # the round is kept; its missing mean reads 0
    state = RunState()
    for record in lines:
        state.fold(record)
    assert state.success_rate() == 0.5


class FakeRun:
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.logged: list[tuple[dict[str, float], int | None]] = []
        self.finished = False

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(values), step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    """A stand-in ``wandb`` module (the real one is not a dependency) recording its runs."""
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> FakeRun:
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    return runs


def test_wandb_logs_offline_when_installed_and_asked(
    tmp_path: Path, fake_wandb: list[FakeRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "stoker-test")
    with MetricsSink(tmp_path / "learner_metrics.jsonl") as sink:
        sink.record({"step": 3, "loss": 0.5, "policy": "ignored"})  # type: ignore[dict-item]
    (run,) = fake_wandb
    assert run.kwargs == {"project": "stoker-test", "name": "learner_metrics", "dir": str(tmp_path), "mode": "offline"}
    assert run.logged == [({"step": 3.0, "loss": 0.5}, 3)]
    assert run.finished


def test_wandb_stays_off_without_a_project(tmp_path: Path, fake_wandb: list[FakeRun]) -> None:
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        sink.record({"step": 1, "loss": 0.5})
    assert fake_wandb == []


def test_wandb_not_installed_is_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setenv("WANDB_PROJECT", "stoker-test")
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        sink.record({"step": 1, "loss": 0.5})
    assert "wandb is not installed" in caplog.text
