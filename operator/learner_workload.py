"""The learner's workload: a JobSet on clusters that serve it, else Indexed Jobs + a headless Service.

JobSet (``jobset.x-k8s.io/v1alpha2``): one replicated job ``slice`` with ``replicas`` = slices and
``parallelism`` = ``completions`` = hosts per slice; the exclusive-topology annotation puts each
slice on its own node pool, and GKE injects ``TPU_WORKER_ID``/``TPU_WORKER_HOSTNAMES`` into the
child Jobs. Multislice adds the ``MEGASCALE_*`` variables ``jax.distributed.initialize`` reads.

Fallback (no JobSet API): one Indexed Job per slice (``<job>-learner-<slice>``) sharing the
headless Service ``<job>-learner`` as pod subdomain, and the variables set explicitly: pod
``<job>-learner-<s>-<i>`` is reachable as ``<job>-learner-<s>-<i>.<job>-learner``.
"""

from __future__ import annotations

from typing import Any

from stoker.operator.manifests import (
    JOB_FILE,
    METRICS_PORT,
    WEIGHTS_PORT,
    WEIGHTS_STREAM_PORT,
    JobContext,
    Manifest,
    buffer_client_args,
    checkpoint_cache,
    common_volumes,
    container_env,
    metadata,
)
from stoker.jobname import REPLICATED_JOB
from stoker.labels import JOB_LABEL, ROLE_LABEL
from stoker.operator.naming import ROLE_LEARNER, labels, selector
from stoker.remote_checkpoint import LEARNER
from stoker.operator.tpu import (
    ACCELERATOR_LABEL,
    NODEPOOL_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    SliceShape,
    slice_shape,
)
from stoker.ports import JAX_COORDINATOR_PORT, MEGASCALE_COORDINATOR_PORT
from stoker.operator.weights_volume import add_weights_volume, learner_args, weights_volume_annotations
from stoker.spec import LearnerSpec

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
JOB_COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUN_DIR = "/var/lib/stoker/run"
# Labels Kubernetes and JobSet put on pods: the learner's first host serves the weights.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOBSET_JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
CPU_LEARNER_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}

CPU_SHAPE = SliceShape(chips=0, hosts=1, chips_per_host=0)
# libtpu's Megascale service listens on MEGASCALE_PORT (its default is not the port the coordinator
# address names): every multislice host must listen where slice 0's first host is dialled.
_MEGASCALE_PORT = {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_COORDINATOR_PORT)}


def learner_shape(learner: LearnerSpec) -> SliceShape:
    """Hosts per slice and chips per host; raises ``TopologyError`` for an impossible topology."""
    if learner.accelerator == "cpu":
        return CPU_SHAPE
    return slice_shape(learner.accelerator, learner.topology)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _pod_spec(ctx: JobContext, shape: SliceShape, env: list[dict[str, Any]], *, subdomain: str | None) -> dict[str, Any]:
    learner = ctx.spec.learner
    volumes, mounts = common_volumes(ctx, token=ctx.streams)
    cache_volumes, cache_mounts, cache_env = checkpoint_cache(ctx, LEARNER)
    volumes, mounts = volumes + cache_volumes, mounts + cache_mounts
    container: dict[str, Any] = {
        "name": "learner",
        "image": learner.image or ctx.settings.learner_image,
        "imagePullPolicy": ctx.settings.image_pull_policy,
        "command": ["stoker"],
        "args": [
            *("learner", "--manifest", JOB_FILE, "--run-dir", RUN_DIR),
            *("--metrics-port", str(METRICS_PORT), "--weights-port", str(WEIGHTS_PORT)),
            *("--weights-stream-port", str(WEIGHTS_STREAM_PORT)),
            *(buffer_client_args(ctx) if ctx.streams else ()),
            *learner_args(learner.weights_volume),
        ],
        "env": container_env(ctx, ROLE_LEARNER) + cache_env + env,
        "volumeMounts": [*mounts, {"name": "run", "mountPath": RUN_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # On SIGTERM (suspend, deletion, node-pool repair) the learner writes a checkpoint first.
        "terminationGracePeriodSeconds": ctx.settings.learner_termination_grace_seconds,
        "containers": [container],
        "volumes": [*volumes, _run_volume(ctx, shape)],
    }
    if ctx.disaggregated:
        # Workload Identity needs no mounted token: GKE's metadata server maps the pod's account.
        pod["automountServiceAccountToken"] = False
        if learner.service_account_name:
            pod["serviceAccountName"] = learner.service_account_name
    else:
        pod["serviceAccountName"] = ctx.names.sandbox_manager  # it manages its own sandboxes
    if subdomain is not None:
        pod["subdomain"] = subdomain
    add_weights_volume(learner.weights_volume, pod, container, read_only=False)
    container["ports"] = [
        {"name": "weights", "containerPort": WEIGHTS_PORT, "protocol": "TCP"},
        {"name": "weights-stream", "containerPort": WEIGHTS_STREAM_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    if shape.chips_per_host:
        quantity = str(shape.chips_per_host)
        container["resources"] = {"requests": {TPU_RESOURCE: quantity}, "limits": {TPU_RESOURCE: quantity}}
        container["ports"] += [
            {"name": "megascale", "containerPort": MEGASCALE_COORDINATOR_PORT, "protocol": "TCP"},
            {"name": "jax-coordinator", "containerPort": JAX_COORDINATOR_PORT, "protocol": "TCP"},
        ]
        pod["nodeSelector"] = {ACCELERATOR_LABEL: learner.accelerator, TOPOLOGY_LABEL: learner.topology}
        pod["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    else:
        container["resources"] = CPU_LEARNER_RESOURCES
    return pod


def slice_affinity(ctx: JobContext, job_name: str) -> dict[str, Any]:
    """The no-JobSet fallback's stand-in for JobSet's exclusive topology: a multi-host slice's
    pods share one node pool (a TPU slice is one pool), and no other slice of the job uses it."""
    this_slice = {"matchLabels": {JOB_NAME_LABEL: job_name}}
    other_slices = {
        "matchExpressions": [
            {"key": JOB_LABEL, "operator": "In", "values": [ctx.name]},
            {"key": ROLE_LABEL, "operator": "In", "values": [ROLE_LEARNER]},
            {"key": JOB_NAME_LABEL, "operator": "NotIn", "values": [job_name]},
        ]
    }
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": this_slice, "topologyKey": NODEPOOL_LABEL}]
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": other_slices, "topologyKey": NODEPOOL_LABEL}]
        },
    }


def single_host(ctx: JobContext, shape: SliceShape) -> bool:
    return shape.hosts * ctx.spec.learner.num_slices == 1


def _run_volume(ctx: JobContext, shape: SliceShape) -> dict[str, Any]:
    """A single-host learner keeps its run directory (and relative checkpoints) on a volume that
    outlives suspend/resume; multi-host learners need a shared ``checkpoint.dir`` (``gs://``)."""
    if single_host(ctx, shape):
        return {"name": "run", "persistentVolumeClaim": {"claimName": ctx.names.learner_run}}
    return {"name": "run", "emptyDir": {}}


def build_learner_run_pvc(ctx: JobContext) -> list[Manifest]:
    """The single-host learner's run volume (kept while suspended, like the buffer's log)."""
    if not single_host(ctx, learner_shape(ctx.spec.learner)):
        return []
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": ctx.settings.learner_storage_size}},
    }
    if ctx.settings.storage_class:
        spec["storageClassName"] = ctx.settings.storage_class
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": metadata(ctx, ctx.names.learner_run, ROLE_LEARNER),
            "spec": spec,
        }
    ]


def ephemeral_checkpoints(ctx: JobContext) -> bool:
    """Multi-host learner with a local checkpoint dir: each host's copy dies with its pod."""
    return not single_host(ctx, learner_shape(ctx.spec.learner)) and "://" not in ctx.spec.learner.checkpoint.dir


def _workload_labels(ctx: JobContext) -> dict[str, str]:
    out = labels(ctx.name, ROLE_LEARNER, ctx.settings.extra_labels)
    if ctx.spec.learner.queue_name:
        out[KUEUE_QUEUE_LABEL] = ctx.spec.learner.queue_name
    return out


def _template_metadata(ctx: JobContext) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels(ctx.name, ROLE_LEARNER, ctx.settings.extra_labels)}
    if (annotations := weights_volume_annotations(ctx.spec.learner.weights_volume)):
        meta["annotations"] = annotations
    return meta


def _job_template_spec(ctx: JobContext, shape: SliceShape, pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "parallelism": shape.hosts,
        "completions": shape.hosts,
        "completionMode": "Indexed",
        # One lost host fails the slice; restarts are the JobSet's (or the operator's) business.
        "backoffLimit": 0,
        "template": {"metadata": _template_metadata(ctx), "spec": pod_spec},
    }


def build_learner_jobset(ctx: JobContext) -> Manifest:
    shape = learner_shape(ctx.spec.learner)
    names = ctx.names
    slices = ctx.spec.learner.num_slices
    env: list[dict[str, Any]] = []
    if slices > 1:
        coordinator = f"{names.learner}-{REPLICATED_JOB}-0-0.{names.learner}"
        env = [
            {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
            _field_env("MEGASCALE_SLICE_ID", f"metadata.annotations['{JOBSET_JOB_INDEX_ANNOTATION}']"),
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{coordinator}:{MEGASCALE_COORDINATOR_PORT}"},
            dict(_MEGASCALE_PORT),
        ]
    pod_spec = _pod_spec(ctx, shape, env, subdomain=None)  # JobSet sets the subdomain itself
    meta = metadata(ctx, names.learner, ROLE_LEARNER)
    meta["labels"] = _workload_labels(ctx)
    if shape.chips_per_host:
        meta["annotations"] = {EXCLUSIVE_TOPOLOGY_ANNOTATION: NODEPOOL_LABEL}
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "failurePolicy": {"maxRestarts": ctx.spec.learner.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": names.learner},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": slices,
                    "template": {"spec": _job_template_spec(ctx, shape, pod_spec)},
                }
            ],
        },
    }


def build_learner_service(ctx: JobContext) -> Manifest:
    """The headless Service whose name is the learner pods' subdomain (fallback only)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, ctx.names.learner, ROLE_LEARNER),
        "spec": {
            "clusterIP": "None",
            "selector": selector(ctx.name, ROLE_LEARNER),
            # Hosts must resolve each other before any is ready: they rendezvous at start-up.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "megascale", "port": MEGASCALE_COORDINATOR_PORT, "protocol": "TCP"},
                {"name": "jax-coordinator", "port": JAX_COORDINATOR_PORT, "protocol": "TCP"},
            ],
        },
    }


def build_learner_indexed_jobs(ctx: JobContext) -> list[Manifest]:
    """One Indexed Job per slice, with the TPU variables JAX reads set explicitly."""
    shape = learner_shape(ctx.spec.learner)
    names = ctx.names
    slices = ctx.spec.learner.num_slices
    service = names.learner
    jobs = []
    for s in range(slices):
        job_name = names.learner_slice_job(s)
        hostnames = ",".join(f"{job_name}-{i}.{service}" for i in range(shape.hosts))
        env = [
            _field_env("TPU_WORKER_ID", f"metadata.annotations['{JOB_COMPLETION_INDEX_ANNOTATION}']"),
            {"name": "TPU_WORKER_HOSTNAMES", "value": hostnames},
        ]
        if slices > 1:
            coordinator = f"{names.learner_slice_job(0)}-0.{service}"
            env += [
                {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
                {"name": "MEGASCALE_SLICE_ID", "value": str(s)},
                {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{coordinator}:{MEGASCALE_COORDINATOR_PORT}"},
                dict(_MEGASCALE_PORT),
            ]
        meta = metadata(ctx, job_name, ROLE_LEARNER)
        meta["labels"] = _workload_labels(ctx)
        pod_spec = _pod_spec(ctx, shape, env, subdomain=service)
        if shape.chips_per_host and shape.multi_host:
            pod_spec["affinity"] = slice_affinity(ctx, job_name)
        jobs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta,
                "spec": _job_template_spec(ctx, shape, pod_spec),
            }
        )
    return jobs


def build_weights_service(ctx: JobContext) -> Manifest:
    """ClusterIP Service in front of the learner's first host, where actors fetch new weights."""
    first_host = {**selector(ctx.name, ROLE_LEARNER), COMPLETION_INDEX_LABEL: "0"}
    if ctx.jobset_api:
        first_host[JOBSET_JOB_INDEX_LABEL] = "0"
    else:
        first_host[JOB_NAME_LABEL] = ctx.names.learner_slice_job(0)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, ctx.names.weights, ROLE_LEARNER),
        "spec": {
            "type": "ClusterIP",
            "selector": first_host,
            "ports": [{"name": "weights", "port": WEIGHTS_PORT, "targetPort": "weights", "protocol": "TCP",
                       "appProtocol": "grpc"}],
        },
    }


def build_learner(ctx: JobContext) -> list[Manifest]:
    if ctx.jobset_api:
        return [build_learner_jobset(ctx)]
    return [build_learner_service(ctx), *build_learner_indexed_jobs(ctx)]
