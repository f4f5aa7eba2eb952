"""Every cross-field rule holds on both sides: the CRD's CEL (what `kubectl apply` admits) and
`stoker validate` (what the operator runs) accept and refuse the same specs, from one table.

The CEL rules run in a real CEL implementation (cel-python), the way the API server runs them: schema defaults applied first (leaves only, under objects that are present), every rule
evaluated at its schema node with ``self`` (and ``oldSelf`` on updates, transition rules only
where the old object has that node too), a rule failing when it is false or errors.

cel-python has the standard library; the one Kubernetes extension the rules use, ``split`` from
the strings library, is registered here with cel-go's semantics.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
from celpy import celtypes

import pytest

from stoker.crd import build_crd
from stoker.jobname import max_name_length
from stoker.manifest import validate_document
from stoker.spec import TPU_ACCELERATORS, LearnerSpec
from stoker.spec_cel import MULTIPLE_OF_4
from stoker.tpu import ACCELERATORS

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _split(text: Any, separator: Any) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(part) for part in str(text).split(str(separator))])


FUNCTIONS = {"split": _split}


def root_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server stores: ``default``s filled in where the parent object exists."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule), functions=FUNCTIONS)
    return _PROGRAMS[rule]


def failures(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Every (schema path, message) whose rule refuses ``obj`` (an update from ``old`` if given)."""
    schema = root_schema()
    new_value = apply_defaults(schema, obj)
    old_value = apply_defaults(schema, old) if old is not None else None
    out: list[tuple[str, str]] = []
    _walk(schema, new_value, old_value, "", out)
    return out


def _walk(schema: dict[str, Any], value: Any, old: Any, path: str, out: list[tuple[str, str]]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _program(rule["rule"]).evaluate(activation)
        except celpy.CELEvalError:
            result = False
        if not (isinstance(result, celtypes.BoolType) and bool(result)):  # false, or an error value
            out.append((path, rule["message"]))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value and value[name] is not None:
                child_old = old.get(name) if isinstance(old, dict) else None
                _walk(sub, value[name], child_old, f"{path}.{name}" if path else name, out)


# ------------------------------------------------------------------------------------ the table

Case = tuple[str, str, dict[str, Any], str | None]  # id, metadata.name, spec, refused field (None: valid)

def learner(**fields: Any) -> dict[str, Any]:
    return {"learner": fields}


def rollout(**fields: Any) -> dict[str, Any]:
    return {"rollout": fields}


CASES: list[Case] = [
    ("defaults", "lake", {}, None),
    ("v6e single host", "lake", learner(accelerator="tpu-v6e-slice", topology="2x4"), None),
    ("v6e multislice", "lake", learner(accelerator="tpu-v6e-slice", topology="4x4", numSlices=2), None),
    ("v5p 4x4x8", "lake", learner(accelerator="tpu-v5p-slice", topology="4x4x8"), None),
    ("v4 small 3-D", "lake", learner(accelerator="tpu-v4-podslice", topology="2x2x1"), None),
    ("tpu7x", "lake", learner(accelerator="tpu7x", topology="4x4x4"), None),
    ("v5e 16x16", "lake", learner(accelerator="tpu-v5-lite-podslice", topology="16x16"), None),
    ("v4 12x12x12", "lake", learner(accelerator="tpu-v4-podslice", topology="12x12x12"), None),
    ("v6e 2x2x2", "lake", learner(accelerator="tpu-v6e-slice", topology="2x2x2"), "spec.learner.topology"),
    ("v6e 2x8", "lake", learner(accelerator="tpu-v6e-slice", topology="2x8"), "spec.learner.topology"),
    ("v5p 4x4x6", "lake", learner(accelerator="tpu-v5p-slice", topology="4x4x6"), "spec.learner.topology"),
    ("v5p 2x2x3", "lake", learner(accelerator="tpu-v5p-slice", topology="2x2x3"), "spec.learner.topology"),
    ("v4 2-D", "lake", learner(accelerator="tpu-v4-podslice", topology="2x4"), "spec.learner.topology"),
    ("v4 too many chips", "lake", learner(accelerator="tpu-v4-podslice", topology="16x16x32"), "spec.learner.topology"),
    ("tpu without topology", "lake", learner(accelerator="tpu-v5p-slice"), "spec.learner.topology"),
    ("cpu ignores topology", "lake", learner(topology="2x2x2"), None),
    ("weights in a bucket", "lake", learner(weightsVolume={"gcsBucket": "my-weights"}), None),
    # The expert axis splits whole experts: it must divide them, and a dense model has none.
    ("ep divides the experts", "lake", {**learner(mesh={"ep": 4}), "model": {"architecture": {"numExperts": 8}}}, None),
    ("ep 1 on a dense model", "lake", learner(mesh={"ep": 1}), None),
    ("ep does not divide the experts", "lake", {**learner(mesh={"ep": 3}), "model": {"architecture": {"numExperts": 8}}},
     "spec.learner.mesh.ep"),
    ("ep on a dense model", "lake", learner(mesh={"ep": 2}), "spec.learner.mesh.ep"),
    ("weights on a claim", "lake", learner(weightsVolume={"persistentVolumeClaim": "weights"}), None),
    ("weights volume of neither kind", "lake", learner(weightsVolume={}), "spec.learner.weightsVolume"),
    ("weights volume of both kinds", "lake",
     learner(weightsVolume={"gcsBucket": "my-weights", "persistentVolumeClaim": "weights"}), "spec.learner.weightsVolume"),
    # Master weights in bfloat16: not under LoRA, and not at rates whose updates would round away.
    ("bfloat16 weights and state", "lake", learner(weightDtype="bfloat16", optimizerStateDtype="bfloat16"), None),
    ("bfloat16 weights at 1e-5", "lake", {**learner(weightDtype="bfloat16"), "algorithm": {"learningRate": 1e-5}}, None),
    ("bfloat16 weights at 1e-6", "lake", {**learner(weightDtype="bfloat16"), "algorithm": {"learningRate": 1e-6}},
     "spec.learner.weightDtype"),
    ("float32 weights at 1e-6", "lake", {"algorithm": {"learningRate": 1e-6}}, None),
    ("bfloat16 weights with lora", "lake", {**learner(weightDtype="bfloat16"), "model": {"lora": {"rank": 4}}},
     "spec.learner.weightDtype"),
    ("bfloat16 state with lora", "lake", {**learner(optimizerStateDtype="bfloat16"), "model": {"lora": {"rank": 4}}}, None),
    ("grpo groupSize 1", "lake", {"buffer": {"groupSize": 1}}, "spec.buffer.groupSize"),
    ("gspo groupSize 1", "lake", {"buffer": {"groupSize": 1}, "algorithm": {"name": "gspo"}}, "spec.buffer.groupSize"),
    ("ppo groupSize 1", "lake", {"buffer": {"groupSize": 1}, "algorithm": {"name": "ppo"}}, None),
    ("gspo m2po", "lake", {"algorithm": {"name": "gspo", "offPolicyCorrection": "m2po"}}, "spec.algorithm.offPolicyCorrection"),
    ("dpo lag-clip", "lake", {"algorithm": {"name": "dpo", "offPolicyCorrection": "lag-clip"}}, "spec.algorithm.offPolicyCorrection"),
    ("grpo lag-clip", "lake", {"algorithm": {"offPolicyCorrection": "lag-clip"}}, None),
    ("ppo m2po", "lake", {"algorithm": {"name": "ppo", "offPolicyCorrection": "m2po"}}, None),
    ("gspo episode", "lake", {"algorithm": {"name": "gspo", "offPolicyCorrection": "episode"}},
     "spec.algorithm.offPolicyCorrection"),
    ("ppo episode", "lake", {"algorithm": {"name": "ppo", "offPolicyCorrection": "episode"}}, None),
    # The buffer's own bounds, which Configure applies live too: a complete group must fit.
    ("capacity below groupSize", "lake", {"buffer": {"capacity": 1}}, "spec.buffer.capacity"),
    ("capacity below the default groupSize", "lake", {"buffer": {"capacity": 7}}, "spec.buffer.capacity"),
    ("capacity = groupSize", "lake", {"buffer": {"capacity": 4, "groupSize": 4}}, None),
    ("maxStaleness at its bound", "lake", {"buffer": {"maxStaleness": 1_000_000}}, None),
    ("sft with its dataset", "lake", {"algorithm": {"name": "sft", "sft": {"dataset": "chats.jsonl"}}}, None),
    ("sft without its dataset", "lake", {"algorithm": {"name": "sft"}}, "spec.algorithm.sft"),
    ("sft groupSize 1", "lake", {"algorithm": {"name": "sft", "sft": {"dataset": "c.jsonl"}}, "buffer": {"groupSize": 1}}, None),
    ("sft colocated", "lake", {"algorithm": {"name": "sft", "sft": {"dataset": "c.jsonl"}}, "mode": "colocated"}, "spec.mode"),
    ("distill with its teacher", "lake", {"algorithm": {"name": "distill", "teacher": {"checkpoint": "/m/t"}}}, None),
    ("distill without a teacher", "lake", {"algorithm": {"name": "distill"}}, "spec.algorithm.teacher"),
    ("buckets descending", "lake", learner(sequenceBuckets=[256, 128]), "spec.learner.sequenceBuckets"),
    ("buckets repeated", "lake", learner(sequenceBuckets=[128, 128]), "spec.learner.sequenceBuckets"),
    ("bucket below 8", "lake", learner(sequenceBuckets=[4, 16]), "spec.learner.sequenceBuckets"),
    ("bucket above maxSeqLen", "lake", learner(sequenceBuckets=[128, 1024]), "spec.learner.sequenceBuckets"),
    ("bucket within a longer maxSeqLen", "lake",
     {**learner(sequenceBuckets=[128, 1024]), "model": {"architecture": {"maxSeqLen": 1024}}}, None),
    ("heads not a multiple of kv heads", "lake", {"model": {"architecture": {"numHeads": 4, "numKvHeads": 3}}},
     "spec.model.architecture"),
    ("hidden not a multiple of heads", "lake", {"model": {"architecture": {"hiddenSize": 66}}}, "spec.model.architecture"),
    ("hidden free with headDim", "lake", {"model": {"architecture": {"hiddenSize": 66, "headDim": 16}}}, None),
    ("minReplicas above maxReplicas", "lake", {"actors": {"minReplicas": 5, "maxReplicas": 3}}, "spec.actors.minReplicas"),
    ("minReplicas above the default max", "lake", {"actors": {"minReplicas": 9}}, "spec.actors.minReplicas"),
    ("service account disaggregated", "lake", learner(serviceAccountName="trainer"), None),
    ("service account colocated", "lake", {**learner(serviceAccountName="trainer"), "mode": "colocated"},
     "spec.learner.serviceAccountName"),
    ("colocated single-host tpu", "lake", {**learner(accelerator="tpu-v6e-slice", topology="2x4"), "mode": "colocated"},
     None),
    ("colocated multi-host tpu", "lake", {**learner(accelerator="tpu-v6e-slice", topology="4x4"), "mode": "colocated"},
     "spec.mode"),
    ("colocated multislice", "lake",
     {**learner(accelerator="tpu-v6e-slice", topology="2x4", numSlices=2), "mode": "colocated"}, "spec.mode"),
    ("frozenlake eval seeds", "lake", {"environment": {"evalTasks": ["17", "23"]}}, None),
    ("frozenlake eval not a seed", "lake", {"environment": {"evalTasks": ["17", "lake-b"]}}, "spec.environment.evalTasks"),
    ("frozenlake eval negative seed", "lake", {"environment": {"evalTasks": ["-1"]}}, "spec.environment.evalTasks"),
    ("answers eval ids", "lake", {"environment": {"name": "answers", "evalTasks": ["held.jsonl", "q7"]}}, None),
    # spec.rollout: the accelerator's own fields only, a slice GKE has, bounds in order.
    ("rollout defaults", "lake", rollout(), None),
    ("rollout nvidia-gpu", "lake", rollout(accelerator="nvidia-gpu", gpus=2, gpuType="nvidia-l4"), None),
    ("rollout v6e single host", "lake", rollout(accelerator="tpu-v6e-slice", topology="2x4"), None),
    ("rollout v5p multi-host", "lake", rollout(accelerator="tpu-v5p-slice", topology="2x2x4", maxReplicas=2), None),
    ("rollout tpu without topology", "lake", rollout(accelerator="tpu-v6e-slice"), "spec.rollout.topology"),
    ("rollout tpu bad topology", "lake", rollout(accelerator="tpu-v6e-slice", topology="2x8"), "spec.rollout.topology"),
    ("rollout topology on a gpu", "lake", rollout(accelerator="nvidia-gpu", topology="2x4"), "spec.rollout.topology"),
    ("rollout topology on cpu", "lake", rollout(topology="2x2"), "spec.rollout.topology"),
    ("rollout gpus on a tpu", "lake", rollout(accelerator="tpu-v6e-slice", topology="1x1", gpus=2), "spec.rollout.gpus"),
    ("rollout gpuType on cpu", "lake", rollout(gpuType="nvidia-l4"), "spec.rollout.gpuType"),
    ("rollout minReplicas above maxReplicas", "lake", rollout(minReplicas=3, maxReplicas=2), "spec.rollout.minReplicas"),
    ("rollout minReplicas above the default max", "lake", rollout(minReplicas=5), "spec.rollout.minReplicas"),
    ("rollout in colocated mode", "lake", {**rollout(), "mode": "colocated"}, "spec.rollout"),
    # rollout.tensorParallel: at most the server's chips where the spec says how many it has.
    ("rollout tensorParallel on cpu", "lake", rollout(tensorParallel=8), None),
    ("rollout tensorParallel = gpus", "lake", rollout(accelerator="nvidia-gpu", gpus=4, tensorParallel=4), None),
    ("rollout tensorParallel above gpus", "lake", rollout(accelerator="nvidia-gpu", gpus=2, tensorParallel=4),
     "spec.rollout.tensorParallel"),
    ("rollout tensorParallel above the default gpus", "lake", rollout(accelerator="nvidia-gpu", tensorParallel=2),
     "spec.rollout.tensorParallel"),
    ("rollout tensorParallel = a v6e 2x4", "lake", rollout(accelerator="tpu-v6e-slice", topology="2x4", tensorParallel=8), None),
    ("rollout tensorParallel above a v6e 2x4", "lake",
     rollout(accelerator="tpu-v6e-slice", topology="2x4", tensorParallel=16), "spec.rollout.tensorParallel"),
    ("rollout tensorParallel over every host of a v5p 2x2x4", "lake",
     rollout(accelerator="tpu-v5p-slice", topology="2x2x4", maxReplicas=2, tensorParallel=16), None),
    ("rollout tensorParallel above a v5p 2x2x4", "lake",
     rollout(accelerator="tpu-v5p-slice", topology="2x2x4", maxReplicas=2, tensorParallel=32), "spec.rollout.tensorParallel"),
    ("rollout tensorParallel on a bad topology", "lake",
     rollout(accelerator="tpu-v6e-slice", topology="2x8", tensorParallel=64), "spec.rollout.topology"),
    ("rollout tensorParallel on a tpu without topology", "lake",
     rollout(accelerator="tpu-v6e-slice", tensorParallel=64), "spec.rollout.topology"),
    # Multi-host rollout servers: <name>-rollout-<server>-slice-0-<host>-abcde <= 63 characters.
    ("name at the rollout limit", "a" * 37, rollout(accelerator="tpu-v5p-slice", topology="2x2x4"), None),
    ("name over the rollout limit", "a" * 38, rollout(accelerator="tpu-v5p-slice", topology="2x2x4"), "metadata.name"),
    ("name over the rollout limit with 10 servers", "a" * 37,
     rollout(accelerator="tpu-v5p-slice", topology="2x2x4", maxReplicas=11), "metadata.name"),
    ("single-host rollout keeps the learner's limit", "a" * 39, rollout(accelerator="tpu-v6e-slice", topology="2x4"), None),
    ("name with a leading digit", "1lake", {}, "metadata.name"),
    # JobSet's rule: <name>-learner-slice-<slice>-<host>-abcde <= 63 characters.
    ("name at the limit", "a" * 39, {}, None),
    ("name over the limit", "a" * 40, {}, "metadata.name"),
    ("name at the limit with 11 slices", "a" * 38,
     learner(accelerator="tpu-v6e-slice", topology="2x4", numSlices=11), None),
    ("name over the limit with 11 slices", "a" * 39,
     learner(accelerator="tpu-v6e-slice", topology="2x4", numSlices=11), "metadata.name"),
    ("name at the limit with 32 hosts", "a" * 38, learner(accelerator="tpu-v5p-slice", topology="4x4x8"), None),
    ("name over the limit with 32 hosts", "a" * 39, learner(accelerator="tpu-v5p-slice", topology="4x4x8"), "metadata.name"),
    ("name over the limit with 10 hosts (v6e 8x8 is 16)", "a" * 39, learner(accelerator="tpu-v6e-slice", topology="8x8"),
     "metadata.name"),
]


def manifest(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


@pytest.mark.parametrize(("case", "name", "spec", "refused"), CASES, ids=[c[0] for c in CASES])
def test_cel_and_stoker_validate_agree(case: str, name: str, spec: dict[str, Any], refused: str | None) -> None:
    cel_refusals = failures(manifest(name, spec))
    _, problems = validate_document(manifest(name, spec), "job.yaml")
    if refused is None:
        assert cel_refusals == [] and problems == [], (cel_refusals, [str(p) for p in problems])
        return
    assert [p.path for p in problems] == [refused], [str(p) for p in problems]
    # The CEL rule that refuses it sits on the refused field or an object above it.
    assert cel_refusals, "the API server would admit a spec stoker validate refuses"
    for node, _ in cel_refusals:
        assert refused.startswith(node), (node, refused)


def test_name_limit_is_jobsets_pod_name_rule() -> None:
    """The longest pod name JobSet's webhook checks, built as its GenPodName does, is 63 characters."""
    for slices, hosts in ((1, 1), (11, 1), (1, 32), (100, 100)):
        name = "a" * max_name_length(slices, hosts)
        longest_pod = f"{name}-learner-slice-{slices - 1}-{hosts - 1}" + "-abcde"
        assert len(longest_pod) == 63


def test_multiple_of_4_pattern() -> None:
    import re

    pattern = re.compile(f"^{MULTIPLE_OF_4}$")
    assert [n for n in range(1, 2000) if pattern.match(str(n))] == list(range(4, 2000, 4))


def test_every_tpu_in_the_spec_has_a_shape() -> None:
    assert set(TPU_ACCELERATORS) == set(ACCELERATORS)
    accepted = LearnerSpec.model_json_schema()["properties"]["accelerator"]["enum"]
    assert set(accepted) == {"cpu", *ACCELERATORS}


# ------------------------------------------------------------------------- transition rules

UPDATES: list[tuple[str, dict[str, Any], dict[str, Any], str | None]] = [
    ("replicas change", {"actors": {"replicas": 2}}, {"actors": {"replicas": 5}}, None),
    ("accelerator change", learner(accelerator="tpu-v6e-slice", topology="2x4"),
     learner(accelerator="tpu-v5-lite-podslice", topology="2x4"), "spec.learner.accelerator is immutable"),
    # The hole: no learner block at creation, then a TPU.
    ("accelerator added later", {}, learner(accelerator="tpu-v6e-slice", topology="2x4"), "spec.learner.accelerator is immutable"),
    ("topology change", learner(accelerator="tpu-v6e-slice", topology="2x4"),
     learner(accelerator="tpu-v6e-slice", topology="4x4"), "spec.learner.topology is immutable once set"),
    ("numSlices change", learner(accelerator="tpu-v6e-slice", topology="4x4", numSlices=2),
     learner(accelerator="tpu-v6e-slice", topology="4x4", numSlices=3), "spec.learner.numSlices is immutable"),
    ("numSlices set to its default", {}, learner(numSlices=1), None),
    ("numSlices added later", {}, learner(numSlices=2), "spec.learner.numSlices is immutable"),
    ("mode change", {}, {"mode": "colocated"}, "spec.mode is immutable"),
    # The learner's workload is never patched: an image edit would be admitted and never applied.
    ("learner image change", learner(image="stoker/learner:1"), learner(image="stoker/learner:2"),
     "spec.learner.image is immutable"),
    ("learner image set later", {}, learner(image="stoker/learner:2"), "spec.learner.image is immutable"),
    ("learner image unset later", learner(image="stoker/learner:1"), {}, "spec.learner.image is immutable"),
    ("learner image kept", learner(image="stoker/learner:1"), learner(image="stoker/learner:1", maxSteps=9), None),
    ("suspend", learner(accelerator="tpu-v6e-slice", topology="4x4"),
     {**learner(accelerator="tpu-v6e-slice", topology="4x4"), "suspend": True}, None),
]


@pytest.mark.parametrize(("case", "old", "new", "message"), UPDATES, ids=[u[0] for u in UPDATES])
def test_immutable_fields(case: str, old: dict[str, Any], new: dict[str, Any], message: str | None) -> None:
    refusals = [m for _, m in failures(manifest("lake", new), old=manifest("lake", old))]
    assert refusals == ([message] if message else [])


def test_stoker_validate_names_the_limit(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The command a user runs before `kubectl apply`: exit 2 and the limit for the job's shape."""
    import argparse

    import yaml

    from stoker.validate_cmd import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest("a" * 39, learner(accelerator="tpu-v5p-slice", topology="4x4x8"))))
    assert main(argparse.Namespace(files=[str(path)])) == 2
    err = capsys.readouterr().err
    assert f"{path}: metadata.name: got 39 characters; expected at most 38 for 1 slice(s) of 32 host(s)" in err
