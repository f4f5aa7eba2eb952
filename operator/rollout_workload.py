"""The rollout tier's workload: generation servers on accelerators that the actors call.

* single-host servers (``cpu``, ``nvidia-gpu``, a TPU topology of one host): one Deployment
  ``<job>-rollout`` with a pod per server, scaled by its ``replicas``;
* multi-host TPU servers: one JobSet per server, ``<job>-rollout-<i>``, with one Indexed Job of a
  pod per host (GKE injects ``TPU_WORKER_ID``/``TPU_WORKER_HOSTNAMES``, as for the learner);
  scaling adds or deletes whole JobSets, since a JobSet's replicated jobs are immutable;
* a ClusterIP Service ``<job>-rollout`` in front of every server (host 0 of a multi-host one),
  which the actors reach through ``STOKER_ROLLOUT_ADDRESS``. gRPC keeps one connection per actor,
  so each actor's conversations stay on one server and its cache.

Contract with the image: ``stoker rollout --manifest JOB_FILE --job NAME --port PORT --weights
<job>-weights:50052 --token-file TOKEN --metrics-port 9090`` (the buffer's token, which also
guards the weight channel), serving gRPC health checking on ``PORT``.
"""

from __future__ import annotations

from typing import Any

from stoker.jobname import REPLICATED_JOB
from stoker.operator.learner_workload import (
    COMPLETION_INDEX_LABEL,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    JOBSET_API_VERSION,
    learner_shape,
    single_host,
)
from stoker.operator.manifests import (
    CONFIG_HASH_ANNOTATION,
    JOB_FILE,
    METRICS_PORT,
    WEIGHTS_PORT,
    JobContext,
    Manifest,
    checkpoint_cache,
    common_volumes,
    container_env,
    metadata,
    token_file,
)
from stoker.operator.naming import ROLE_ROLLOUT, labels, selector
from stoker.remote_checkpoint import ROLLOUT
from stoker.operator.rollout import Paths, config_hash
from stoker.operator.weights_volume import WEIGHTS_MOUNT, add_weights_volume, weights_volume_annotations
from stoker.operator.tpu import ACCELERATOR_LABEL, NODEPOOL_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE, SliceShape, slice_shape
from stoker.spec import TPU_ACCELERATORS, RolloutSpec

GPU_RESOURCE = "nvidia.com/gpu"
GKE_GPU_LABEL = "cloud.google.com/gke-accelerator"
SERVER_LABEL = "stoker.dev/rollout-server"
# A server holds no state a restart would lose (weights come from the learner), so its JobSet
# restarts it for as long as it fails; the operator recreates one that still gives up.
SERVER_MAX_RESTARTS = 1000
# Loading a large checkpoint and compiling take minutes: readiness waits, liveness does not kill.
STARTUP_SECONDS = 900

# The spec fields a rollout server reads when it starts; scaling fields never restart it.
ROLLOUT_CONFIG_FIELDS: Paths = (
    ("model",), ("rollout",), ("actors", "sampling"), ("learner", "compilationCacheDir"), ("learner", "weightsVolume"), ("seed",)
)
ROLLOUT_HASH_IGNORES: Paths = (("rollout", "replicas"), ("rollout", "minReplicas"), ("rollout", "maxReplicas"))

SINGLE_HOST = SliceShape(chips=0, hosts=1, chips_per_host=0)
# Where a server relays the sharded weight blocks it reads to the servers below it: gRPC, and
# the plain-TCP shard stream the servers below read first (pinned for NetworkPolicies).
WEIGHTS_RELAY_PORT = 50054
WEIGHTS_RELAY_STREAM_PORT = 50056


def rollout_shape(rollout: RolloutSpec) -> SliceShape:
    """Hosts per server and TPU chips per host (0 off TPU); ``TopologyError`` for a bad topology."""
    if rollout.accelerator not in TPU_ACCELERATORS:
        return SINGLE_HOST
    return slice_shape(rollout.accelerator, rollout.topology)


def multi_host(rollout: RolloutSpec) -> bool:
    return rollout_shape(rollout).multi_host


def rollout_config_hash(ctx: JobContext) -> str:
    return config_hash(ctx.spec, include=ROLLOUT_CONFIG_FIELDS, ignore=ROLLOUT_HASH_IGNORES)


def _spec(ctx: JobContext) -> RolloutSpec:
    if ctx.spec.rollout is None:
        raise ValueError("the job has no spec.rollout")
    return ctx.spec.rollout


def _accelerator(rollout: RolloutSpec, shape: SliceShape, container: dict[str, Any], pod: dict[str, Any]) -> None:
    """The accelerator's resources, node selectors and tolerations (the learner's, for TPUs)."""
    resources = container["resources"]
    if rollout.accelerator == "nvidia-gpu":
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(rollout.gpus)
        if rollout.gpu_type:
            pod["nodeSelector"] = {GKE_GPU_LABEL: rollout.gpu_type}
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    elif shape.chips_per_host:
        chips = str(shape.chips_per_host)
        resources.setdefault("requests", {})[TPU_RESOURCE] = chips
        resources.setdefault("limits", {})[TPU_RESOURCE] = chips
        pod["nodeSelector"] = {ACCELERATOR_LABEL: rollout.accelerator, TOPOLOGY_LABEL: rollout.topology}
        pod["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]


def _pod_spec(ctx: JobContext, shape: SliceShape, *, restart_policy: str) -> dict[str, Any]:
    rollout = _spec(ctx)
    # Servers never talk to the buffer, but its token also guards the learner's weight channel.
    volumes, mounts = common_volumes(ctx, token=True)
    cache_volumes, cache_mounts, cache_env = checkpoint_cache(ctx, ROLLOUT)
    volumes, mounts = volumes + cache_volumes, mounts + cache_mounts
    port = rollout.port
    probe = {"grpc": {"port": port}}
    container: dict[str, Any] = {
        "name": "rollout",
        "image": rollout.image or ctx.settings.learner_image,
        "imagePullPolicy": ctx.settings.image_pull_policy,
        "command": ["stoker"],
        "args": [
            *("rollout", "--manifest", JOB_FILE, "--job", ctx.name, "--port", str(port)),
            *("--weights", _weights_source(ctx), "--token-file", token_file(ctx)),
            *("--metrics-port", str(METRICS_PORT)),
            *relay_args(ctx),
        ],
        "ports": [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            *([{"name": "weights-relay", "containerPort": relay_port(rollout), "protocol": "TCP"},
               {"name": "relay-stream", "containerPort": relay_stream_port(rollout), "protocol": "TCP"}] if relays(ctx) else []),
        ],
        "env": container_env(ctx, ROLE_ROLLOUT) + cache_env,
        "volumeMounts": mounts,
        "resources": {
            part: values
            for part in ("requests", "limits")
            if (values := getattr(rollout.resources, part).model_dump(exclude_none=True))
        },
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {**probe, "periodSeconds": 5},
        "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 6},
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod: dict[str, Any] = {
        "restartPolicy": restart_policy,
        # No Kubernetes API access; Workload Identity (a gs:// checkpoint) needs no mounted token.
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
    }
    if ctx.spec.learner.service_account_name:  # it reads the checkpoint the learner starts from
        pod["serviceAccountName"] = ctx.spec.learner.service_account_name
    _accelerator(rollout, shape, container, pod)
    add_weights_volume(ctx.spec.learner.weights_volume, pod, container, read_only=True)
    return pod


def _weights_source(ctx: JobContext) -> str:
    """The learner's shared weights volume when it has one, else its weights Service."""
    if ctx.spec.learner.weights_volume is not None:
        return WEIGHTS_MOUNT
    return f"{ctx.names.weights}:{WEIGHTS_PORT}"


def relays(ctx: JobContext) -> bool:
    """Whether the servers relay weights to each other: when they fetch sharded weights from the
    learner's pods (a learner of several processes publishes sharded; peer serving, no volume).
    A single blob is fetched whole from the learner, and a weights volume serves every reader."""
    learner = ctx.spec.learner
    return learner.weights_volume is None and not single_host(ctx, learner_shape(learner))


def relay_port(rollout: RolloutSpec) -> int:
    return WEIGHTS_RELAY_PORT if rollout.port != WEIGHTS_RELAY_PORT else WEIGHTS_RELAY_PORT + 1


def relay_stream_port(rollout: RolloutSpec) -> int:
    port = WEIGHTS_RELAY_STREAM_PORT
    while port in (rollout.port, relay_port(rollout)):
        port += 1
    return port


def relay_args(ctx: JobContext) -> list[str]:
    """Each server (each host of a multi-host one) relays what it reads and registers with the
    learner's weights server, which names its upstream per version (stoker.weights.relay_registry):
    no stable pod names needed, so a Deployment's servers and scaling stay as they are. POD_IP
    comes from the downward API (``container_env``); Kubernetes expands ``$(POD_IP)``."""
    if not relays(ctx):
        return []
    port = relay_port(_spec(ctx))
    return ["--weights-relay-port", str(port), "--weights-relay-advertise", f"$(POD_IP):{port}",
            "--weights-relay-stream-port", str(relay_stream_port(_spec(ctx)))]


def _template_labels(ctx: JobContext, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**labels(ctx.name, ROLE_ROLLOUT, ctx.settings.extra_labels), **(extra or {})}


def _volume_annotations(ctx: JobContext) -> dict[str, str]:
    return weights_volume_annotations(ctx.spec.learner.weights_volume)


def build_rollout_deployment(ctx: JobContext) -> Manifest:
    """Single-host servers: one pod each, ``ctx.rollout_replicas`` of them."""
    shape = rollout_shape(_spec(ctx))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.names.rollout, ROLE_ROLLOUT),
        "spec": {
            "replicas": ctx.rollout_replicas,
            "selector": {"matchLabels": selector(ctx.name, ROLE_ROLLOUT)},
            # Accelerator nodes rarely have room for a surge pod: replace one server at a time.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": _template_labels(ctx),
                    "annotations": {CONFIG_HASH_ANNOTATION: rollout_config_hash(ctx), **_volume_annotations(ctx)},
                },
                "spec": _pod_spec(ctx, shape, restart_policy="Always"),
            },
        },
    }


def build_rollout_jobset(ctx: JobContext, index: int) -> Manifest:
    """Multi-host server ``index``: one slice, a pod per host, on its own node pool."""
    shape = rollout_shape(_spec(ctx))
    name = ctx.names.rollout_server(index)
    meta = metadata(ctx, name, ROLE_ROLLOUT, {EXCLUSIVE_TOPOLOGY_ANNOTATION: NODEPOOL_LABEL, CONFIG_HASH_ANNOTATION: rollout_config_hash(ctx)})
    meta["labels"][SERVER_LABEL] = str(index)
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "failurePolicy": {"maxRestarts": SERVER_MAX_RESTARTS},
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": shape.hosts,
                            "completions": shape.hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,  # one lost host fails the slice; JobSet restarts it
                            "template": {
                                "metadata": {
                                    "labels": _template_labels(ctx, {SERVER_LABEL: str(index)}),
                                    **({"annotations": a} if (a := _volume_annotations(ctx)) else {}),
                                },
                                "spec": _pod_spec(ctx, shape, restart_policy="Never"),
                            },
                        }
                    },
                }
            ],
        },
    }


def build_rollout_service(ctx: JobContext) -> Manifest:
    """Where actors send generation: every server's pod, host 0 of a multi-host server."""
    rollout = _spec(ctx)
    chosen = selector(ctx.name, ROLE_ROLLOUT)
    if multi_host(rollout):
        chosen[COMPLETION_INDEX_LABEL] = "0"  # the host that serves gRPC; the others join its mesh
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, ctx.names.rollout, ROLE_ROLLOUT),
        "spec": {
            "type": "ClusterIP",
            "selector": chosen,
            "ports": [{"name": "grpc", "port": rollout.port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}],
        },
    }


def build_rollout(ctx: JobContext) -> list[Manifest]:
    """The rollout children of ``ctx`` (none without ``spec.rollout``, or colocated).

    A multi-host tier on a cluster without the JobSet API gets its Service only; the status says
    why no server runs (``RolloutReady=False``, ``JobSetMissing``)."""
    rollout = ctx.spec.rollout
    if rollout is None or not ctx.streams:
        return []
    children = [build_rollout_service(ctx)]
    if not multi_host(rollout):
        children.append(build_rollout_deployment(ctx))
    elif ctx.jobset_api:
        children += [build_rollout_jobset(ctx, i) for i in range(ctx.rollout_replicas)]
    return children
