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


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return root, tmp_path / "self-cgroup"


def test_a_cgroup_v2_cpu_quota_caps_the_cores_the_smallest_along_the_path(tmp_path: Path) -> None:
    """A container's CPU limit (Kubernetes limits.cpu, a VM's cap) is a quota nproc does not show:
    13 cores in the affinity mask under 4 cores of quota feed 2 actors, not 11."""
    root, membership = _cgroup(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000\n", "kubepods/cpu.max": "1200000 100000\n",
        "kubepods/pod1/cpu.max": "350000 100000\n", "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert actor_count.cpu_quota_cores(root, membership) == 3.5
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert actor_count.cpu_quota_cores(root, membership) == 12.0
    (root / "kubepods/cpu.max").write_text("max 100000\n")
    assert actor_count.cpu_quota_cores(root, membership) is None  # no limit anywhere


def test_a_cgroup_v1_cfs_quota_counts_and_minus_one_means_none(tmp_path: Path) -> None:
    root, membership = _cgroup(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/job\n0::/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/job/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"})
    assert actor_count.cpu_quota_cores(root, membership) == 4.0
    (root / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert actor_count.cpu_quota_cores(root, membership) is None
    assert actor_count.cpu_quota_cores(root, tmp_path / "no-such-file") is None  # not Linux, or no /proc


def test_the_host_cores_are_the_affinity_mask_capped_by_the_quota_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actor_count.os, "sched_getaffinity", lambda pid: set(range(13)))
    monkeypatch.setattr(actor_count, "cpu_quota_cores", lambda: 3.5)
    assert actor_count.host_cores() == 4
    monkeypatch.setattr(actor_count, "cpu_quota_cores", lambda: 0.5)
    assert actor_count.host_cores() == 1
    monkeypatch.setattr(actor_count, "cpu_quota_cores", lambda: 64.0)
    assert actor_count.host_cores() == 13
    monkeypatch.setattr(actor_count, "cpu_quota_cores", lambda: None)
    assert actor_count.host_cores() == 13
    monkeypatch.setattr(actor_count, "cpu_quota_cores", lambda: 4.0)
    counted = actor_count.host_actors(_spec(), actor_count.host_cores())
    assert counted.replicas == 2 and "4 cores (the cgroup's CPU quota)" in counted.why
