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
