"""spec -> desired manifests: every manifest validates against the real Kubernetes schemas
(kubernetes-validate, strict); JobSets, which it does not know, get their embedded Job and Pod
templates validated and their own structure checked here."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
from pathlib import Path
from typing import Any

import jsonschema

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.operator.children import desired_children
from stoker.operator.learner_workload import (
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    KUEUE_QUEUE_LABEL,
    build_learner_indexed_jobs,
    build_learner_jobset,
)
from stoker.operator.manifests import CONFIG_HASH_ANNOTATION, JobContext, build_actor_deployment, build_buffer_token_secret
from stoker.operator.rollout import ACTOR_CONFIG_FIELDS, ACTOR_HASH_IGNORES, config_hash
from stoker.operator.settings import OperatorSettings
from stoker.operator.tpu import ACCELERATOR_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE
from stoker.spec import RLJob, RLJobSpec

K8S_VERSION = "1.37.0"
TPU_CASES = [
    ("cpu", None, 1, 1),
    ("tpu-v4-podslice", "2x2x4", 1, 4),
    ("tpu-v5p-slice", "2x2x2", 2, 2),
    ("tpu-v5-lite-podslice", "2x4", 1, 1),
    ("tpu-v6e-slice", "4x4", 3, 4),
]


def make_ctx(*, jobset_api: bool = True, replicas: int = 2, rollout_replicas: int = 0, **spec: Any) -> JobContext:
    return JobContext("lake", "research", "uid-1", RLJobSpec.model_validate(spec), OperatorSettings(),
                      actor_replicas=replicas, jobset_api=jobset_api, rollout_replicas=rollout_replicas)


def validate(manifest: dict[str, Any]) -> None:
    """Strict schema validation, as the API server would (unknown fields are errors)."""
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


SCHEMAS = Path(__file__).parent / "schemas"


def strict(schema: Any) -> Any:
    """A CRD's schema refusing unknown fields wherever it lists the known ones (the API server
    prunes them silently; `kubectl apply --validate=strict` refuses them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and not schema.get(
                "x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@functools.cache
def peer_validator(file: str, kind: str) -> jsonschema.Draft4Validator:
    """Another project's CRD schema for ``kind``, vendored under schemas/ (each file names its source)."""
    path = SCHEMAS / file
    raw = gzip.decompress(path.read_bytes()) if file.endswith(".gz") else path.read_bytes()
    schema = strict(json.loads(raw)[kind])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is checked as Kubernetes' own
    # OpenAPI v3.0 schemas follow draft 4 where it matters (boolean exclusiveMinimum).
    return jsonschema.Draft4Validator(schema)


def peer_errors(file: str, doc: dict[str, Any]) -> list[str]:
    return [f"{list(e.path)}: {e.message}" for e in peer_validator(file, doc["kind"]).iter_errors(doc)]


def check_jobset(jobset: dict[str, Any]) -> None:
    """The JobSet against JobSet's own CRD schema (v1alpha2, strict), the fields the operator relies
    on, and its Job template as a real batch/v1 Job."""
    assert peer_errors("jobset-v1alpha2.json.gz", jobset) == []
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    assert set(jobset) == {"apiVersion", "kind", "metadata", "spec"}
    spec = jobset["spec"]
    assert set(spec) <= {"replicatedJobs", "network", "successPolicy", "startupPolicy", "suspend",
                         "failurePolicy", "ttlSecondsAfterFinished", "managedBy", "coordinator"}
    assert isinstance(spec["failurePolicy"]["maxRestarts"], int) and spec["failurePolicy"]["maxRestarts"] >= 0
    assert spec["network"]["enableDNSHostnames"] is True
    assert spec["successPolicy"]["operator"] in ("All", "Any")
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert len(names) == len(set(names)) and set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(names)
    for replicated in spec["replicatedJobs"]:
        assert set(replicated) == {"name", "replicas", "template"}
        assert isinstance(replicated["replicas"], int) and replicated["replicas"] >= 1
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{jobset['metadata']['name']}-x"},
               **replicated["template"]}
        validate(job)
    validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": jobset["metadata"]})  # its ObjectMeta


def check_all(children: list[dict[str, Any]]) -> None:
    for child in children:
        if child["kind"] == "JobSet":
            check_jobset(child)
        else:
            validate(child)


@pytest.mark.parametrize(("accelerator", "topology", "slices", "hosts"), TPU_CASES)
@pytest.mark.parametrize("jobset_api", [True, False])
def test_children_validate_for_each_accelerator(accelerator: str, topology: str | None, slices: int, hosts: int,
                                                jobset_api: bool) -> None:
    learner: dict[str, Any] = {"accelerator": accelerator, "numSlices": slices, "maxRestarts": 5, "queueName": "team-a"}
    if topology:
        learner["topology"] = topology
    children = desired_children(make_ctx(jobset_api=jobset_api, learner=learner))
    check_all(children)
    for child in children:  # every child is owned by the RLJob and carries the common labels
        meta = child["metadata"]
        assert meta["namespace"] == "research"
        assert meta["ownerReferences"][0]["uid"] == "uid-1" and meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"]["stoker.dev/job"] == "lake" and meta["labels"]["stoker.dev/role"]
    kinds = sorted(c["kind"] for c in children)
    assert kinds.count("Deployment") == 2
    learners = [c for c in children if c["metadata"]["labels"]["stoker.dev/role"] == "learner"]
    if jobset_api:
        (jobset,) = [c for c in learners if c["kind"] == "JobSet"]
        replicated = jobset["spec"]["replicatedJobs"][0]
        assert replicated["replicas"] == slices
        assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 5
        assert jobset["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"
        job_spec = replicated["template"]["spec"]
    else:
        jobs = [c for c in learners if c["kind"] == "Job"]
        assert len(jobs) == slices and all(j["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a" for j in jobs)
        job_spec = jobs[0]["spec"]
    assert job_spec["parallelism"] == job_spec["completions"] == hosts
    assert job_spec["completionMode"] == "Indexed" and job_spec["backoffLimit"] == 0
    pod = job_spec["template"]["spec"]
    container = pod["containers"][0]
    if accelerator == "cpu":
        assert "nodeSelector" not in pod and TPU_RESOURCE not in container["resources"].get("limits", {})
    else:
        assert pod["nodeSelector"] == {ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology}
        per_host = container["resources"]["limits"][TPU_RESOURCE]
        assert int(per_host) * hosts == math.prod(int(s) for s in topology.split("x"))  # chips
        assert {"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        if jobset_api:
            assert jobset["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY_ANNOTATION] == "cloud.google.com/gke-nodepool"


def test_fallback_sets_the_variables_jax_reads() -> None:
    ctx = make_ctx(jobset_api=False, learner={"accelerator": "tpu-v5p-slice", "topology": "2x2x4", "numSlices": 2})
    jobs = build_learner_indexed_jobs(ctx)
    env = {e["name"]: e for e in jobs[1]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TPU_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["TPU_WORKER_HOSTNAMES"]["value"].split(",") == [f"lake-learner-1-{i}.lake-learner" for i in range(4)]
    assert env["MEGASCALE_NUM_SLICES"]["value"] == "2" and env["MEGASCALE_SLICE_ID"]["value"] == "1"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "lake-learner-0-0.lake-learner:8081"
    assert jobs[1]["spec"]["template"]["spec"]["subdomain"] == "lake-learner"


def test_jobset_multislice_variables() -> None:
    jobset = build_learner_jobset(make_ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "4x4", "numSlices": 2}))
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "lake-learner-slice-0-0.lake-learner:8081"
    assert "jobset.sigs.k8s.io/job-index" in env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    single = build_learner_jobset(make_ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "4x4"}))
    single_env = {e["name"] for e in single["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "MEGASCALE_NUM_SLICES" not in single_env  # GKE injects TPU_WORKER_* for JobSet's Jobs


def test_modes_and_suspension() -> None:
    kinds = lambda children: sorted(f"{c['kind']}/{c['metadata']['name']}" for c in children)  # noqa: E731
    colocated = kinds(desired_children(make_ctx(mode="colocated")))
    assert colocated == ["ConfigMap/lake-spec", "JobSet/lake-learner", "NetworkPolicy/lake-sandboxes",
                         "PersistentVolumeClaim/lake-learner-run", "Role/lake-sandbox-manager",
                         "RoleBinding/lake-sandbox-manager", "ServiceAccount/lake-sandbox-manager"]
    suspended = desired_children(make_ctx(suspend=True, replicas=0))
    assert not [c for c in suspended if c["kind"] == "JobSet"]
    actors = next(c for c in suspended if c["metadata"]["name"] == "lake-actor")
    assert actors["spec"]["replicas"] == 0
    assert "Deployment/lake-buffer" in kinds(suspended) and "PersistentVolumeClaim/lake-buffer" in kinds(suspended)
    assert "PersistentVolumeClaim/lake-learner-run" in kinds(suspended)  # checkpoints survive the suspension


@pytest.mark.parametrize("algorithm", [{"name": "sft", "sft": {"dataset": "/data/chats.jsonl"}},
                                       {"name": "dpo", "dpoDataset": "/data/pairs.jsonl"}])
def test_a_dataset_job_is_the_learner_alone(algorithm: dict[str, Any]) -> None:
    """SFT (and DPO on pairs) read a file: no buffer, actors or rollout tier, and a learner that
    is not pointed at a buffer; its command line parses with the real CLI."""
    from stoker.cli import build_parser

    children = desired_children(make_ctx(algorithm=algorithm, rollout={}))
    check_all(children)
    kinds = sorted(f"{c['kind']}/{c['metadata']['name']}" for c in children)
    assert kinds == ["ConfigMap/lake-spec", "JobSet/lake-learner", "NetworkPolicy/lake-sandboxes",
                     "PersistentVolumeClaim/lake-learner-run", "Role/lake-sandbox-manager",
                     "RoleBinding/lake-sandbox-manager", "ServiceAccount/lake-sandbox-manager"]
    jobset = next(c for c in children if c["kind"] == "JobSet")
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "learner" and args.buffer is None and args.token_file is None
    assert not [m for m in container["volumeMounts"] if "token" in m["name"]]


def test_learner_run_volume() -> None:
    from stoker.operator.learner_workload import ephemeral_checkpoints

    def run_volume(ctx: JobContext) -> dict[str, Any]:
        jobset = next(c for c in desired_children(ctx) if c["kind"] == "JobSet")
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return next(v for v in pod["volumes"] if v["name"] == "run")

    single = make_ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "2x4"})
    assert run_volume(single) == {"name": "run", "persistentVolumeClaim": {"claimName": "lake-learner-run"}}
    assert not ephemeral_checkpoints(single)
    multi = make_ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "4x4"})
    assert run_volume(multi) == {"name": "run", "emptyDir": {}}
    assert not [c for c in desired_children(multi) if c["metadata"]["name"] == "lake-learner-run"]
    assert ephemeral_checkpoints(multi)
    durable = make_ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "4x4", "checkpoint": {"dir": "gs://b/c"}})
    assert not ephemeral_checkpoints(durable)


def test_token_secret_and_mounts() -> None:
    ctx = make_ctx()
    validate(build_buffer_token_secret(ctx, "abc"))
    children = {f"{c['kind']}/{c['metadata']['name']}": c for c in desired_children(ctx)}
    for name in ("Deployment/lake-actor", "Deployment/lake-buffer"):
        pod = children[name]["spec"]["template"]["spec"]
        assert {"name": "buffer-token", "secret": {"secretName": "lake-buffer-token",
                                                   "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
    jobset_pod = children["JobSet/lake-learner"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert any(v["name"] == "buffer-token" for v in jobset_pod["volumes"])
    user = make_ctx(buffer={"authSecretRef": {"name": "mine", "key": "k"}})
    buffer = next(c for c in desired_children(user) if c["kind"] == "Deployment" and c["metadata"]["name"] == "lake-buffer")
    pod = buffer["spec"]["template"]["spec"]
    assert {"name": "buffer-token", "secret": {"secretName": "mine", "items": [{"key": "k", "path": "k"}]}} in pod["volumes"]


def test_job_file_round_trips() -> None:
    spec = {"actors": {"replicas": 3}, "learner": {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"}}
    configmap = desired_children(make_ctx(**spec))[0]
    job = RLJob.model_validate(yaml.safe_load(configmap["data"]["job.yaml"]))
    assert job.spec == RLJobSpec.model_validate(spec) and job.metadata.name == "lake"


def test_scaling_does_not_roll_pods() -> None:
    base = RLJobSpec()
    scaled = RLJobSpec.model_validate({"actors": {"replicas": 7, "maxReplicas": 9}, "suspend": True})
    changed = RLJobSpec.model_validate({"actors": {"sampling": {"temperature": 0.5}}})
    for spec in (base, scaled, changed):
        assert build_actor_deployment(make_ctx(**spec.model_dump(by_alias=True)))["spec"]["template"]["metadata"][
            "annotations"][CONFIG_HASH_ANNOTATION]
    digest = lambda spec: config_hash(spec, include=ACTOR_CONFIG_FIELDS, ignore=ACTOR_HASH_IGNORES)  # noqa: E731
    assert digest(base) == digest(scaled)
    assert digest(base) != digest(changed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(TPU_CASES),
    replicas=st.integers(0, 50),
    mode=st.sampled_from(["disaggregated", "colocated"]),
    suspend=st.booleans(),
    jobset_api=st.booleans(),
    cpu=st.sampled_from(["250m", "1", "2.5"]),
)
def test_any_spec_gives_valid_children(case: tuple[str, str | None, int, int], replicas: int, mode: str,
                                       suspend: bool, jobset_api: bool, cpu: str) -> None:
    accelerator, topology, slices, _ = case
    learner: dict[str, Any] = {"accelerator": accelerator, "numSlices": slices}
    if topology:
        learner["topology"] = topology
    ctx = make_ctx(jobset_api=jobset_api, replicas=0 if suspend else replicas, mode=mode, suspend=suspend,
                   learner=learner, actors={"resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}})
    children = desired_children(ctx)
    check_all(children)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(names) == len(set(names))  # deterministic, distinct names
    assert all(len(n) <= 63 for _, n in names)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_component_command_lines_parse_with_the_real_clis(mode: str) -> None:
    """The args the operator gives each container are accepted by that component's parser."""
    from stoker.cli import build_parser

    children = desired_children(make_ctx(mode=mode, learner={"accelerator": "tpu-v5p-slice", "topology": "2x2x2"}))
    seen = set()
    for child in children:
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
        elif child["kind"] == "JobSet":
            pod = child["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        else:
            continue
        container = pod["containers"][0]
        assert container["command"] == ["stoker"]
        args = build_parser(container["args"]).parse_args(container["args"])
        seen.add(args.command)
        if args.command in ("actor", "learner") and mode == "disaggregated":
            assert args.buffer == "lake-buffer:50051" and args.token_file == "/var/run/stoker/buffer-token/token"
    assert seen == ({"buffer", "actor", "learner"} if mode == "disaggregated" else {"learner"})


@pytest.mark.parametrize(
    "server", [{"accelerator": "nvidia-gpu", "gpus": 1}, {"accelerator": "tpu-v6e-slice", "topology": "4x4"}]
)
def test_rollout_server_command_lines_parse_with_the_real_cli(server: dict[str, Any]) -> None:
    """Every rollout pod, single- or multi-host, runs a command line `stoker rollout` accepts."""
    from stoker.cli import build_parser

    ctx = make_ctx(rollout={"replicas": 1, **server}, rollout_replicas=1)
    pods = [
        c["spec"]["template"]["spec"] if c["kind"] == "Deployment"
        else c["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        for c in desired_children(ctx)
        if c["kind"] in ("Deployment", "JobSet") and c["metadata"]["name"].startswith("lake-rollout")
    ]
    assert len(pods) == 1
    argv = pods[0]["containers"][0]["args"]
    args = build_parser(argv).parse_args(argv)  # argparse exits (SystemExit) on an unknown flag
    assert (args.command, args.job, args.weights, args.port) == ("rollout", "lake", "lake-weights:50052", 50053)
    # The learner's weight channel takes the buffer's bearer token: without it no new weights load.
    assert args.token_file == "/var/run/stoker/buffer-token/token"
    mounts = {m["mountPath"] for m in pods[0]["containers"][0]["volumeMounts"]}
    assert "/var/run/stoker/buffer-token" in mounts


def test_weights_service_selects_the_learners_first_host() -> None:
    from stoker.operator.learner_workload import build_weights_service

    jobset = build_weights_service(make_ctx())
    validate(jobset)
    assert jobset["spec"]["selector"] == {"stoker.dev/job": "lake", "stoker.dev/role": "learner",
                                          "batch.kubernetes.io/job-completion-index": "0",
                                          "jobset.sigs.k8s.io/job-index": "0"}
    fallback = build_weights_service(make_ctx(jobset_api=False))
    assert fallback["spec"]["selector"]["batch.kubernetes.io/job-name"] == "lake-learner-0"
    actors = next(c for c in desired_children(make_ctx()) if c["metadata"]["name"] == "lake-actor")
    args = actors["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--weights") + 1] == "lake-weights:50052"


@pytest.mark.parametrize("jobset_api", [True, False])
def test_megascale_and_jax_coordinator_ports_never_collide(jobset_api: bool) -> None:
    """Slice 0's first host runs JAX's coordinator and libtpu's Megascale coordinator: the address
    the learner derives from the pod's environment and the Megascale address must differ in port."""
    from stoker.distributed import from_environment

    ctx = make_ctx(jobset_api=jobset_api, learner={"accelerator": "tpu-v6e-slice", "topology": "4x4", "numSlices": 2})
    if jobset_api:
        job_spec = build_learner_jobset(ctx)["spec"]["replicatedJobs"][0]["template"]["spec"]
        # GKE injects these into JobSet pods; the fieldRefs resolve to slice 0, host 0.
        injected = {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": ",".join(
            f"lake-learner-slice-0-{i}.lake-learner" for i in range(4)), "MEGASCALE_SLICE_ID": "0"}
    else:
        job_spec = build_learner_indexed_jobs(ctx)[0]["spec"]
        injected = {"TPU_WORKER_ID": "0"}
    container = job_spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e} | injected
    jax = from_environment(env)
    assert jax is not None and jax.num_processes == 8
    megascale_host, megascale_port = env["MEGASCALE_COORDINATOR_ADDRESS"].rsplit(":", 1)
    jax_host, jax_port = jax.coordinator_address.rsplit(":", 1)
    assert jax_host == megascale_host  # the same pod...
    assert jax_port != megascale_port  # ...so two ports
    assert env["MEGASCALE_PORT"] == megascale_port  # every host listens where the coordinator is dialled
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert len(set(ports.values())) == len(container["ports"])
    assert {ports["megascale"], ports["jax-coordinator"]} == {int(megascale_port), int(jax_port)}
    if not jobset_api:
        service = [c for c in desired_children(ctx) if c["kind"] == "Service" and c["metadata"]["name"] == "lake-learner"]
        assert {p["port"] for p in service[0]["spec"]["ports"]} == {int(megascale_port), int(jax_port)}


def test_learner_runs_as_the_service_account_the_spec_names() -> None:
    """Workload Identity binds a Google service account to a Kubernetes one: the learner pods must
    run as it (and as the namespace's default when unset)."""
    for jobset_api in (True, False):
        ctx = make_ctx(jobset_api=jobset_api, learner={"serviceAccountName": "trainer"})
        learner = [c for c in desired_children(ctx) if c["kind"] in ("JobSet", "Job")][0]
        template = (learner["spec"]["replicatedJobs"][0]["template"]["spec"] if jobset_api else learner["spec"])["template"]
        assert template["spec"]["serviceAccountName"] == "trainer"
        check_all([learner])
    default = build_learner_jobset(make_ctx())["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "serviceAccountName" not in default


def test_fallback_keeps_each_multi_host_slice_in_one_node_pool() -> None:
    """Without JobSet's exclusive topology, pod affinity puts a slice's hosts in one node pool
    (a TPU slice is one pool) and anti-affinity keeps the other slices out of it."""
    ctx = make_ctx(jobset_api=False, learner={"accelerator": "tpu-v6e-slice", "topology": "4x4", "numSlices": 2})
    jobs = build_learner_indexed_jobs(ctx)
    for job in jobs:
        name = job["metadata"]["name"]
        pod = job["spec"]["template"]["spec"]
        [together] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        [apart] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert together["topologyKey"] == apart["topologyKey"] == "cloud.google.com/gke-nodepool"
        assert together["labelSelector"]["matchLabels"] == {"batch.kubernetes.io/job-name": name}
        assert {"key": "batch.kubernetes.io/job-name", "operator": "NotIn", "values": [name]} in (
            apart["labelSelector"]["matchExpressions"])
        validate(job)
    # Single-host slices need none.
    single = build_learner_indexed_jobs(make_ctx(jobset_api=False, learner={"accelerator": "tpu-v6e-slice", "topology": "2x4"}))
    assert "affinity" not in single[0]["spec"]["template"]["spec"]



def test_jobset_schema_check_refuses_what_jobset_would() -> None:
    jobset = build_learner_jobset(make_ctx())
    bad = copy.deepcopy(jobset)
    bad["spec"]["replicatedJobs"][0]["replica"] = bad["spec"]["replicatedJobs"][0].pop("replicas")
    assert peer_errors("jobset-v1alpha2.json.gz", bad)
    bad = copy.deepcopy(jobset)
    bad["spec"]["failurePolicy"]["maxRestarts"] = "three"
    assert peer_errors("jobset-v1alpha2.json.gz", bad)


# ------------------------------------------------------------------------ examples/kueue

KUEUE_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kueue" / "tpu-v6e-queues.yaml"
KUEUE_DOCS = [d for d in yaml.safe_load_all(KUEUE_EXAMPLE.read_text()) if d]


@pytest.mark.parametrize("doc", KUEUE_DOCS, ids=[d["kind"] for d in KUEUE_DOCS])
def test_kueue_example_is_valid_v1beta2(doc: dict[str, Any]) -> None:
    """Kueue's storage version (v1beta1 is deprecated), against Kueue's own CRD schemas."""
    assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert peer_errors("kueue-v1beta2.json", doc) == []


def test_kueue_check_refuses_a_misspelt_field() -> None:
    queue = copy.deepcopy(next(d for d in KUEUE_DOCS if d["kind"] == "LocalQueue"))
    queue["spec"]["clusterQueu"] = queue["spec"].pop("clusterQueue")
    assert peer_errors("kueue-v1beta2.json", queue)


@pytest.mark.parametrize("example", ["gke-v5e-frozenlake.yaml", "gke-v6e-swe-multislice.yaml"])
def test_gke_docs_grant_the_bucket_to_the_account_learners_run_as(example: str) -> None:
    """docs/gke.md's Workload Identity binding names the account the example's learner pods
    really run as; the chart's values do not send users to the operator's account instead."""
    from stoker.manifest import load_job

    repo = Path(__file__).resolve().parents[2]
    job = load_job(repo / "examples" / example)
    assert "gs://" in job.spec.learner.checkpoint.dir
    ctx = JobContext(job.metadata.name, "rl", "uid", job.spec, OperatorSettings(), actor_replicas=1)
    pod = build_learner_jobset(ctx)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert f"/subject/ns/rl/sa/{account}" in (repo / "docs" / "gke.md").read_text()
    assert "gcp-service-account" not in (repo / "helm" / "stoker" / "values.yaml").read_text()


# ---------------------------------------------------------------------------- the rollout tier

ROLLOUT_CASES = [
    # accelerator, topology, workload kind, hosts per server, chips per host
    ("cpu", None, "Deployment", 1, 0),
    ("nvidia-gpu", None, "Deployment", 1, 0),
    ("tpu-v6e-slice", "2x4", "Deployment", 1, 8),
    ("tpu-v5p-slice", "2x2x4", "JobSet", 4, 4),
]


@pytest.mark.parametrize(("accelerator", "topology", "kind", "hosts", "chips"), ROLLOUT_CASES)
def test_rollout_tier_children_validate(accelerator: str, topology: str | None, kind: str, hosts: int, chips: int) -> None:
    from stoker.operator.rollout_workload import GKE_GPU_LABEL, GPU_RESOURCE, SERVER_LABEL

    rollout: dict[str, Any] = {"accelerator": accelerator, "port": 50060}
    if topology:
        rollout["topology"] = topology
    if accelerator == "nvidia-gpu":
        rollout |= {"gpus": 2, "gpuType": "nvidia-l4"}
    ctx = make_ctx(rollout=rollout, learner={"serviceAccountName": "trainer"}, rollout_replicas=3)
    children = desired_children(ctx)
    check_all(children)
    mine = [c for c in children if c["metadata"]["labels"]["stoker.dev/role"] == "rollout"]
    service = next(c for c in mine if c["kind"] == "Service")
    assert service["metadata"]["name"] == "lake-rollout" and service["spec"]["ports"][0]["port"] == 50060
    workloads = [c for c in mine if c["kind"] == kind]
    for child in mine:
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert child["metadata"]["labels"]["stoker.dev/job"] == "lake"
    if kind == "Deployment":
        (deployment,) = workloads
        assert deployment["spec"]["replicas"] == 3
        pods = [deployment["spec"]["template"]["spec"]]
        assert set(service["spec"]["selector"].items()) <= set(deployment["spec"]["template"]["metadata"]["labels"].items())
    else:
        assert [w["metadata"]["name"] for w in workloads] == ["lake-rollout-0", "lake-rollout-1", "lake-rollout-2"]
        job = workloads[1]["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert job["parallelism"] == job["completions"] == hosts and job["completionMode"] == "Indexed"
        assert job["template"]["metadata"]["labels"][SERVER_LABEL] == "1"
        assert workloads[1]["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY_ANNOTATION] == "cloud.google.com/gke-nodepool"
        assert service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"  # host 0 serves
        pods = [w["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"] for w in workloads]
    for pod in pods:
        container = pod["containers"][0]
        assert container["args"][:2] == ["rollout", "--manifest"] and "--port" in container["args"]
        assert container["args"][container["args"].index("--weights") + 1] == "lake-weights:50052"
        assert container["readinessProbe"] == {"grpc": {"port": 50060}, "periodSeconds": 5}
        assert pod["serviceAccountName"] == "trainer" and pod["automountServiceAccountToken"] is False
        assert {"name": "job", "configMap": {"name": "lake-spec"}} in pod["volumes"]
        limits = container["resources"]["limits"]
        if accelerator == "nvidia-gpu":
            assert limits[GPU_RESOURCE] == "2" and pod["nodeSelector"] == {GKE_GPU_LABEL: "nvidia-l4"}
        elif chips:
            assert limits[TPU_RESOURCE] == str(chips) == container["resources"]["requests"][TPU_RESOURCE]
            assert pod["nodeSelector"] == {ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology}
        else:
            assert "nodeSelector" not in pod and set(limits) == {"cpu", "memory"}
    actor = build_actor_deployment(ctx)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "STOKER_ROLLOUT_ADDRESS", "value": "lake-rollout:50060"} in actor["env"]


def test_no_rollout_tier_no_rollout_children() -> None:
    for ctx in (make_ctx(rollout_replicas=2),
                make_ctx(rollout={"accelerator": "tpu-v5p-slice", "topology": "2x2x4"}, jobset_api=False, rollout_replicas=2)):
        children = desired_children(ctx)
        rollout = [f"{c['kind']}/{c['metadata']['name']}" for c in children if c["metadata"]["labels"]["stoker.dev/role"] == "rollout"]
        # Without JobSet a multi-host tier has its Service only (the status says why no server runs).
        assert rollout == ([] if ctx.spec.rollout is None else ["Service/lake-rollout"])
    actor = build_actor_deployment(make_ctx())["spec"]["template"]["spec"]["containers"][0]
    assert "STOKER_ROLLOUT_ADDRESS" not in {e["name"] for e in actor["env"]}  # actors sample in-process


def test_rollout_scaling_fields_do_not_restart_servers() -> None:
    from stoker.operator.rollout_workload import build_rollout_deployment

    def template_hash(**rollout: Any) -> str:
        ctx = make_ctx(rollout=rollout, rollout_replicas=1)
        return str(build_rollout_deployment(ctx)["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])

    assert template_hash(replicas=1) == template_hash(replicas=3, minReplicas=0, maxReplicas=6)
    assert template_hash(replicas=1) != template_hash(replicas=1, maxBatch=64)


def _pods(children: list[dict[str, Any]], role: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template metadata, pod spec) of every ``role`` workload among ``children``."""
    out = []
    for child in children:
        if child["metadata"]["labels"]["stoker.dev/role"] != role:
            continue
        if child["kind"] == "Deployment":
            out.append((child["spec"]["template"]["metadata"], child["spec"]["template"]["spec"]))
        elif child["kind"] in ("JobSet", "Job"):
            jobs = [r["template"]["spec"] for r in child["spec"]["replicatedJobs"]] if child["kind"] == "JobSet" else [child["spec"]]
            out += [(job["template"]["metadata"], job["template"]["spec"]) for job in jobs]
    return out


GPU_SERVER = {"accelerator": "nvidia-gpu"}
TPU_SERVER = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}  # multi-host: a JobSet per server


@pytest.mark.parametrize(
    ("jobset_api", "volume", "source", "server"),
    [
        (True, {"gcsBucket": "lake-weights"}, "csi", TPU_SERVER),
        (True, {"persistentVolumeClaim": "lake-weights"}, "persistentVolumeClaim", GPU_SERVER),
        (False, {"gcsBucket": "lake-weights"}, "csi", GPU_SERVER),
    ],
)
def test_a_weights_volume_is_mounted_rw_in_the_learner_and_ro_in_the_rollout_servers(
    jobset_api: bool, volume: dict[str, str], source: str, server: dict[str, Any]
) -> None:
    """spec.learner.weightsVolume: the learner publishes sharded weights into it (still serving
    them too) and every rollout server reads from it, each command line one its CLI accepts;
    everything validates against the Kubernetes and JobSet schemas."""
    from stoker.cli import build_parser
    from stoker.operator.weights_volume import GCSFUSE_ANNOTATION, WEIGHTS_MOUNT

    ctx = make_ctx(
        jobset_api=jobset_api, rollout={"replicas": 2, **server}, rollout_replicas=2,
        learner={"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "weightsVolume": volume},
    )
    children = desired_children(ctx)
    check_all(children)
    learners, servers = _pods(children, "learner"), _pods(children, "rollout")
    assert len(learners) == 1 and len(servers) == (2 if server is TPU_SERVER else 1)
    for (meta, pod), read_only in [*((p, False) for p in learners), *((p, True) for p in servers)]:
        (weights,) = [v for v in pod["volumes"] if v["name"] == "weights"]
        container = pod["containers"][0]
        assert {"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": read_only} in container["volumeMounts"]
        if source == "csi":
            assert weights["csi"]["driver"] == "gcsfuse.csi.storage.gke.io" and weights["csi"]["readOnly"] is read_only
            assert weights["csi"]["volumeAttributes"]["bucketName"] == "lake-weights"
            assert meta["annotations"][GCSFUSE_ANNOTATION] == "true"  # GKE adds the FUSE sidecar
        else:
            assert weights["persistentVolumeClaim"] == {"claimName": "lake-weights", "readOnly": read_only}
            assert GCSFUSE_ANNOTATION not in meta.get("annotations", {})
        args = build_parser(container["args"]).parse_args(container["args"])
        if read_only:
            assert args.command == "rollout" and args.weights == WEIGHTS_MOUNT
        else:
            assert args.command == "learner" and args.weights_dir == WEIGHTS_MOUNT and args.weights_format == "shards"
            assert args.weights_port == "50052"  # the peer transport stays: actors fetch from it


def test_without_a_weights_volume_nothing_is_mounted_and_servers_fetch_from_the_learner() -> None:
    ctx = make_ctx(rollout={"replicas": 1, "accelerator": "nvidia-gpu"}, rollout_replicas=1)
    for _, pod in _pods(desired_children(ctx), "learner") + _pods(desired_children(ctx), "rollout"):
        assert "weights" not in {v["name"] for v in pod["volumes"]}
        assert "--weights-dir" not in pod["containers"][0]["args"]


# ------------------------------------------------------------------ gs:// checkpoints: the cache volume


def _pod_templates(children: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """role -> the pod specs its workloads run (Deployment, Job, or a JobSet's replicated Jobs)."""
    roles = {child["metadata"]["labels"]["stoker.dev/role"] for child in children}
    specs = {role: [spec for _, spec in _pods(children, role)] for role in roles}
    return {role: found for role, found in specs.items() if found}


def _cache_dir(pod: dict[str, Any]) -> str | None:
    """Where the pod's container finds its checkpoint cache, checked to be one volume, mounted
    where the env var points (``stoker.remote_checkpoint.cache_root`` reads it)."""
    from stoker.remote_checkpoint import CACHE_ENV

    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = [v for v in pod["volumes"] if v["name"] == "checkpoint-cache"]
    mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "checkpoint-cache"]
    if not volumes and not mounts and CACHE_ENV not in env:
        return None
    assert volumes == [{"name": "checkpoint-cache", "emptyDir": {}}] and mounts == [env[CACHE_ENV]]
    return mounts[0]


@pytest.mark.parametrize("jobset_api", [True, False])
def test_pods_that_fetch_gs_checkpoints_get_a_cache_volume(jobset_api: bool) -> None:
    learner = {"accelerator": "tpu-v5p-slice", "topology": "2x2x4", "serviceAccountName": "trainer"}
    remote = make_ctx(jobset_api=jobset_api, model={"checkpoint": "gs://models/qwen"}, learner=learner,
                      rollout={"accelerator": "cpu"}, rollout_replicas=1)
    children = desired_children(remote)
    check_all(children)  # the new volume, mount and env validate against the real schemas
    pods = _pod_templates(children)
    assert {role for role, specs in pods.items() if all(_cache_dir(p) for p in specs)} == {"learner", "rollout", "actor"}
    assert all(_cache_dir(p) is None for p in pods["buffer"])

    local = make_ctx(jobset_api=jobset_api, model={"checkpoint": "/models/qwen"}, learner=learner,
                     rollout={"accelerator": "cpu"}, rollout_replicas=1)
    assert all(_cache_dir(p) is None for specs in _pod_templates(desired_children(local)).values() for p in specs)

    # A gs:// teacher only: the learner fetches it; the actors and servers have nothing to fetch.
    teacher = make_ctx(jobset_api=jobset_api, model={"checkpoint": "/models/student"}, learner=learner,
                       algorithm={"name": "distill", "teacher": {"checkpoint": "gs://models/teacher"}})
    children = desired_children(teacher)
    check_all(children)
    pods = _pod_templates(children)
    assert {role for role, specs in pods.items() if any(_cache_dir(p) for p in specs)} == {"learner"}
