"""The RLJob spec: defaults that work, camelCase YAML, and every user mistake explained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stoker.manifest import load_text
from stoker.spec import RLJob, RLJobSpec

REPO = Path(__file__).resolve().parents[2]

MINIMAL = "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: tiny}\n"


def test_minimal_manifest_gets_working_defaults() -> None:
    jobs, problems = load_text(MINIMAL, "m.yaml")
    assert problems == []
    spec = jobs[0].spec
    assert spec.algorithm.name == "grpo"
    assert spec.environment.name == "frozenlake"
    assert spec.mode == "disaggregated"
    assert spec.actors.replicas is None  # sized to the host (stoker run) or to admission (the operator)
    assert spec.actors.min_replicas <= spec.actors.max_replicas
    assert spec.learner.sequence_buckets[-1] <= spec.model.architecture.max_seq_len


def test_yaml_uses_camel_case_and_round_trips() -> None:
    text = MINIMAL + "spec:\n  buffer: {maxStaleness: 2, groupSize: 4}\n  learner: {batchGroups: 3}\n"
    jobs, problems = load_text(text, "m.yaml")
    assert problems == []
    spec = jobs[0].spec
    assert (spec.buffer.max_staleness, spec.buffer.group_size, spec.learner.batch_groups) == (2, 4, 3)
    dumped = spec.model_dump(by_alias=True)
    assert dumped["buffer"]["maxStaleness"] == 2
    assert RLJobSpec.model_validate(dumped) == spec


def test_multi_document_files_validate_each_document() -> None:
    text = MINIMAL + "---\n" + MINIMAL.replace("tiny", "second") + "---\nkind: Pod\napiVersion: v1\n"
    jobs, problems = load_text(text, "f.yaml")
    assert [j.metadata.name for j in jobs] == ["tiny", "second"]
    assert [str(p) for p in problems] == [
        "f.yaml[doc 3]: apiVersion: got 'v1'; expected 'stoker.dev/v1alpha1'",
        "f.yaml[doc 3]: kind: got 'Pod'; expected 'RLJob'",
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("spec: {actors: {minReplicas: 5, maxReplicas: 2}}", "spec.actors.minReplicas: got 5; expected <= maxReplicas (2)"),
        ("spec: {actors: {replicas: -1}}", "spec.actors.replicas: got -1; expected greater than or equal to 0"),
        ("spec: {actors: {replicas: many}}", "spec.actors.replicas: got 'many'; expected a valid integer"),
        ("spec: {algorithm: {name: a3c}}", "spec.algorithm.name: got 'a3c'; expected one of 'grpo', 'ppo', 'dpo', 'gspo', 'sft' or 'distill'"),
        ("spec: {bogus: 1}", "spec.bogus: unknown field"),
        ("spec: {learner: {accelerator: tpu-v5p-slice}}", "spec.learner.topology: missing; required for accelerator"),
        ("spec: {learner: {topology: 2by4}}", "spec.learner.topology: got '2by4'; expected match pattern"),
        ("spec: {learner: {sequenceBuckets: [256, 128]}}", "spec.learner.sequenceBuckets: got [256, 128]; expected strictly ascending"),
        ("spec: {buffer: {groupSize: 1}}", "spec.buffer.groupSize: got 1; expected >= 2"),
        ("spec: {actors: {weightPollSeconds: 0}}", "spec.actors.weightPollSeconds: got 0; expected greater than 0"),
        ("spec: {model: {architecture: {numHeads: 3, numKvHeads: 2}}}", "spec.model.architecture: numHeads must be a multiple of numKvHeads"),
        ("spec: {mode: hybrid}", "spec.mode: got 'hybrid'; expected one of 'disaggregated' or 'colocated'"),
        ("spec: {rollout: {tensorParallel: 0}}", "spec.rollout.tensorParallel: got 0; expected greater than or equal to 1"),
        ("spec: {rollout: {accelerator: nvidia-gpu, gpus: 2, tensorParallel: 4}}", "spec.rollout.tensorParallel: got 4; expected <= gpus (2)"),
        ("spec: {rollout: {accelerator: tpu-v6e-slice, topology: 2x4, tensorParallel: 16}}",
         "spec.rollout.tensorParallel: got 16; expected <= the 8 chips of a tpu-v6e-slice 2x4 slice"),
        ("spec: [1, 2]", "spec: got [1, 2]; expected a valid dictionary"),
        ("spec: {seed: 4294967301}", "spec.seed: got 4294967301; expected less than 4294967296"),
    ],
)
def test_each_problem_names_the_field_what_was_given_and_what_is_expected(body: str, expected: str) -> None:
    _, problems = load_text(MINIMAL + body + "\n", "job.yaml")
    lines = [str(p) for p in problems]
    assert any(line.startswith(f"job.yaml: {expected}") for line in lines), lines


def _validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "validate", *map(str, paths)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty; expected at least one RLJob document"),
        (b"apiVersion: [\n", "malformed YAML at line 2"),
        (bytes(range(256)) * 4, "not UTF-8 text"),
        (b"\x00\x01binary\x00", "binary data"),
        (b"- just\n- a list\n", "expected a mapping"),
        (b"apiVersion: v1\nkind: ConfigMap\n", "kind: got 'ConfigMap'; expected 'RLJob'"),
    ],
)
def test_validate_cli_explains_junk_without_a_traceback(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    result = _validate(path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_cli_accepts_the_example_and_reports_every_problem(tmp_path: Path) -> None:
    ok = _validate(REPO / "examples" / "frozenlake.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL + "spec:\n  actors: {replicas: -1, concurrency: 0}\n  extra: true\n")
    result = _validate(bad)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3
    assert {line.split(": ")[1] for line in lines} == {"spec.actors.replicas", "spec.actors.concurrency", "spec.extra"}
    missing = _validate(tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_kubectl_output_with_status_still_validates() -> None:
    job = RLJob.model_validate(
        {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x", "uid": "u"}, "status": {"phase": "Running"}}
    )
    assert job.status == {"phase": "Running"}


def test_the_actors_weight_poll_period_reaches_the_actor() -> None:
    from stoker.actor.settings import ActorSettings

    jobs, problems = load_text(MINIMAL + "spec:\n  actors: {weightPollSeconds: 2.5}\n", "m.yaml")
    assert problems == []
    assert ActorSettings.from_spec(jobs[0].spec, actor_id="a").weight_poll_seconds == 2.5


def test_the_conversation_cache_size_is_spelled_as_documented() -> None:
    jobs, problems = load_text(MINIMAL + "spec:\n  actors: {conversationCacheMiB: 0}\n", "m.yaml")
    assert problems == [] and jobs[0].spec.actors.conversation_cache_mib == 0
    assert "conversationCacheMiB" in jobs[0].spec.actors.model_dump(by_alias=True)
