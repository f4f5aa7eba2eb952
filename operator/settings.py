"""The operator's one settings dataclass: images, namespaces, intervals, thresholds and TTLs."""

from __future__ import annotations

from dataclasses import dataclass, field

from stoker import __version__

DEFAULT_IMAGE = f"ghcr.io/stoker-rl/stoker:{__version__}"
DEFAULT_LEARNER_IMAGE = f"ghcr.io/stoker-rl/stoker-tpu:{__version__}"


@dataclass(frozen=True)
class OperatorSettings:
    """Everything ``stoker operator`` is configured with; the RLJob spec configures each job."""

    image: str = DEFAULT_IMAGE
    """Image for actors, the buffer and sandbox pods when the spec names none (CPU-only, no JAX)."""
    learner_image: str = DEFAULT_LEARNER_IMAGE
    """Image for the learner when ``spec.learner.image`` is unset (JAX with the TPU runtime)."""
    image_pull_policy: str = "IfNotPresent"
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty together with ``all_namespaces`` means cluster-wide."""
    all_namespaces: bool = False
    standalone: bool = False
    """No kopf peering (a single operator replica; no kopfpeerings resource needed)."""
    kubeconfig: str | None = None
    """A kubeconfig file; in-cluster service account credentials, then ~/.kube/config when unset."""
    status_interval_seconds: float = 10.0
    """How often each RLJob's children, buffer stats and sandbox pods are observed."""
    request_timeout_seconds: float = 10.0
    """Timeout of each Kubernetes API call."""
    stats_timeout_seconds: float = 3.0
    """Deadline of one buffer Stats read, retries included (an absent buffer must not stall a look)."""
    watch_server_timeout_seconds: int = 300
    """Server-side watch timeout; without it a silently dropped watch never recovers."""
    buffer_address_template: str = "{name}-buffer.{namespace}.svc:{port}"
    """Where the operator reaches a job's buffer; override when running outside the cluster."""
    jobset_discovery_seconds: float = 60.0
    """How long the answer to "is the JobSet API installed?" is cached."""
    forbidden_retries: int = 10
    """A child create refused with 401/403 (RBAC) is retried this often before the job gives up."""
    forbidden_retry_seconds: float = 30.0
    """Delay between those retries (an admin may be fixing RBAC meanwhile)."""
    learner_termination_grace_seconds: int = 600
    """Grace period of learner pods: on SIGTERM (suspend, deletion) the learner checkpoints first."""
    storage_class: str | None = None
    """StorageClass of the buffer's log volume and the learner's run volume; the cluster default when unset."""
    learner_storage_size: str = "20Gi"
    """Run volume of a single-host learner (relative checkpoint dirs live there, across suspend/resume)."""
    # ---- enforcement (see stoker.operator.control)
    starved_duty_cycle: float = 0.5
    """A learner busy less than this fraction of the time, with an empty buffer, is starved."""
    scale_cooldown_seconds: float = 60.0
    """Minimum time between two actor scaling actions on one job."""
    scale_step_fraction: float = 0.25
    """Each scaling action changes actor replicas by this fraction (at least one replica)."""
    min_admission_scale: float = 0.125
    """The buffer's admission is never tightened below this fraction of its own limit."""
    # ---- rollout-tier scaling (see stoker.operator.rollout_control)
    rollout_saturated_queue_fraction: float = 0.25
    """Rollout servers are saturated when requests waiting reach this fraction of their batch slots."""
    rollout_busy_occupancy: float = 0.8
    """Batch occupancy from which a starved learner is waiting on generation (scale rollout up)."""
    rollout_idle_occupancy: float = 0.3
    """Batch occupancy under which, with no queue, the rollout tier gives back a server."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0 picks a free one); none when unset."""
    extra_labels: dict[str, str] = field(default_factory=dict)
    """Labels added to every child (e.g. a cost-centre label)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.all_namespaces and self.namespaces:
            problems.append("pass either namespaces or all_namespaces, not both")
        for name, value in (
            ("status_interval_seconds", self.status_interval_seconds),
            ("request_timeout_seconds", self.request_timeout_seconds),
            ("stats_timeout_seconds", self.stats_timeout_seconds),
            ("jobset_discovery_seconds", self.jobset_discovery_seconds),
        ):
            if value <= 0:
                problems.append(f"{name}: got {value}; expected > 0")
        if not 0 < self.starved_duty_cycle <= 1:
            problems.append(f"starved_duty_cycle: got {self.starved_duty_cycle}; expected in (0, 1]")
        if not 0 < self.scale_step_fraction <= 1:
            problems.append(f"scale_step_fraction: got {self.scale_step_fraction}; expected in (0, 1]")
        if not 0 < self.min_admission_scale <= 1:
            problems.append(f"min_admission_scale: got {self.min_admission_scale}; expected in (0, 1]")
        if not 0 <= self.rollout_idle_occupancy < self.rollout_busy_occupancy <= 1:
            problems.append(
                f"rollout_idle_occupancy ({self.rollout_idle_occupancy}) and rollout_busy_occupancy "
                f"({self.rollout_busy_occupancy}): expected 0 <= idle < busy <= 1"
            )
        if self.rollout_saturated_queue_fraction <= 0:
            problems.append(f"rollout_saturated_queue_fraction: got {self.rollout_saturated_queue_fraction}; expected > 0")
        if problems:
            raise ValueError("; ".join(problems))

    def buffer_address(self, name: str, namespace: str, port: int) -> str:
        return self.buffer_address_template.format(name=name, namespace=namespace, port=port)
