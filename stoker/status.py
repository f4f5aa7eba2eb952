"""The RLJob status: what the operator reports and ``kubectl get rljobs`` shows.

Shared by the operator (which writes it) and the CRD generator (which declares its schema, so the
API server does not prune it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Running", "Suspended", "Succeeded", "Failed", "Degraded"]

CONDITION_TYPES = (
    "Ready",
    "LearnerReady",
    "ActorsAvailable",
    "BufferReady",
    "Suspended",
    "StalenessExceeded",
    "LearnerStarved",
    "SpecAccepted",
    "RolloutReady",
    "Degraded",
    "Recovering",
)


class StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# metav1.Condition's type: CamelCase, or a DNS-subdomain-prefixed name (k8s.io/apimachinery types.go).
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)


class Condition(StatusModel):
    """A ``metav1.Condition``."""

    type: str = Field(pattern=CONDITION_TYPE_PATTERN, min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str = Field(description="RFC 3339; changes only when status changes.")


class StalenessStatus(StatusModel):
    p50: int = 0
    max: int = 0
    dropped: int = Field(0, description="Groups dropped at sample time for being too stale.")


class ActorsStatus(StatusModel):
    ready: int = 0
    desired: int = 0
    summary: str = Field("0/0", description="ready/desired, for kubectl get.")


class EvaluationStatus(StatusModel):
    """The newest held-out evaluation round (environment.evalTasks): greedy, never trained on."""

    policy_version: int = Field(0, description="The round: the multiple of evalEveryVersions it was played for.")
    success_rate: float = Field(0.0, description="Mean success over the round's greedy episodes (0..1).")
    mean_reward: float = 0.0
    episodes: int = 0


class RolloutStatus(StatusModel):
    """The rollout tier (spec.rollout): its servers and what their Stats say."""

    ready: int = 0
    desired: int = 0
    summary: str = Field("0/0", description="ready/desired servers, for kubectl get.")
    tokens_per_second: float | None = Field(None, description="Sampled tokens/s, summed over the servers.")
    queue_depth: int | None = Field(None, description="Requests waiting for a batch slot, summed over the servers.")
    batch_occupancy: float | None = Field(None, description="Mean fraction of each ready server's batch in use.")
    answering: int | None = Field(None, description="Servers that answered Stats on the last look.")
    spec_replicas: int | None = Field(
        None, description="spec.rollout.replicas the target was last reset to; an edit of it resets desired again."
    )


class RestartsStatus(StatusModel):
    """Restarts per component for the life of the job (never lower): container restarts, one per pod replaced, the JobSet's."""

    learner: int = 0
    buffer: int = 0
    actors: int = 0
    rollout: int = 0


class CarriedRestarts(StatusModel):
    """One component's restarts that its live pods no longer show."""

    count: int = Field(0, description="Container restarts of its pods that are gone, plus one per pod replaced.")
    last_reason: str = Field("", description="Why the last of them stopped (OOMKilled, Evicted, Preempted, deleted).")
    last_at: str = Field("", description="When (RFC 3339).")


class SeenPod(StatusModel):
    """A pod of the job as the operator last saw it."""

    uid: str = Field(description="Its uid (its name where it has none).")
    component: str
    restarts: int = 0
    up: bool = Field(True, description="Neither terminating nor finished.")
    revision: str = Field("", description="Its pod-template-hash: a replacement of another one is a rollout.")
    jobset: bool = Field(False, description="A JobSet's pod: the JobSet counts its group's restarts.")
    last_reason: str = ""
    last_at: str = ""
    left: str = Field("", description="When it went without saying why (RFC 3339): a restart once a pod replaces it.")


class RestartLedger(StatusModel):
    """The operator's bookkeeping behind restarts, kept across replaced pods and operator restarts."""

    carried: dict[str, CarriedRestarts] = Field(default_factory=dict, description="Per component.")
    jobset_seen: int = Field(0, description="The learner JobSet's status.restarts on the last look.")
    jobset_carried: int = Field(0, description="Restarts of learner JobSets since recreated (suspend, resume).")
    pods: list[SeenPod] = Field(default_factory=list)


class RLJobStatus(StatusModel):
    phase: Phase | None = None
    observed_generation: int | None = None
    policy_version: int | None = None
    staleness: StalenessStatus | None = None
    buffer_fill: float | None = None
    learner_duty_cycle: float | None = None
    actors: ActorsStatus | None = None
    rollout: RolloutStatus | None = None
    zombies_reaped: int | None = None
    restarts: RestartsStatus | None = None
    restart_ledger: RestartLedger | None = None
    evaluation: EvaluationStatus | None = Field(None, description="Held-out evaluation, apart from training success.")
    admission_scale: float | None = Field(
        None, description="Fraction of the buffer's own admission credit the operator allows (1 = no limit)."
    )
    bottleneck: str | None = Field(
        None, description="What caps the learner's duty cycle, with its numbers and the knob that lifts it (empty: none)."
    )
    message: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
