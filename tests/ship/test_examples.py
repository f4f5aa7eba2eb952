"""Every example a user copies validates: RLJobs with `stoker validate` and against the CRD's
schema, the Kueue queue matches the job that names it, and the GitOps overlays build (kustomize
semantics reproduced here; cross-checked with the real kustomize in kubectl when present).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from stoker import cli
from stoker.crd import build_crd
from stoker.manifest import load_text
from stoker.operator.tpu import slice_shape
from stoker.spec import API_VERSION, KIND, RLJob

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
GITOPS = EXAMPLES / "gitops"
OVERLAYS = sorted(p.parent for p in (GITOPS / "overlays").glob("*/kustomization.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def rljob_files() -> list[Path]:
    """Example files holding complete RLJobs (kustomize patches are partial and built below)."""
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or "overlays" in path.parts:
            continue
        if any(d.get("kind") == KIND for d in documents(path)):
            out.append(path)
    return out


def crd_validator() -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas follow draft 4 where it matters here (boolean exclusiveMinimum).
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, what kustomize applies to a custom resource it has no schema for."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The subset of `kustomize build` these examples use: resources, namespace, namePrefix,
    labels and targeted patches. Unknown fields fail, so a new feature cannot be silently skipped."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "namespace", "namePrefix", "labels", "patches"}
    assert set(kustomization) <= known, f"{directory}: unsupported kustomization fields {set(kustomization) - known}"
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml: resource {resource} does not exist"
        objects.extend(kustomize(path) if path.is_dir() else documents(path))
    for label in kustomization.get("labels", []):
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for patch in kustomization.get("patches", []):
        path = directory / patch["path"]
        assert path.is_file(), f"{directory}/kustomization.yaml: patch {patch['path']} does not exist"
        [body] = documents(path)
        target = patch.get("target", {"kind": body["kind"], "name": body["metadata"]["name"]})
        hits = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert hits, f"{path}: patch target {target} matches nothing"
        for obj in hits:
            patched = merge_patch(obj, {k: v for k, v in body.items() if k != "metadata"})
            obj.clear()
            obj.update(patched)
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue  # cluster-scoped: neither namespaced nor prefixed
        if "namePrefix" in kustomization:
            obj["metadata"]["name"] = kustomization["namePrefix"] + obj["metadata"]["name"]
        if "namespace" in kustomization:
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


# ----------------------------------------------------------------------------------- RLJobs


def test_examples_cover_what_the_docs_promise() -> None:
    names = {p.relative_to(EXAMPLES).as_posix() for p in rljob_files()}
    assert {"frozenlake.yaml", "frozenlake-rollout.yaml", "gke-v5e-frozenlake.yaml", "gke-v6e-swe-multislice.yaml",
            "gke-v6e-swe-rollout.yaml", "gitops/base/rljob.yaml"} <= names


# Later stages of a recipe (docs/stages.md) start from an earlier stage's export, which exists only
# once that stage has run: validate must say exactly that, and nothing else.
LATER_STAGES = {"answers-from-sft.yaml": "runs/sft-export"}


def test_every_example_passes_stoker_validate(capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(p) for p in rljob_files() if p.relative_to(EXAMPLES).as_posix() not in LATER_STAGES]
    code = cli.main(["validate", *files])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count(": valid (") == len(files)


@pytest.mark.parametrize("name", sorted(LATER_STAGES))
def test_a_later_stage_waits_only_for_the_earlier_stages_export(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(EXAMPLES / name)]) == 2
    problems = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(problems) == 1 and f"spec.model.checkpoint: '{LATER_STAGES[name]}' does not exist" in problems[0]


@pytest.mark.parametrize("path", rljob_files(), ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_every_example_satisfies_the_crd_schema(path: Path) -> None:
    """What the API server checks on `kubectl apply` (structure, enums, patterns, minimums)."""
    validator = crd_validator()
    for doc in documents(path):
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{path.name}: {[(list(e.path), e.message) for e in errors]}"


def test_crd_schema_check_rejects_a_bad_job() -> None:
    """Guards the test above: the schema check fails on what the API server would refuse."""
    doc = documents(EXAMPLES / "gke-v5e-frozenlake.yaml")[0]
    doc["spec"]["actors"]["replicas"] = -1
    assert list(crd_validator().iter_errors(doc))


def load(path: Path) -> RLJob:
    jobs, problems = load_text(path.read_text(), str(path))
    assert not problems, problems
    [job] = jobs
    return job


def test_v5e_example_requests_one_2x4_slice() -> None:
    learner = load(EXAMPLES / "gke-v5e-frozenlake.yaml").spec.learner
    assert (learner.accelerator, learner.topology, learner.num_slices) == ("tpu-v5-lite-podslice", "2x4", 1)
    # docs/gke.md: one ct5lp-hightpu-8t node, one learner pod asking for 8 chips.
    shape = slice_shape(learner.accelerator, learner.topology)
    assert (shape.hosts, shape.chips_per_host) == (1, 8)


@pytest.mark.parametrize("path", rljob_files(), ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_every_tpu_example_is_a_slice_gke_can_provision(path: Path) -> None:
    for job in load_text(path.read_text(), str(path))[0]:
        if job.spec.learner.accelerator != "cpu":
            slice_shape(job.spec.learner.accelerator, job.spec.learner.topology)  # TopologyError says why not


def test_swe_example_is_multislice_and_queued_where_kueue_has_quota() -> None:
    job = load(EXAMPLES / "gke-v6e-swe-multislice.yaml")
    learner = job.spec.learner
    assert job.spec.environment.name == "swe" and job.spec.environment.sandbox.kind == "pod"
    assert learner.accelerator == "tpu-v6e-slice" and learner.num_slices > 1
    kueue = {d["kind"]: d for d in documents(EXAMPLES / "kueue" / "tpu-v6e-queues.yaml")}
    assert kueue["LocalQueue"]["metadata"]["name"] == learner.queue_name
    assert kueue["LocalQueue"]["spec"]["clusterQueue"] == kueue["ClusterQueue"]["metadata"]["name"]
    labels = kueue["ResourceFlavor"]["spec"]["nodeLabels"]
    assert labels["cloud.google.com/gke-tpu-accelerator"] == learner.accelerator
    assert labels["cloud.google.com/gke-tpu-topology"] == learner.topology
    [group] = kueue["ClusterQueue"]["spec"]["resourceGroups"]
    [flavor] = group["flavors"]
    assert flavor["name"] == kueue["ResourceFlavor"]["metadata"]["name"]
    quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
    shape = slice_shape(learner.accelerator, learner.topology)
    assert shape.multi_host, "the multislice example is meant to show multi-host slices"
    # Kueue admits the JobSet only if every slice fits at once.
    assert quota["google.com/tpu"] >= shape.chips * learner.num_slices


def test_rollout_example_serves_from_single_host_tpu_slices() -> None:
    """Each server one v6e 2x4 slice (8 chips, one VM): a Deployment pod asking for all 8 chips;
    the actors get the servers' Service address."""
    from stoker.actor_count import cluster_actors
    from stoker.operator.children import desired_children
    from stoker.operator.manifests import JobContext
    from stoker.operator.settings import OperatorSettings

    job = load(EXAMPLES / "gke-v6e-swe-rollout.yaml")
    rollout = job.spec.rollout
    assert rollout is not None and rollout.min_replicas <= rollout.replicas <= rollout.max_replicas
    shape = slice_shape(rollout.accelerator, rollout.topology)
    assert (shape.hosts, shape.chips_per_host) == (1, 8)
    ctx = JobContext(job.metadata.name, "rl", "uid", job.spec, OperatorSettings(), actor_replicas=8, rollout_replicas=2)
    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(ctx)}
    pod = children[("Deployment", "swe-gen-rollout")]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == "8"
    actor = children[("Deployment", "swe-gen-actor")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "STOKER_ROLLOUT_ADDRESS", "value": f"swe-gen-rollout:{rollout.port}"} in actor["env"]


# ---------------------------------------------------------------------------------- GitOps


def test_gitops_has_a_base_and_dev_and_prod_overlays() -> None:
    assert (GITOPS / "base" / "kustomization.yaml").is_file()
    assert [p.name for p in OVERLAYS] == ["dev", "prod"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_builds_to_valid_rljobs(overlay: Path) -> None:
    objects = kustomize(overlay)
    jobs = [o for o in objects if o.get("apiVersion") == API_VERSION and o.get("kind") == KIND]
    assert jobs, f"{overlay} builds no RLJob"
    jobs_found, problems = load_text(yaml.safe_dump_all(jobs), f"{overlay.name} build")
    assert not problems, [str(p) for p in problems]
    namespaces = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    for job in jobs_found:
        assert job.metadata.name.startswith(f"{overlay.name}-")
        assert job.metadata.namespace in namespaces, "the overlay must bring the namespace it deploys to"
        slice_shape(job.spec.learner.accelerator, job.spec.learner.topology)
        assert not list(crd_validator().iter_errors(job.model_dump(by_alias=True, exclude_none=True)))


def test_overlays_change_what_differs_between_environments() -> None:
    dev, prod = ([o for o in kustomize(GITOPS / "overlays" / env) if o["kind"] == KIND][0] for env in ("dev", "prod"))
    assert dev["spec"]["learner"]["maxSteps"] < prod["spec"]["learner"]["maxSteps"]
    assert dev["spec"]["learner"]["checkpoint"]["dir"] != prod["spec"]["learner"]["checkpoint"]["dir"]
    assert dev["spec"]["actors"]["replicas"] < prod["spec"]["actors"]["replicas"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_real_kustomize_agrees(overlay: Path) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True)
    real = [d for d in yaml.safe_load_all(built.stdout) if d]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(real, key=key) == sorted(kustomize(overlay), key=key)


def test_gitops_deployments_point_at_existing_overlays() -> None:
    """Argo CD Applications and Flux Kustomizations reference overlay paths in this tree."""
    overlays = sorted(o.relative_to(REPO).as_posix() for o in OVERLAYS)
    paths: dict[str, list[str]] = {}
    for path in sorted((GITOPS / "deploy").glob("*.yaml")):
        for doc in documents(path):
            if doc["kind"] == "Application":
                paths.setdefault("argocd", []).append(doc["spec"]["source"]["path"])
            elif doc["kind"] == "Kustomization":
                paths.setdefault("flux", []).append(doc["spec"]["path"].removeprefix("./"))
    assert {tool: sorted(p) for tool, p in paths.items()} == {"argocd": overlays, "flux": overlays}


# --------------------------------------------------------------- what the operator would create


def all_example_jobs() -> list[tuple[str, RLJob]]:
    jobs = [(p.relative_to(EXAMPLES).as_posix(), job) for p in rljob_files() for job in load_text(p.read_text(), str(p))[0]]
    for overlay in OVERLAYS:
        built = [o for o in kustomize(overlay) if o["kind"] == KIND]
        jobs += [(f"gitops/overlays/{overlay.name}", job) for job in load_text(yaml.safe_dump_all(built), overlay.name)[0]]
    return jobs


@pytest.mark.parametrize("jobset_api", [True, False], ids=["jobset", "indexed-jobs"])
@pytest.mark.parametrize(("source", "job"), all_example_jobs(), ids=lambda v: v if isinstance(v, str) else "")
def test_operator_builds_valid_children_for_every_example(source: str, job: RLJob, jobset_api: bool) -> None:
    """The operator accepts each example (name, TPU shape) and every child it would create is a
    valid Kubernetes object; a JobSet's Job template is checked as a Job."""
    from kubernetes_validate import utils as kube_validate

    from stoker.actor_count import cluster_actors
    from stoker.operator.children import desired_children
    from stoker.operator.manifests import JobContext
    from stoker.operator.settings import OperatorSettings
    from stoker.spec import name_problems

    assert not name_problems(job.metadata.name, job.spec), f"{source}: {name_problems(job.metadata.name, job.spec)}"
    context = JobContext(
        job.metadata.name, job.metadata.namespace or "rl", "uid-1", job.spec, OperatorSettings(),
        actor_replicas=cluster_actors(job.spec), jobset_api=jobset_api,
    )
    children = desired_children(context)
    kinds = {c["kind"] for c in children}
    assert ("JobSet" if jobset_api else "Job") in kinds, f"{source}: no learner among {sorted(kinds)}"
    for child in children:
        if child["kind"] == "JobSet":
            for replicated in child["spec"]["replicatedJobs"]:
                job_template = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]}, "spec": replicated["template"]["spec"]}
                kube_validate.validate(job_template, "1.33.0", strict=True)
            if job.spec.learner.queue_name:
                assert child["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == job.spec.learner.queue_name
        else:
            kube_validate.validate(child, "1.33.0", strict=True)
