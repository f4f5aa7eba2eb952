"""Pure builders: an RLJob (spec + identity + operator settings) -> the manifests of its children.

Every function returns plain dicts ready for the API server; nothing here talks to a cluster, so
each builder is unit-tested and schema-validated directly (tests/operator/test_manifests.py).
The learner's workload (JobSet or the Indexed-Job fallback) lives in ``learner_workload``.

Contract with the component images: containers run ``stoker buffer|actor|learner`` with the
RLJob mounted at ``/etc/stoker/job.yaml`` (``--manifest``), the buffer's address and the mounted
bearer token (``--buffer``, ``--token-file``), and their identity in ``POD_NAME``/``POD_NAMESPACE``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from stoker.labels import JOB_LABEL, ROLE_LABEL, ROLE_SANDBOX, SANDBOX_POD_PORT
from stoker.operator.naming import ROLE_ACTOR, ROLE_BUFFER, ROLE_LEARNER, Names, labels, selector
from stoker.operator.rbac import SANDBOX_MANAGER_POD_VERBS
from stoker.operator.rollout import ACTOR_CONFIG_FIELDS, ACTOR_HASH_IGNORES, BUFFER_CONFIG_FIELDS, LIVE_BUFFER_FIELDS, config_hash
from stoker.operator.settings import OperatorSettings
from stoker.operator.weights_volume import WEIGHTS_MOUNT, add_weights_volume, weights_volume_annotations
from stoker.remote_checkpoint import ACTOR, CACHE_ENV, FetchPlan, remote_uris
from stoker.spec import API_VERSION, KIND, ObjectMeta, RLJob, RLJobSpec

Manifest = dict[str, Any]

CONFIG_HASH_ANNOTATION = "stoker.dev/config-hash"
JOB_FILE_DIR = "/etc/stoker"
JOB_FILE_KEY = "job.yaml"
JOB_FILE = f"{JOB_FILE_DIR}/{JOB_FILE_KEY}"
TOKEN_DIR = "/var/run/stoker/buffer-token"
CONTROL_DIR = "/etc/stoker/control"
METRICS_PORT = 9090
WEIGHTS_PORT = 50052
# The learner processes' plain-TCP shard stream (stoker.weights.shard_stream): pinned, so a
# NetworkPolicy can name it (the CLI's default is a free port, advertised in the manifest).
WEIGHTS_STREAM_PORT = 50055
ADMISSION_FILE = f"{CONTROL_DIR}/admission.json"
BUFFER_DATA_DIR = "/var/lib/stoker/buffer"
GENERATED_TOKEN_KEY = "token"
ROLLOUT_ADDRESS_ENV = "STOKER_ROLLOUT_ADDRESS"
CHECKPOINT_CACHE_DIR = "/var/cache/stoker/checkpoints"

BUFFER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


@dataclass(frozen=True)
class JobContext:
    """What the builders need to know about one RLJob and the cluster it runs in."""

    name: str
    namespace: str
    uid: str
    spec: RLJobSpec
    settings: OperatorSettings
    actor_replicas: int
    """The operator's current actor target (spec replicas, moved by enforcement; 0 when suspended)."""
    jobset_api: bool = True
    """Whether ``jobset.x-k8s.io/v1alpha2`` is served; otherwise the Indexed-Job fallback."""
    admission_scale: float = 1.0
    rollout_replicas: int = 0
    """The operator's rollout-server target (spec.rollout.replicas, moved by scaling; 0 when suspended)."""

    @property
    def names(self) -> Names:
        return Names(self.name)

    @property
    def disaggregated(self) -> bool:
        return self.spec.mode == "disaggregated"

    @property
    def streams(self) -> bool:
        """Whether the job has a buffer and actors: disaggregated, and not training on a dataset
        file (SFT, DPO on pairs: the learner alone reads it)."""
        return self.disaggregated and not self.spec.algorithm.trains_on_dataset

    @property
    def buffer_port(self) -> int:
        return self.spec.buffer.port

    @property
    def token_secret(self) -> tuple[str, str]:
        """(Secret name, key) of the buffer's bearer token: the user's, or the generated one."""
        ref = self.spec.buffer.auth_secret_ref
        return (ref.name, ref.key) if ref is not None else (self.names.buffer_token, GENERATED_TOKEN_KEY)


# ------------------------------------------------------------------------------------ common


def owner_reference(ctx: JobContext) -> dict[str, Any]:
    """Makes the RLJob the controller of a child: deleting the RLJob garbage-collects it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ctx.name,
        "uid": ctx.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(ctx: JobContext, name: str, role: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ctx.namespace,
        "labels": labels(ctx.name, role, ctx.settings.extra_labels),
        "ownerReferences": [owner_reference(ctx)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def job_document(ctx: JobContext) -> str:
    """The RLJob as the components read it (``STOKER_JOB_FILE``)."""
    job = RLJob(metadata=ObjectMeta(name=ctx.name, namespace=ctx.namespace), spec=ctx.spec)
    return yaml.safe_dump(job.model_dump(by_alias=True, mode="json", exclude_none=True), sort_keys=False)


def container_env(ctx: JobContext, role: str) -> list[dict[str, Any]]:
    """Identity from the downward API (the components read POD_NAME/POD_NAMESPACE)."""
    return [
        {"name": "STOKER_JOB_NAME", "value": ctx.name},
        {"name": "STOKER_ROLE", "value": role},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # Sandbox pods name their creator (by uid) as owner, so the garbage collector removes them.
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def buffer_client_args(ctx: JobContext) -> list[str]:
    """How actors and the learner reach the buffer: its Service and the mounted token."""
    return ["--buffer", f"{ctx.names.buffer}:{ctx.buffer_port}", "--token-file", token_file(ctx)]


def token_file(ctx: JobContext) -> str:
    return f"{TOKEN_DIR}/{ctx.token_secret[1]}"


def common_volumes(ctx: JobContext, *, token: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts): the job file, and the buffer token where needed."""
    volumes: list[dict[str, Any]] = [{"name": "job", "configMap": {"name": ctx.names.spec_config}}]
    mounts: list[dict[str, Any]] = [{"name": "job", "mountPath": JOB_FILE_DIR, "readOnly": True}]
    if token:
        secret_name, key = ctx.token_secret
        volumes.append(
            {"name": "buffer-token", "secret": {"secretName": secret_name, "items": [{"key": key, "path": key}]}}
        )
        mounts.append({"name": "buffer-token", "mountPath": TOKEN_DIR, "readOnly": True})
    return volumes, mounts


def checkpoint_cache(ctx: JobContext, plan: FetchPlan) -> tuple[list[Manifest], list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts, env) for the gs:// checkpoints a pod fetches at start
    (``stoker.remote_checkpoint``): an emptyDir, which outlives container restarts, so a restarted
    container finds the files complete and a cut download resumes; nothing without a gs:// URI."""
    if not remote_uris(ctx.spec, plan):
        return [], [], []
    return (
        [{"name": "checkpoint-cache", "emptyDir": {}}],
        [{"name": "checkpoint-cache", "mountPath": CHECKPOINT_CACHE_DIR}],
        [{"name": CACHE_ENV, "value": CHECKPOINT_CACHE_DIR}],
    )


RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _resources(spec_resources: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in ("requests", "limits"):
        values = getattr(spec_resources, part).model_dump(exclude_none=True)
        if values:
            out[part] = values
    return out


# ------------------------------------------------------------------------- shared children


def build_spec_configmap(ctx: JobContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx, ctx.names.spec_config, "config"),
        "data": {JOB_FILE_KEY: job_document(ctx)},
    }


def build_buffer_token_secret(ctx: JobContext, token: str) -> Manifest:
    """The generated bearer token; created once and never rewritten (409 keeps the first)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(ctx, ctx.names.buffer_token, ROLE_BUFFER),
        "type": "Opaque",
        "stringData": {GENERATED_TOKEN_KEY: token},
    }


def build_sandbox_manager_account(ctx: JobContext) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding for the pods that create sandbox pods.

    Actors (or the colocated learner) create, heartbeat-annotate and delete their sandbox pods,
    and nothing else. RBAC cannot scope by label, so the Role covers pods in this namespace; the
    operator reaps any sandbox pod whose actor is gone.
    """
    name = ctx.names.sandbox_manager
    role = ROLE_ACTOR if ctx.disaggregated else ROLE_LEARNER
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(ctx, name, role)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(ctx, name, role),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": list(SANDBOX_MANAGER_POD_VERBS)},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(ctx, name, role),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]





def build_sandbox_network_policy(ctx: JobContext) -> Manifest:
    """Sandbox pods talk to their job's actors (the learner when colocated) and nobody else."""
    peer_role = ROLE_ACTOR if ctx.disaggregated else ROLE_LEARNER
    peer = {"podSelector": {"matchLabels": selector(ctx.name, peer_role)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ctx, ctx.names.sandbox_policy, ROLE_SANDBOX),
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: ctx.name, ROLE_LABEL: ROLE_SANDBOX}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": SANDBOX_POD_PORT}]}],
            "egress": [{"to": [peer]}],
        },
    }


# ---------------------------------------------------------------------------------- buffer


def build_buffer_control_configmap(ctx: JobContext) -> Manifest:
    """The operator's admission control for the buffer, a file the buffer re-reads.

    ``admissionScale`` in (0, 1] multiplies the buffer's own admission credit; the operator lowers
    it while staleness exceeds ``buffer.maxStaleness`` and restores it when the learner starves.
    """
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx, ctx.names.buffer_control, ROLE_BUFFER),
        "data": {"admission.json": json.dumps({"admissionScale": round(ctx.admission_scale, 4)})},
    }


def build_buffer_pvc(ctx: JobContext) -> Manifest:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": ctx.spec.buffer.storage_size}},
    }
    if ctx.settings.storage_class:
        spec["storageClassName"] = ctx.settings.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(ctx, ctx.names.buffer, ROLE_BUFFER),
        "spec": spec,
    }


def build_buffer_service(ctx: JobContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, ctx.names.buffer, ROLE_BUFFER),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(ctx.name, ROLE_BUFFER),
            "ports": [
                {"name": "grpc", "port": ctx.buffer_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}
            ],
        },
    }


def build_buffer_deployment(ctx: JobContext) -> Manifest:
    volumes, mounts = common_volumes(ctx, token=True)
    volumes += [
        {"name": "data", "persistentVolumeClaim": {"claimName": ctx.names.buffer}},
        {"name": "control", "configMap": {"name": ctx.names.buffer_control}},
    ]
    mounts += [
        {"name": "data", "mountPath": BUFFER_DATA_DIR},
        {"name": "control", "mountPath": CONTROL_DIR, "readOnly": True},
    ]
    port = ctx.buffer_port
    env = container_env(ctx, ROLE_BUFFER)
    env.append({"name": "STOKER_ADMISSION_FILE", "value": ADMISSION_FILE})
    buffer_hash = config_hash(ctx.spec, include=BUFFER_CONFIG_FIELDS, ignore=LIVE_BUFFER_FIELDS)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.names.buffer, ROLE_BUFFER),
        "spec": {
            "replicas": 1,
            # The log volume is ReadWriteOnce: the old pod must let go before the new one starts.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(ctx.name, ROLE_BUFFER)},
            "template": {
                "metadata": {
                    "labels": labels(ctx.name, ROLE_BUFFER, ctx.settings.extra_labels),
                    "annotations": {CONFIG_HASH_ANNOTATION: buffer_hash},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": {"fsGroup": 65532},
                    "containers": [
                        {
                            "name": "buffer",
                            "image": ctx.settings.image,
                            "imagePullPolicy": ctx.settings.image_pull_policy,
                            "command": ["stoker"],
                            "args": [
                                "buffer",
                                *("--manifest", JOB_FILE, "--port", str(port), "--data-dir", BUFFER_DATA_DIR),
                                *("--token-file", token_file(ctx), "--metrics-port", str(METRICS_PORT)),
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": port, "protocol": "TCP"},
                                {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
                            ],
                            "env": env,
                            "volumeMounts": mounts,
                            "resources": BUFFER_RESOURCES,
                            "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5},
                            "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 20, "failureThreshold": 6},
                            "securityContext": RESTRICTED_CONTAINER,
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
    }


# ---------------------------------------------------------------------------------- actors


def build_actor_deployment(ctx: JobContext) -> Manifest:
    actors = ctx.spec.actors
    # Actors that sample in-process read new weights from the learner's weights volume when it
    # has one (read-only, by slice), else from its weights Service.
    volume = ctx.spec.learner.weights_volume if ctx.spec.rollout is None else None
    volumes, mounts = common_volumes(ctx, token=True)
    cache_volumes, cache_mounts, cache_env = checkpoint_cache(ctx, ACTOR)  # config and tokenizer files only
    volumes, mounts = volumes + cache_volumes, mounts + cache_mounts
    env = container_env(ctx, ROLE_ACTOR) + cache_env
    sandbox_image = ctx.spec.environment.sandbox.image or actors.image or ctx.settings.image
    env.append({"name": "STOKER_IMAGE", "value": sandbox_image})  # sandbox pods run this image
    if ctx.spec.rollout is not None:  # generation is served by the rollout tier's Service
        env.append({"name": ROLLOUT_ADDRESS_ENV, "value": f"{ctx.names.rollout}:{ctx.spec.rollout.port}"})
    deployment: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.names.actors, ROLE_ACTOR),
        "spec": {
            "replicas": ctx.actor_replicas,
            "selector": {"matchLabels": selector(ctx.name, ROLE_ACTOR)},
            "template": {
                "metadata": {
                    "labels": labels(ctx.name, ROLE_ACTOR, ctx.settings.extra_labels),
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: config_hash(ctx.spec, include=ACTOR_CONFIG_FIELDS, ignore=ACTOR_HASH_IGNORES),
                        **weights_volume_annotations(volume),
                    },
                },
                "spec": {
                    "serviceAccountName": ctx.names.sandbox_manager,
                    "containers": [
                        {
                            "name": "actor",
                            "image": actors.image or ctx.settings.image,
                            "imagePullPolicy": ctx.settings.image_pull_policy,
                            "command": ["stoker"],
                            "args": [
                                *("actor", "--manifest", JOB_FILE, "--job", ctx.name),
                                *buffer_client_args(ctx),
                                *("--weights", WEIGHTS_MOUNT if volume is not None else f"{ctx.names.weights}:{WEIGHTS_PORT}"),
                            ],
                            "env": env,
                            "volumeMounts": mounts,
                            "resources": _resources(actors.resources),
                            "securityContext": RESTRICTED_CONTAINER,
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
    }
    pod = deployment["spec"]["template"]["spec"]
    add_weights_volume(volume, pod, pod["containers"][0], read_only=True)
    return deployment
