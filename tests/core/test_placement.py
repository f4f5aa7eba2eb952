"""Where `stoker run`'s servers listen, and which child holds this host's chip."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import chips
from stoker.endpoints import parse
from stoker.runner import placement
from stoker.runner.local import AsyncRun, RunOptions
from stoker.runner import local
from stoker.spec import RLJob


Started = list[tuple[str, list[str], dict[str, str]]]


def record_children(monkeypatch: pytest.MonkeyPatch) -> Started:
    """Children the run starts, recorded (name, argv, environment) instead of started."""
    started: Started = []

    class RecordingChild:
        def __init__(self, name: str, argv: list[str], log: Path):
            self.name, self.argv = name, argv

        def start(self, env: dict[str, str]) -> None:
            started.append((self.name, self.argv, env))

    monkeypatch.setattr(local, "Child", RecordingChild)
    return started


def test_unix_by_default_with_one_socket_per_server_and_tcp_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chips, "host_chips", lambda dev="/dev": [])
    unix = placement.plan(tmp_path, RLJob().spec, transport="unix")
    flag, address = unix.listen("buffer")
    assert flag == "--listen" and parse(address, where="x").path == str(tmp_path / "sockets" / "buffer.sock")
    assert unix.cpu_only_env == {} and "unix sockets in" in unix.describe()
    assert placement.plan(tmp_path, RLJob().spec, transport="tcp").listen("buffer") == ["--host", "127.0.0.1", "--port", "0"]
    with pytest.raises(placement.PlacementError, match="--transport carrier-pigeon: expected one of unix, tcp"):
        placement.plan(tmp_path, RLJob().spec, transport="carrier-pigeon")


def test_on_a_tpu_host_the_learner_holds_the_chip_and_the_rest_run_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(chips, "host_chips", lambda dev="/dev": ["/dev/accel0"])
    chosen = placement.plan(tmp_path, RLJob().spec, transport="unix")
    assert chosen.cpu_only_env == {"JAX_PLATFORMS": "cpu"}
    assert "TPU (1 chip device(s)) is held by the learner" in chosen.describe()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the whole run pinned to the CPU: no chip to share
    assert placement.plan(tmp_path, RLJob().spec, transport="unix").cpu_only_env == {}


def test_an_async_run_starts_its_servers_where_the_placement_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chips, "host_chips", lambda dev="/dev": ["/dev/accel0"])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    started = record_children(monkeypatch)
    monkeypatch.setattr(local, "wait_for_ready_file", lambda path, child: f"unix://{tmp_path}/run/sockets/buffer.sock")
    options = RunOptions(manifest=tmp_path / "job.yaml", job=RLJob(), mode="async", run_dir=tmp_path / "run", live=False)
    address = AsyncRun(options).start({"PATH": "/bin"})
    assert address == f"unix://{tmp_path}/run/sockets/buffer.sock"
    by_name = {name: (argv, env) for name, argv, env in started}
    assert "--listen" in by_name["buffer"][0] and "--host" not in by_name["buffer"][0]
    assert by_name["actor-0"][0][by_name["actor-0"][0].index("--buffer") + 1] == address
    assert by_name["actor-0"][1]["JAX_PLATFORMS"] == "cpu" and by_name["buffer"][1]["JAX_PLATFORMS"] == "cpu"
    assert "JAX_PLATFORMS" not in by_name["learner"][1]  # the learner holds the chip


def test_a_colocated_job_runs_its_learner_alone_on_the_chip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(chips, "host_chips", lambda dev="/dev": ["/dev/accel0"])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    started = record_children(monkeypatch)
    job = RLJob.model_validate({"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "c"},
                                "spec": {"mode": "colocated"}})
    options = RunOptions(manifest=tmp_path / "job.yaml", job=job, mode="async", run_dir=tmp_path / "run", live=False)
    assert AsyncRun(options).start({"PATH": "/bin"}) is None
    ((name, argv, env),) = started
    assert name == "learner" and "--buffer" not in argv and "JAX_PLATFORMS" not in env
    assert "learner's process plays the episodes and samples on its own devices" in capsys.readouterr().err
