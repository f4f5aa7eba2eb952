"""`stoker rollout` refuses bad input with one clear line and exit code 2 (no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "frozenlake-rollout.yaml"


def test_bad_flags_and_manifests_exit_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rollout", "--manifest", str(EXAMPLE), "--max-batch", "0"]) == 2
    assert "stoker rollout: --max-batch: got 0; expected >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("maxBatch: 16", "maxBatch: 0"))
    assert cli.main(["rollout", "--manifest", str(bad)]) == 2
    assert "maxBatch" in capsys.readouterr().err
    missing = tmp_path / "job.yaml"
    missing.write_text(EXAMPLE.read_text().replace("architecture: {vocabSize: 27}", "checkpoint: /nonexistent"))
    assert cli.main(["rollout", "--manifest", str(missing), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint" in err and "Traceback" not in err


def test_a_mesh_the_devices_cannot_take_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rollout", "--manifest", str(EXAMPLE), "--mesh", "tp=two"]) == 2
    assert "--mesh 'tp=two': expected tp=N" in capsys.readouterr().err
    assert cli.main(["rollout", "--manifest", str(EXAMPLE), "--port", "0", "--mesh", "tp=64"]) == 2
    err = capsys.readouterr().err
    assert "tp=64: the server has only 1 cpu device(s)" in err and "Traceback" not in err
    spec_tp = tmp_path / "tp.yaml"
    spec_tp.write_text(EXAMPLE.read_text().replace("maxBatch: 16", "maxBatch: 16\n    tensorParallel: 64"))
    assert cli.main(["rollout", "--manifest", str(spec_tp), "--port", "0"]) == 2  # spec.rollout.tensorParallel
    assert "tp=64: the server has only 1 cpu device(s)" in capsys.readouterr().err



def test_the_mesh_comes_from_the_spec_unless_the_flag_overrides_it() -> None:
    from stoker.manifest import load_job
    from stoker.rollout.settings import RolloutSettings

    job = load_job(EXAMPLE)
    spec = job.spec.model_copy(update={"rollout": job.spec.rollout.model_copy(update={"tensor_parallel": 4})})
    assert RolloutSettings.from_spec(spec).tensor_parallel == 4
    assert RolloutSettings.from_spec(spec, tensor_parallel=2).tensor_parallel == 2
    assert RolloutSettings.from_spec(job.spec).tensor_parallel is None  # rollout/mesh.py's default


def test_relay_discovery_flags_that_cannot_work_exit_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["rollout", "--manifest", str(EXAMPLE), "--port", "0"]
    cases = [
        (["--weights", "learner:50052", "--weights-relay-advertise", "10.0.0.5:50053"], "needs --weights-relay-port"),
        (["--weights", str(tmp_path), "--weights-relay-port", "50053", "--weights-relay-advertise", "10.0.0.5:50053"],
         "needs --weights ADDRESS"),
        (["--weights", "learner:50052", "--weights-relay-port", "50053", "--weights-relay-advertise", "10.0.0.5"],
         "--weights-relay-advertise 10.0.0.5: expected HOST:PORT"),
    ]
    for flags, reason in cases:
        assert cli.main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert reason in err and "Traceback" not in err
