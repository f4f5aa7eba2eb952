"""buffer.maxStaleness and buffer.capacity edits reach the running buffer through Configure, without
rolling its pod; a restarted buffer reads them from the job file, which the operator keeps current."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from stoker.buffer.client import BufferClient
from stoker.buffer.settings import BufferSettings
from stoker.manifest import load_job
from stoker.operator.manifests import JOB_FILE_KEY, JobContext, build_buffer_deployment, build_spec_configmap
from stoker.operator.observe import StatsSnapshot
from stoker.operator.rollout import live_buffer_changes
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec

RLJOBS = "/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs"
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"


def ctx_of(**buffer: Any) -> JobContext:
    spec = RLJobSpec.model_validate({"buffer": buffer})
    return JobContext("lake", "research", "uid-1", spec, OperatorSettings(), actor_replicas=2)


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        ({"capacity": 4096, "max_staleness": 4}, {"max_staleness": 2}),
        ({"capacity": 100, "max_staleness": 2}, {"capacity": 4096}),
        ({"capacity": 100, "max_staleness": 7}, {"capacity": 4096, "max_staleness": 2}),
        ({"capacity": 4096, "max_staleness": 2}, {}),  # in step: no call
        ({"capacity": 100, "max_staleness": None}, {}),  # a buffer from before Configure: left alone
    ],
)
def test_the_call_brings_the_buffer_to_the_spec(reported: dict[str, Any], expected: dict[str, int]) -> None:
    spec = RLJobSpec.model_validate({"buffer": {"maxStaleness": 2}})
    assert live_buffer_changes(spec, StatsSnapshot(**reported)) == expected


@pytest.mark.parametrize("edit", [{"maxStaleness": 1}, {"capacity": 100}, {"maxStaleness": 0, "capacity": 9}])
def test_a_live_edit_keeps_the_buffer_pod_and_reaches_the_job_file(edit: dict[str, Any], tmp_path: Path) -> None:
    before, after = ctx_of(), ctx_of(**edit)
    assert build_buffer_deployment(before)["spec"]["template"] == build_buffer_deployment(after)["spec"]["template"]
    # A buffer restarted later (for any reason) reads the mounted job file: it has the new values.
    job_file = tmp_path / "job.yaml"
    job_file.write_text(build_spec_configmap(after)["data"][JOB_FILE_KEY])
    restarted = BufferSettings.from_spec(load_job(job_file).spec, environ={})
    assert (restarted.max_staleness, restarted.capacity) == (after.spec.buffer.max_staleness, after.spec.buffer.capacity)


def test_other_buffer_edits_still_roll_the_buffer_pod() -> None:
    template = build_buffer_deployment(ctx_of())["spec"]["template"]
    assert build_buffer_deployment(ctx_of(sampleOrder="newest-first"))["spec"]["template"] != template


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_editing_max_staleness_configures_the_running_buffer(buffer_process: tuple[str, str], operator_factory: Any) -> None:
    """The operator against kmock's emulator and a real ``stoker buffer`` (started with the spec's
    defaults): an edit of maxStaleness and capacity is applied by the buffer while its Deployment's
    pod template stays as it was."""
    address, token = buffer_process
    c = await operator_factory(buffer_address_template=address)
    job = "lake"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{job}-buffer-token"},
              "data": {"token": base64.b64encode(token.encode()).decode()}}
    await c.create("/api/v1/namespaces/{ns}/secrets", secret)
    await c.create(RLJOBS, {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": job},
                            "spec": {"actors": {"replicas": 2}}})
    await c.eventually(lambda: f"{job}-buffer" in c.names("apps/v1/deployments"), what="the buffer Deployment")
    await c.patch(DEPLOYMENTS + f"/{job}-buffer/status", {"status": {"readyReplicas": 1}})
    await c.eventually(lambda: "bufferFill" in (c.get("stoker.dev/v1alpha1/rljobs", job) or {}).get("status", {}),
                       what="Stats in status")
    template = c.get("apps/v1/deployments", f"{job}-buffer")["spec"]["template"]  # type: ignore[index]
    with BufferClient(address, token=token) as buffer:
        assert (buffer.stats().max_staleness, buffer.stats().capacity) == (4, 4096)  # in step: nothing sent
        assert not c.events("BufferConfigured")

        await c.patch(RLJOBS + f"/{job}", {"spec": {"buffer": {"maxStaleness": 1, "capacity": 1000}}})
        await c.eventually(lambda: buffer.stats().max_staleness == 1 and buffer.stats().capacity == 1000,
                           what="the buffer at maxStaleness 1, capacity 1000")
    await c.eventually(lambda: c.events("BufferConfigured"), what="a BufferConfigured Event")
    message = c.events("BufferConfigured")[0]["message"]
    assert "buffer.maxStaleness 4 -> 1" in message and "buffer.capacity 4096 -> 1000" in message
    job_file = yaml.safe_load(c.get("v1/configmaps", f"{job}-spec")["data"][JOB_FILE_KEY])  # type: ignore[index]
    assert job_file["spec"]["buffer"]["maxStaleness"] == 1  # what a restarted buffer reads
    assert c.get("apps/v1/deployments", f"{job}-buffer")["spec"]["template"] == template  # not rolled
