"""How many actors a job runs with ``actors.replicas`` unset: the host's spare cores on one
machine, what admission keeps busy on a cluster; a set value is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import actor_count
from stoker.actor_count import cluster_actors, host_actors
from stoker.manifest import load_job
from stoker.runner import local, placement
from stoker.runner.local import AsyncRun, RunOptions
from stoker.spec import RLJob, RLJobSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "frozenlake.yaml"


def _spec(**actors: object) -> RLJobSpec:
    # The example's loop: admission lets (2 + 1) x 4 x 8 = 96 episodes out at once.
    return RLJobSpec.model_validate({"actors": {"concurrency": 8, **actors}, "buffer": {"groupSize": 8, "maxStaleness": 2},
                                     "learner": {"batchGroups": 4}})


def test_the_shipped_example_leaves_its_actors_to_the_host() -> None:
    assert load_job(EXAMPLE).spec.actors.replicas is None


def test_an_unset_count_takes_the_cores_left_after_the_buffer_and_learner() -> None:
    six = host_actors(_spec(maxReplicas=16), 8)
    assert six.replicas == 6
    assert six.why == "unset actors.replicas: 8 cores, 1 for the buffer, 1 for the learner, 6 for actors"
    # The TPU host of issue 50: 13 cores hold 11 actors; admission feeds 12; maxReplicas says 8.
    tpu = host_actors(_spec(), 13)
    assert tpu.replicas == 8 and tpu.why.endswith("11 for actors; actors.maxReplicas 8")
    # A 2-core machine: no core is spare, one actor all the same.
    two = host_actors(_spec(), 2)
    assert two.replicas == 1 and "none left for actors, so one all the same" in two.why
    # A learner over 2 processes and a rollout server take a core each.
    split = host_actors(_spec(maxReplicas=16), 8, learner_processes=2, rollout_processes=1)
    assert split.replicas == 4 and "2 for the learner, 1 for the rollout server, 4 for actors" in split.why


def test_admission_bounds_the_count_and_a_set_value_is_kept() -> None:
    # 96 episodes at 32 each keep 3 actors busy, whatever the cores.
    wide = host_actors(_spec(concurrency=32, maxReplicas=16), 13)
    assert wide.replicas == 3 and "admission lets 96 episodes out at once, 3 actor(s) at actors.concurrency 32" in wide.why
    assert host_actors(_spec(replicas=5), 2).replicas == 5
    assert host_actors(_spec(replicas=0), 64).replicas == 0


def test_the_operator_starts_an_unset_count_at_what_admission_keeps_busy() -> None:
    assert cluster_actors(_spec(maxReplicas=16)) == 12
    assert cluster_actors(_spec()) == 8  # maxReplicas
    assert cluster_actors(_spec(concurrency=64, minReplicas=3)) == 3  # 2 fed, minReplicas 3
    assert cluster_actors(_spec(replicas=2)) == 2


def test_a_local_run_starts_and_announces_the_actors_the_host_feeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[str] = []

    class RecordingChild:
        def __init__(self, name: str, argv: list[str], log: Path):
            self.name, self.argv = name, argv

        def start(self, env: dict[str, str]) -> None:
            started.append(self.name)

    monkeypatch.setattr(local, "Child", RecordingChild)
    monkeypatch.setattr(local, "wait_for_ready_file", lambda path, child: f"unix://{tmp_path}/buffer.sock")
    monkeypatch.setattr(actor_count, "host_cores", lambda: 5)
    monkeypatch.setattr(placement, "host_cores", lambda: 5)
    job = RLJob.model_validate({"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "lake"},
                                "spec": _spec().model_dump(by_alias=True)})
    run = AsyncRun(RunOptions(manifest=tmp_path / "job.yaml", job=job, mode="async", run_dir=tmp_path / "run", live=False))
    run.start({"PATH": "/bin"})
    assert [name for name in started if name.startswith("actor-")] == ["actor-0", "actor-1", "actor-2"]
    assert "stoker run: actors: 3 (unset actors.replicas: 5 cores, 1 for the buffer, 1 for the learner, 3 for actors)" \
        in capsys.readouterr().err
    assert run.placement.host.cores == 5 and run.placement.host.reserved == 2
