"""The training sections of the RLJob spec: the RL objective, the buffer that feeds the learner,
and the learner's hardware, mesh and checkpoints.

Import the spec from ``stoker.spec``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator

from stoker.spec_base import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN, QUANTITY_PATTERN, SpecModel, TpuAccelerator, TpuTopology

# CEL compares neighbouring buckets one by one, so the list is bounded.
MAX_SEQUENCE_BUCKETS = 16
# Policy versions a group may lag: far past any run's, and what the buffer takes live (Configure).
MAX_STALENESS = 1_000_000
# Below this peak learning rate bfloat16 master weights keep nearly no update: an Adam step of
# at most about lr is lost on every weight above 2^9 x lr (0.005 at 1e-5; on many from 2^8 x lr),
# which is most of a model's (|w| ~ 0.02).
MIN_BF16_WEIGHTS_LEARNING_RATE = 1e-5


# ----------------------------------------------------------------------------------- algorithm


class AlgorithmName(StrEnum):
    """str(AlgorithmName.GRPO) == "grpo", so the default and a parsed value read the same."""

    GRPO = "grpo"
    PPO = "ppo"
    DPO = "dpo"
    GSPO = "gspo"
    SFT = "sft"
    DISTILL = "distill"


class LearningRateScheduleSpec(SpecModel):
    """Linear warmup from 0 to ``learningRate``, then constant, or a decay to ``minLearningRate``."""

    kind: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="constant | cosine | linear: the shape after the warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Updates of linear warmup from 0 to learningRate.")
    decay_steps: int | None = Field(
        None, ge=1, description="Updates of decay after the warmup; to learner.maxSteps when unset."
    )
    min_learning_rate: float = Field(0.0, ge=0, description="Where the cosine or linear decay ends.")


class SftSpec(SpecModel):
    """Supervised fine-tuning on chat conversations (``algorithm.name: sft``)."""

    dataset: str = Field(
        description=(
            'JSONL, one conversation a line: {"messages": [{"role": "user", "content": ...}, '
            '{"role": "assistant", "content": ...}, ...]}, rendered with the job\'s chat template.'
        )
    )
    eval_dataset: str | None = Field(
        None, description="JSONL of held-out conversations; evalFraction of dataset is held out when unset."
    )
    eval_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of dataset held out for eval when evalDataset is unset (0: no eval)."
    )
    eval_interval_steps: int = Field(10, ge=1, description="Held-out loss every k updates (and after the last).")
    loss_on: Literal["assistant", "all"] = Field(
        "assistant",
        description="assistant: loss on the assistant turns' tokens only; all: on every token after the first.",
    )


class TeacherSpec(SpecModel):
    """The teacher of on-policy distillation (``algorithm.name: distill``)."""

    checkpoint: str = Field(
        description="Hugging Face-format directory of the teacher; its tokenizer must be the student's."
    )
    divergence: Literal["reverse_kl", "jsd"] = Field(
        "reverse_kl",
        description=(
            "Per-token divergence the student minimises on its own samples. reverse_kl: KL(student || teacher); "
            "jsd: generalized Jensen-Shannon beta KL(T||M) + (1-beta) KL(S||M), M = beta T + (1-beta) S."
        ),
    )
    beta: float = Field(
        0.5, gt=0, lt=1,
        description="Generalized JSD's teacher weight (divergence: jsd): near 0 it acts like forward KL, near 1 like reverse KL.",
    )


class AlgorithmSpec(SpecModel):
    """The training objective and its hyperparameters."""

    name: AlgorithmName = Field(
        AlgorithmName.GRPO, description="grpo | ppo | dpo | gspo (RL on the buffer's episodes) | sft (on algorithm.sft.dataset) | "
        "distill (on-policy distillation from algorithm.teacher)."
    )
    learning_rate: float = Field(3e-3, gt=0, description="Adam learning rate (the peak, under a schedule).")
    clip_epsilon: float = Field(0.2, gt=0, description="PPO-style ratio clip (low side).")
    clip_epsilon_high: float | None = Field(None, gt=0, description="Upper ratio clip; clipEpsilon when unset.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (0 disables it).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus.")
    off_policy_correction: Literal["clip", "episode", "lag-clip", "m2po", "decoupled", "none"] = Field(
        "clip",
        description=(
            "How stale tokens are corrected. clip: PPO's clipped ratio against the sampler's own "
            "log-probs (a trust region around the policy that generated them); episode: clip, and each "
            "token's advantage weighted by the ratio pi/mu of the rest of its episode, within "
            "[1/episodeCap, episodeCap] (for episodes of a few sampled tokens, e.g. a move per turn); lag-clip: the same "
            "ratio, its clip widened per version the token lags ((1 +- eps)^(1 + lag)); m2po: no clip, "
            "the tokens with the largest (log pi/mu)^2 left out until the rest's mean is within "
            "m2poBudget (M2PO); decoupled: AReaL's truncated weight min(pi/mu, importanceCap) with the "
            "clip around the current policy; none: no correction. episode, lag-clip and m2po: grpo and ppo only."
        ),
    )
    episode_cap: float = Field(
        1.5, gt=1, description="offPolicyCorrection episode: the bound on the rest of the episode's ratio (and its inverse)."
    )
    m2po_budget: float = Field(
        0.04, gt=0, description="offPolicyCorrection m2po: the kept tokens' mean (log pi/mu)^2 (M2PO's 0.04)."
    )
    importance_cap: float = Field(2.0, ge=1, description="Truncation cap of the decoupled importance weight (and DPO's).")
    dual_clip: float = Field(
        3.0, gt=1, description="Bound on a negative-advantage token's ratio term (dual-clip PPO)."
    )
    loss_aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "token-mean", description="How per-token losses are averaged."
    )
    updates_per_batch: int = Field(
        1, ge=1, le=16, description="Optimizer updates on each batch (PPO's epochs), each from the gradient at the "
        "parameters the last one left; one policy version per batch. The clip against the sampler's log-probs "
        "(offPolicyCorrection clip, episode) bounds how far they move."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (PPO).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO).")
    value_coef: float = Field(0.5, ge=0, description="Value loss weight (PPO).")
    dpo_beta: float = Field(0.1, gt=0, description="DPO inverse temperature.")
    dpo_dataset: str | None = Field(None, description="JSONL of chosen/rejected pairs; buffer groups ranked by reward when unset.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    learning_rate_schedule: LearningRateScheduleSpec = Field(default_factory=LearningRateScheduleSpec)
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW decoupled weight decay on weight matrices (not norms or biases); 0 is Adam."
    )
    sft: SftSpec | None = Field(None, description="The SFT dataset (algorithm.name: sft).")
    teacher: TeacherSpec | None = Field(
        None, description="The teacher whose per-token log-probs the student is distilled toward (algorithm.name: distill)."
    )
    advantage_normalization: Literal["population-std", "sample-std", "none"] = Field(
        "population-std",
        description=(
            "GRPO/GSPO group advantage (r - mean) / (std + 1e-6). population-std: std with ddof=0; "
            "sample-std: ddof=1, as TRL, verl and Tunix compute it (advantages sqrt((G-1)/G) as large); "
            "none: r - mean (Dr. GRPO)."
        ),
    )


    @property
    def trains_on_dataset(self) -> bool:
        """Whether the learner reads a dataset file and needs no actors or buffer (SFT, DPO on pairs)."""
        return self.name == AlgorithmName.SFT or (self.name == AlgorithmName.DPO and self.dpo_dataset is not None)


# -------------------------------------------------------------------------------------- buffer


class SecretRef(SpecModel):
    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=253)]
    key: str = "token"


class BufferSpec(SpecModel):
    capacity: int = Field(
        4096,
        ge=1,
        description="Trajectories waiting for the learner before Put is refused (backpressure). Batches the "
        "learner has leased are held on top until committed, up to as many again.",
    )
    group_size: int = Field(8, ge=1, description="Episodes per task group (GRPO's G).")
    max_staleness: int = Field(
        4,
        ge=0,
        le=MAX_STALENESS,
        description=(
            "Policy versions a group's oldest token may lag behind the policy when the learner takes "
            "the batch (admission and the buffer enforce it; the learner, a batch ahead, trains it at "
            "most 2 versions later)."
        ),
    )
    sync: Literal["batch", "none"] = Field("batch", description="batch: fsync per Put; none: leave it to the OS.")
    sample_order: Literal["oldest-first", "newest-first"] = Field(
        "oldest-first",
        description=(
            "Which complete groups the learner gets first. oldest-first: in the order they completed "
            "(FIFO); newest-first: the latest completed, so a queue that builds up while actors run "
            "ahead ages (and is dropped at maxStaleness) instead of delaying every batch behind it."
        ),
    )
    failed_group_policy: Literal["mask", "discard"] = Field(
        "mask", description="Deliver groups containing a failed episode masked, or discard (and count) them."
    )
    group_timeout_seconds: float = Field(600.0, gt=0, description="Incomplete groups older than this are reported.")
    storage_size: Annotated[str, Field(pattern=QUANTITY_PATTERN)] = Field(
        "10Gi", description="PersistentVolumeClaim size for the write-ahead log."
    )
    auth_secret_ref: SecretRef | None = Field(
        None, description="Secret holding the bearer token; the operator generates one when unset."
    )
    port: int = Field(50051, ge=1, le=65535)


# ------------------------------------------------------------------------------------- learner


class MeshSpec(SpecModel):
    """Named mesh axes and their sizes; -1 takes all remaining devices."""

    fsdp: int = Field(-1, description="Parameter/optimizer sharding axis.")
    ep: int = Field(
        1,
        ge=1,
        description=(
            "Expert-parallel axis (a mixture-of-experts model): each device holds numExperts/ep whole experts and "
            "tokens travel to them by all-to-all; data parallel for everything else. Must divide numExperts "
            "(docs/moe.md)."
        ),
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel axis.")
    sequence_sharding: bool = Field(
        False,
        description=(
            "Split the residual stream's tokens over tp between layers (sequence parallelism): each layer's "
            "saved input takes 1/tp of the memory, for an all-gather and a reduce-scatter per layer; "
            "the values are unchanged. Worth it for long sequences with tp > 1 (see stoker plan)."
        ),
    )
    expert_capacity_factor: float | None = Field(
        None,
        gt=0,
        description=(
            "A mixture of experts' capacity: each expert takes at most ceil(factor x k x tokens / numExperts) of a "
            "device's tokens, the rest of its tokens dropped (reported as moe_dropped_fraction), for matmul work "
            "near the routed tokens'. Unset: no token is ever dropped (the learner's log-probs equal the "
            "sampler's), at numExperts/k times the routed work."
        ),
    )


class CheckpointSpec(SpecModel):
    dir: str = Field("checkpoints", description="Orbax checkpoint directory (local path or gs://).")
    interval_steps: int = Field(50, ge=1)
    keep: int = Field(3, ge=1, description="Checkpoints retained.")


# A GCS bucket name (dots allowed: domain-named buckets); Cloud Storage's own rules, simplified.
GCS_BUCKET_PATTERN = r"^[a-z0-9][-_.a-z0-9]*[a-z0-9]$"


class WeightsVolumeSpec(SpecModel):
    """A shared volume for sharded weights: the learner pods mount it read-write and publish
    every version into it (each host its own shards), the rollout servers mount it read-only and
    read by slice from it (docs/gke.md, "Weights at scale"). Exactly one of the two."""

    gcs_bucket: Annotated[str, Field(pattern=GCS_BUCKET_PATTERN, min_length=3, max_length=222)] | None = Field(
        None,
        description=(
            "GCS bucket mounted through GKE's Cloud Storage FUSE CSI driver (the pods' ServiceAccount "
            "needs roles/storage.objectUser on it)."
        ),
    )
    persistent_volume_claim: Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] | None = Field(
        None, description="A ReadWriteMany PersistentVolumeClaim in the job's namespace (e.g. Filestore)."
    )


class LearnerSpec(SpecModel):
    accelerator: Literal["cpu", TpuAccelerator] = Field(
        "cpu", description="GKE TPU accelerator label, or cpu for a local run (immutable)."
    )
    topology: TpuTopology | None = Field(
        None, description="TPU topology, e.g. 2x4 (immutable once set)."
    )
    num_slices: int = Field(1, ge=1, le=1024, description="TPU slices (multislice when > 1; immutable).")
    mesh: MeshSpec = Field(default_factory=MeshSpec)
    batch_groups: int = Field(4, ge=1, description="Groups per training step.")
    sequence_buckets: list[int] = Field(
        default_factory=lambda: [128, 256, 512],
        min_length=1,
        max_length=MAX_SEQUENCE_BUCKETS,
        description="Packed row lengths.",
    )
    microbatch_tokens: int | None = Field(
        None,
        ge=8,
        description="Tokens (rows x bucket length) per packed micro-batch; 4 x the longest bucket when unset.",
    )
    weight_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "dtype of the weights the learner trains (master weights; model.dtype is what it computes and publishes "
            "in). bfloat16 halves parameters and gradients, but bfloat16 keeps 8 bits of a weight: an update smaller "
            "than about |w| x 2^-9 rounds away, so at fine-tuning rates (learningRate ~1e-6 to 1e-5) nearly every "
            "update is lost (refused below 1e-5), and weight decay too. The update is computed in float32 and rounded "
            "once. Not with model.lora."
        ),
    )
    optimizer_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "dtype Adam's two moments are stored in (computed in float32 either way). bfloat16 halves the optimizer "
            "state; its 8 bits cannot follow v's 0.1%-a-step decay (b2 0.999), so after ~500 updates v only grows: "
            "steps come out smaller, never larger. A checkpoint of either restores into the other."
        ),
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    publish_interval_steps: int = Field(1, ge=1, description="Publish weights to actors every k steps.")
    weights_volume: WeightsVolumeSpec | None = Field(
        None,
        description=(
            "Publish sharded weights into this shared volume, which the rollout servers read from; "
            "unset: the rollout servers fetch from the learner pods' own servers (peer serving)."
        ),
    )
    max_steps: int = Field(
        500, ge=1, description="Training stops after this many steps (batches consumed, updates or not)."
    )
    compilation_cache_dir: str | None = Field(None, description="JAX persistent compilation cache.")
    log_samples_every_steps: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description=(
            "Every this many steps the best and the worst episode of the batch are decoded to samples.jsonl "
            "beside the metrics and to TensorBoard text (prompt, completion, reward terms, turns); 0 never."
        ),
    )
    max_restarts: int = Field(3, ge=0, description="JobSet failurePolicy.maxRestarts.")
    queue_name: str | None = Field(None, description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name).")
    image: str | None = Field(None, description="Learner image; the operator's default when unset (immutable).")
    service_account_name: Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] | None = Field(
        None,
        description=(
            "ServiceAccount the learner pods run as (e.g. one bound to a Google service account by "
            "Workload Identity for gs:// checkpoints); the namespace's default when unset. "
            "Disaggregated mode only: a colocated learner runs as the job's sandbox manager."
        ),
    )

    @field_validator("sequence_buckets")
    @classmethod
    def _buckets_ascending(cls, buckets: list[int]) -> list[int]:
        if buckets != sorted(set(buckets)) or buckets[0] < 8:
            raise ValueError(f"got {buckets}; expected strictly ascending lengths >= 8")
        return buckets
