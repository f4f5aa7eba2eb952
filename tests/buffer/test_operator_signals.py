"""What the operator reads from and writes to the buffer: the learner's duty cycle echoed in Stats,
and the admission scale file that tightens the AReaL credit."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.core import BufferCore
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import ADMISSION_FILE_ENV, BufferSettings
from stoker.spec import RLJobSpec
from stoker.trajectory import Episode
from tests.buffer.core_fakes import FakeClock

Groups = Callable[..., list[Episode]]
ServerFactory = Callable[..., BufferServer]


def write_scale(path: Path, text: str, mtime_ns: int) -> None:
    """Replace the file as Kubernetes updates a mounted ConfigMap (a new file swapped in), with an
    explicit mtime so that two writes within one timestamp tick still read as a change."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.utime(tmp, ns=(mtime_ns, mtime_ns))
    os.replace(tmp, path)


# settings fixture: max_staleness=2, batch_groups=2 -> credit (2 + 0 + 1) * 2 = 6 at version 0


def open_scaled_core(tmp_path: Path, settings: BufferSettings, scale: str, clock: FakeClock) -> tuple[BufferCore, Path]:
    """An open core whose admission file (written with ``scale`` first) is ``tmp_path/admission.json``."""
    scale_file = tmp_path / "admission.json"
    write_scale(scale_file, scale, 1_000_000_000)
    core = BufferCore(replace(settings, admission_file=str(scale_file)), tmp_path / "data", clock=clock)
    core.open()
    return core, scale_file


def test_duty_cycle_is_absent_until_the_learner_reports_one(server_factory: ServerFactory, settings: BufferSettings) -> None:
    server = server_factory(settings)
    with BufferClient(f"127.0.0.1:{server.port}", learner_id="learner") as client:
        client.wait_ready(10)
        assert not client.stats().HasField("learner_duty_cycle")
        client.set_policy_version(0)  # the learner's first report comes before any step: no duty cycle
        assert not client.stats().HasField("learner_duty_cycle")
        client.set_policy_version(1, duty_cycle=0.75)
        stats = client.stats()
        assert stats.HasField("learner_duty_cycle") and stats.learner_duty_cycle == pytest.approx(0.75)
        assert stats.policy_version == 1
        # A report of the same version still carries a fresh duty cycle; the latest one wins.
        client.set_policy_version(1, duty_cycle=0.0)
        stats = client.stats()
        assert stats.HasField("learner_duty_cycle") and stats.learner_duty_cycle == 0.0  # zero is not "unknown"
        # A report without one keeps the last known value.
        client.set_policy_version(2)
        stats = client.stats()
        assert stats.policy_version == 2 and stats.learner_duty_cycle == 0.0


def test_an_impossible_duty_cycle_is_refused_and_changes_nothing(
    server_factory: ServerFactory, settings: BufferSettings
) -> None:
    server = server_factory(settings)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.wait_ready(10)
        client.set_policy_version(1, duty_cycle=0.5)
        with pytest.raises(grpc.RpcError) as caught:
            client.set_policy_version(2, duty_cycle=1.5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "learner_duty_cycle" in (caught.value.details() or "")
        stats = client.stats()
        assert stats.policy_version == 1 and stats.learner_duty_cycle == 0.5


def test_admission_scale_halves_the_credit_and_recovers(tmp_path: Path, settings: BufferSettings) -> None:
    clock = FakeClock()
    core, scale_file = open_scaled_core(tmp_path, settings, '{"admissionScale": 1.0}', clock)
    try:
        stats = core.stats()
        assert stats.admission_credit == 6 and stats.admission_scale == 1.0

        write_scale(scale_file, '{"admissionScale": 0.5}', 2_000_000_000)
        clock.now += 0.5  # the file is looked at no more than once a second
        assert core.acquire(1)[0] == 1
        assert core.stats().admission_scale == 1.0
        clock.now += 1.0
        # floor(0.5 * 6) = 3 groups may be outstanding, one already is.
        assert core.acquire(10)[0] == 2
        stats = core.stats()
        assert stats.admission_scale == 0.5 and stats.admission_credit == 0 and stats.in_flight_groups == 3
        assert core.acquire(1)[0] == 0
        core.release(3)
        assert core.stats().admission_credit == 3  # half of the idle buffer's 6

        write_scale(scale_file, '{"admissionScale": 1}', 3_000_000_000)
        clock.now += 1.0
        core.tick()  # the housekeeping timer notices it too, without any Acquire
        stats = core.stats()
        assert stats.admission_scale == 1.0 and stats.admission_credit == 6
        assert core.acquire(10)[0] == 6
    finally:
        core.close()


def test_scale_floors_and_never_goes_below_zero(tmp_path: Path, settings: BufferSettings) -> None:
    core, _ = open_scaled_core(tmp_path, settings, '{"admissionScale": 0.125}', FakeClock())
    try:
        assert core.stats().admission_credit == 0  # floor(0.125 * 6) = 0
        assert core.acquire(1) == (0, 0, settings.retry_after_seconds)
        core.set_policy_version(3)  # allowance (2 + 3 + 1) * 2 = 12 -> floor(1.5) = 1
        assert core.acquire(5)[0] == 1
    finally:
        core.close()


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"admissionScale": 0}', '{"admissionScale": 1.5}', '{"admissionScale": "half"}', '{"scale": 0.5}', "[0.5]"],
)
def test_a_malformed_file_means_scale_one_with_one_warning(
    tmp_path: Path, settings: BufferSettings, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    core, scale_file = open_scaled_core(tmp_path, settings, '{"admissionScale": 0.5}', clock)
    try:
        assert core.stats().admission_scale == 0.5
        write_scale(scale_file, content, 2_000_000_000)
        with caplog.at_level(logging.WARNING, logger="stoker.buffer"):
            for _ in range(3):
                clock.now += 1.0
                core.tick()
                core.acquire(0)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "admission" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert str(scale_file) in warnings[0].getMessage()
        stats = core.stats()
        assert stats.admission_scale == 1.0 and stats.admission_credit == 6
    finally:
        core.close()


def test_a_missing_file_is_scale_one_and_is_picked_up_once_it_appears(
    tmp_path: Path, settings: BufferSettings, caplog: pytest.LogCaptureFixture
) -> None:
    scale_file = tmp_path / "control" / "admission.json"
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="stoker.buffer"):
        core = BufferCore(replace(settings, admission_file=str(scale_file)), tmp_path / "data", clock=clock)
        core.open()
        for _ in range(3):
            clock.now += 1.0
            core.tick()
    try:
        assert sum("admission" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
        assert core.stats().admission_scale == 1.0 and core.stats().admission_credit == 6
        scale_file.parent.mkdir()
        write_scale(scale_file, '{"admissionScale": 0.5}', 1_000_000_000)
        assert core.state.admission.reload() == 0.5  # the reload the timer does, called directly
        assert core.stats().admission_credit == 3
    finally:
        core.close()


def test_the_server_takes_the_file_from_the_environment_and_reports_its_scale(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    scale_file = tmp_path / "admission.json"
    write_scale(scale_file, '{"admissionScale": 0.5}', 1_000_000_000)
    spec = RLJobSpec.model_validate({"buffer": {"groupSize": 2, "maxStaleness": 2}, "learner": {"batchGroups": 2}})
    settings = BufferSettings.from_spec(spec, environ={ADMISSION_FILE_ENV: str(scale_file)})
    assert settings.admission_file == str(scale_file)
    assert BufferSettings.from_spec(spec, environ={}).admission_file is None
    server = server_factory(settings)
    with BufferClient(f"127.0.0.1:{server.port}", client_id="actor") as client:
        client.wait_ready(10)
        stats = client.stats()
        assert stats.admission_scale == 0.5 and stats.admission_credit == 3
        assert client.acquire(10).granted == 3
