"""The RLJob: one typed model of a whole job, the single source of truth.

Everything else is derived from these classes: the CRD schema (``stoker crd``), manifest
validation (``stoker validate``), the local runner, the operator's children and each component's
settings. Field names are snake_case in Python and camelCase in YAML, as Kubernetes users expect.

Defaults make a minimal manifest work: ``spec: {}`` is a valid local FrozenLake job.

The sections live in their own modules (``spec_model``, ``spec_actors``, ``spec_rollout``,
``spec_learner``; shared types in ``spec_base``) and the cross-field rules with their CEL twins in
``spec_rules``; this module is the job itself and the one import surface for all of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stoker.spec_actors import (
    MAX_EVAL_TASK_CHARACTERS,
    MAX_EVAL_TASK_ENTRIES,
    ActorsSpec,
    EnvironmentSpec,
    FrozenLakeOptions,
    RewardSpec,
    RewardTermSpec,
    SamplingSpec,
    SandboxSpec,
    StepLatency,
    SweOptions,
)
from stoker.spec_base import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    QUANTITY_PATTERN,
    TPU_ACCELERATORS,
    ResourceList,
    Resources,
    SpecModel,
    TpuAccelerator,
    TpuTopology,
)
from stoker.spec_cel import cel
from stoker.spec_learner import (
    MAX_SEQUENCE_BUCKETS,
    MIN_BF16_WEIGHTS_LEARNING_RATE,
    AlgorithmName,
    AlgorithmSpec,
    BufferSpec,
    CheckpointSpec,
    LearnerSpec,
    LearningRateScheduleSpec,
    MeshSpec,
    SecretRef,
    SftSpec,
    TeacherSpec,
    WeightsVolumeSpec,
)
from stoker.spec_model import LoraSpec, ModelSpec, RopeScaling, TransformerConfig
from stoker.spec_rollout import RolloutSpec, rollout_chips, rollout_hosts, rollout_problems
from stoker.spec_rules import CEL_RULES, ROOT_CEL_RULES, cross_field_problems, name_problems

__all__ = [
    "API_VERSION", "CEL_RULES", "DNS_LABEL_PATTERN", "DNS_SUBDOMAIN_PATTERN", "GROUP", "KIND", "MAX_EVAL_TASK_CHARACTERS",
    "MAX_EVAL_TASK_ENTRIES", "MAX_SEQUENCE_BUCKETS", "MIN_BF16_WEIGHTS_LEARNING_RATE", "PLURAL", "QUANTITY_PATTERN",
    "ROOT_CEL_RULES", "SHORT_NAMES",
    "SINGULAR", "TPU_ACCELERATORS", "VERSION", "ActorsSpec", "AlgorithmName", "AlgorithmSpec", "BufferSpec",
    "CheckpointSpec", "EnvironmentSpec", "FrozenLakeOptions", "LearnerSpec", "LearningRateScheduleSpec", "LoraSpec", "MeshSpec",
    "ModelSpec", "ObjectMeta", "RLJob", "RLJobSpec", "ResourceList", "Resources", "RewardSpec", "RewardTermSpec",
    "RolloutSpec", "RopeScaling", "SamplingSpec", "SandboxSpec", "SecretRef", "SftSpec", "SpecModel", "TeacherSpec", "StepLatency", "SweOptions",
    "TpuAccelerator", "TpuTopology", "TransformerConfig", "WeightsVolumeSpec", "cel", "cross_field_problems", "name_problems",
    "rollout_chips", "rollout_hosts", "rollout_problems",
]

GROUP = "stoker.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]


# ---------------------------------------------------------------------------------------- job


class RLJobSpec(SpecModel):
    model: ModelSpec = Field(default_factory=ModelSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    actors: ActorsSpec = Field(default_factory=ActorsSpec)
    rollout: RolloutSpec | None = Field(
        None, description="Generation servers the actors call; unset: each actor samples in-process."
    )
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: actors, buffer, learner apart; colocated: learner only, on-policy."
    )
    suspend: bool = Field(False, description="Scale actors to 0 and stop the learner after a checkpoint.")
    # JAX (64-bit off) keeps a seed's low 32 bits: a larger one would silently repeat a smaller one's run.
    seed: int = Field(0, ge=0, lt=2**32, description="Seeds initialisation, sampling and environments (below 2^32).")


class ObjectMeta(BaseModel):
    """The part of Kubernetes ObjectMeta a manifest may carry; the server owns the rest."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] = "stoker"
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLJob(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    api_version: Literal["stoker.dev/v1alpha1"] = Field("stoker.dev/v1alpha1", alias="apiVersion")
    kind: Literal["RLJob"] = "RLJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RLJobSpec = Field(default_factory=RLJobSpec)
    # Written by the operator; accepted so `kubectl get -o yaml` output validates too.
    status: dict[str, Any] | None = None
