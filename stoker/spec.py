"""The RLJob: one typed model of a whole job, the single source of truth.

Everything else is derived from these classes: the CRD schema (``stoker crd``), manifest
validation (``stoker validate``), the local runner, the operator's children and each component's
settings. Field names are snake_case in Python and camelCase in YAML, as Kubernetes users expect.

Defaults make a minimal manifest work: ``spec: {}`` is a valid local FrozenLake job.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from stoker import spec_cel
from stoker.jobname import name_problems as _name_problems
from stoker.jobname import rollout_name_problems as _rollout_name_problems
from stoker.tpu import TopologyError, hosts_per_slice

GROUP = "stoker.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

# A Kubernetes resource quantity such as "500m", "2", "4Gi".
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# RFC 1123 DNS label: what Kubernetes accepts as an object name used in child names.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# RFC 1123 subdomain: ServiceAccount names.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# CEL compares neighbouring buckets one by one, so the list is bounded.
MAX_SEQUENCE_BUCKETS = 16
# CEL checks every environment.evalTasks entry; bounded so the API server can cost the rule.
MAX_EVAL_TASK_ENTRIES = 1024
MAX_EVAL_TASK_CHARACTERS = 4096


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CEL rule, emitted into the CRD's ``x-kubernetes-validations``."""
    return {"rule": rule, "message": message}


class SpecModel(BaseModel):
    """Base for every part of the spec: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=True,
    )


# --------------------------------------------------------------------------------------- model


class RopeScaling(SpecModel):
    """Rotary frequency rescaling for long contexts, as Hugging Face's ``rope_type`` names it.

    llama3 (Llama 3.1+): by wavelength band; high frequencies kept, low ones divided by
    ``factor``, a smooth blend between. linear (Gemma 3's global layers): all divided by ``factor``.
    """

    type: Literal["llama3", "linear"] = Field(description="llama3 | linear.")
    factor: float = Field(gt=0, description="How much longer the context is than the one trained on.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above originalMaxPositionEmbeddings / this are scaled.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below originalMaxPositionEmbeddings / this are kept.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="llama3: the pre-extension context.")


class TransformerConfig(SpecModel):
    """Architecture of the decoder-only policy (Llama, Qwen2/3, Gemma 2/3 families).

    With ``model.checkpoint`` set, this is read from the checkpoint's config.json; fields written
    in the manifest must then agree with it."""

    vocab_size: int = Field(64, ge=2, description="Tokenizer vocabulary size.")
    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Query heads per block.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int | None = Field(None, ge=4, description="Per-head width; hiddenSize/numHeads when unset.")
    intermediate_size: int = Field(128, ge=8, description="SwiGLU hidden width.")
    max_seq_len: int = Field(512, ge=16, description="Longest sequence the rotary tables cover.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary embedding base.")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(True, description="Share the input embedding with the output head.")
    attention_bias: bool = Field(False, description="Biases on the query/key/value projections (Qwen2).")
    qk_norm: bool = Field(False, description="RMSNorm on each query and key head before rotary (Qwen3, Gemma 3).")
    rope_scaling: RopeScaling | None = Field(None, description="Rotary frequency rescaling (global layers only).")
    mlp_activation: Literal["silu", "gelu-tanh"] = Field(
        "silu", description="Gate activation: silu (SwiGLU, Llama/Qwen) or gelu-tanh (GeGLU, Gemma)."
    )
    norm_unit_offset: bool = Field(False, description="RMSNorm scales by (1 + weight) (Gemma).")
    sandwich_norms: bool = Field(False, description="Also normalise the attention and MLP outputs (Gemma 2/3).")
    embedding_scale: bool = Field(False, description="Multiply token embeddings by sqrt(hiddenSize) (Gemma).")
    query_pre_attn_scalar: float | None = Field(
        None, gt=0, description="Scale queries by this^-1/2 instead of headDim^-1/2 (Gemma)."
    )
    attn_logit_softcap: float | None = Field(None, gt=0, description="cap * tanh(score / cap) on attention scores (Gemma 2).")
    final_logit_softcap: float | None = Field(None, gt=0, description="cap * tanh(logit / cap) on the output logits (Gemma 2).")
    sliding_window: int | None = Field(
        None, ge=1, description="Local layers see only the last slidingWindow tokens (the token itself included)."
    )
    global_layer_every: int | None = Field(
        None, ge=1, description="With slidingWindow: layer i is global iff (i + 1) % this == 0, the rest local (Gemma 2: 2, Gemma 3: 6)."
    )
    rope_local_theta: float | None = Field(None, gt=0, description="Rotary base of local layers; ropeTheta when unset (Gemma 3).")

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("numHeads must be a multiple of numKvHeads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hiddenSize must be a multiple of numHeads when headDim is unset")
        if (self.sliding_window is None) != (self.global_layer_every is None):
            raise ValueError("slidingWindow and globalLayerEvery go together")
        return self

    def is_local_layer(self, index: int) -> bool:
        """Whether layer ``index`` attends through the sliding window."""
        return self.global_layer_every is not None and (index + 1) % self.global_layer_every != 0


class ModelSpec(SpecModel):
    """The policy: an architecture to initialise, or a Hugging Face-format checkpoint."""

    checkpoint: str | None = Field(
        None, description="Directory with safetensors weights and config.json; random init when unset."
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "A tokenizers tokenizer.json, or a Hugging Face tokenizer directory (tokenizer_config.json and "
            "its chat template beside it); the checkpoint's own when unset, the environment's built-in "
            "without a checkpoint. 'builtin' pairs even a checkpoint with the built-in tokenizer."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "A jinja chat template file for the opening and the turn wrapper; the tokenizer's own "
            "(tokenizer_config.json) when unset; 'none' for Stoker's plain turn format."
        ),
    )
    system_prompt: str | None = Field(None, description="System message rendered by the chat template.")
    architecture: TransformerConfig = Field(
        default_factory=TransformerConfig,
        description="Read from the checkpoint's config.json when checkpoint is set; fields given here must agree with it.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter and compute dtype.")
    remat: Literal["none", "full", "save-matmuls"] = Field(
        "full",
        description=(
            "Per-layer rematerialisation in the learner's step: full keeps only each layer's input and "
            "recomputes the rest in the backward pass; save-matmuls also keeps matmul outputs; none keeps all."
        ),
    )
    attention: Literal["auto", "blockwise", "xla", "cudnn", "splash"] = Field(
        "auto",
        description=(
            "Attention kernel of the learner's training forward: auto picks splash on a TPU, cuDNN on an "
            "NVIDIA GPU and blockwise elsewhere, falling back to blockwise where the model needs what the "
            "kernel lacks (cuDNN: bfloat16/float16, no soft-cap); blockwise (memory-efficient, anywhere); "
            "xla (jax.nn.dot_product_attention, dense scores); cudnn and splash are refused off their hardware."
        ),
    )


# ----------------------------------------------------------------------------------- algorithm


class AlgorithmName(StrEnum):
    """str(AlgorithmName.GRPO) == "grpo", so the default and a parsed value read the same."""

    GRPO = "grpo"
    PPO = "ppo"
    DPO = "dpo"
    GSPO = "gspo"


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


class AlgorithmSpec(SpecModel):
    """The RL objective and its hyperparameters."""

    name: AlgorithmName = Field(AlgorithmName.GRPO, description="grpo | ppo | dpo | gspo.")
    learning_rate: float = Field(3e-3, gt=0, description="Adam learning rate (the peak, under a schedule).")
    clip_epsilon: float = Field(0.2, gt=0, description="PPO-style ratio clip (low side).")
    clip_epsilon_high: float | None = Field(None, gt=0, description="Upper ratio clip; clipEpsilon when unset.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (0 disables it).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus.")
    off_policy_correction: Literal["clip", "decoupled", "none"] = Field(
        "clip",
        description=(
            "How stale tokens are corrected. clip: PPO's clipped ratio against the sampler's own "
            "log-probs (a trust region around the policy that generated them); decoupled: AReaL's "
            "truncated weight min(pi/mu, importanceCap) with the clip around the current policy; "
            "none: no correction."
        ),
    )
    importance_cap: float = Field(2.0, ge=1, description="Truncation cap of the decoupled importance weight (and DPO's).")
    dual_clip: float = Field(
        3.0, gt=1, description="Bound on a negative-advantage token's ratio term (dual-clip PPO)."
    )
    loss_aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "token-mean", description="How per-token losses are averaged."
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
    advantage_normalization: Literal["population-std", "sample-std", "none"] = Field(
        "population-std",
        description=(
            "GRPO/GSPO group advantage (r - mean) / (std + 1e-6). population-std: std with ddof=0; "
            "sample-std: ddof=1, as TRL, verl and Tunix compute it (advantages sqrt((G-1)/G) as large); "
            "none: r - mean (Dr. GRPO)."
        ),
    )


# --------------------------------------------------------------------------------- environment


class FrozenLakeOptions(SpecModel):
    size: int = Field(4, ge=2, le=16, description="Map side length.")
    slippery: bool = Field(False, description="Gymnasium's is_slippery.")
    map_seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2, 3], min_length=1, description="Each seed generates one random solvable map."
    )
    hole_probability: float = Field(0.2, ge=0, lt=1, description="1 - gymnasium's p (frozen-tile probability).")
    reward_shaping: bool = Field(
        True,
        description=(
            "Potential-based shaping (distance to goal, holes lowest); on a deterministic lake it never "
            "changes the optimal policy."
        ),
    )


class SweOptions(SpecModel):
    tasks: list[str] = Field(
        default_factory=list, description="Task names from the bundled set; all bundled tasks when empty."
    )


class StepLatency(SpecModel):
    """Extra delay injected into every environment step (benchmarks)."""

    distribution: Literal["none", "fixed", "uniform", "exponential"] = "none"
    seconds: float = Field(0.0, ge=0, description="The fixed delay, or the mean for uniform/exponential.")


class SandboxSpec(SpecModel):
    kind: Literal["process", "pod", "inline"] = Field(
        "process",
        description=(
            "process: a local subprocess per episode; pod: a Kubernetes pod per episode; "
            "inline: inside the actor process, no isolation (trusted environments such as FrozenLake; fastest)."
        ),
    )
    image: str | None = Field(None, description="Sandbox pod image (kind: pod); the actor image when unset.")
    cpu_seconds: int = Field(60, ge=1, description="CPU-time limit per sandbox.")
    memory_mb: int = Field(512, ge=16, description="Address-space limit per sandbox.")
    step_timeout_seconds: float = Field(30.0, gt=0, description="Wall-clock limit per environment step.")
    heartbeat_seconds: float = Field(10.0, gt=0, description="How often the actor marks its sandboxes alive.")
    heartbeat_ttl_seconds: float = Field(120.0, gt=0, description="A sandbox pod silent this long is a zombie.")


class RewardTermSpec(SpecModel):
    function: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description="A reward function package.module:function, called after every step (stoker.actor.rewards).",
    )
    weight: float = Field(1.0, description="Its weight in the step's reward.")


class RewardSpec(SpecModel):
    environment_weight: float = Field(1.0, description="Weight of the environment's own reward.")
    terms: list[RewardTermSpec] = Field(default_factory=list, description="Reward plugins added to it.")


class EnvironmentSpec(SpecModel):
    name: str = Field(
        "frozenlake",
        min_length=1,
        description=(
            "frozenlake | swe | swebench | answers (built in), a name registered in the stoker.environments "
            "entry-point group, or an import reference package.module:factory."
        ),
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options for a plugin or the answers environment; checked by the plugin's options model.",
    )
    tasks: list[str] = Field(
        default_factory=list,
        description="Task ids, or paths of JSONL task files (entries ending in .jsonl); the environment's own when empty.",
    )
    eval_tasks: list[Annotated[str, Field(min_length=1, max_length=MAX_EVAL_TASK_CHARACTERS)]] = Field(
        default_factory=list,
        max_length=MAX_EVAL_TASK_ENTRIES,
        description=(
            "Held-out evaluation: task ids or JSONL task files (as in tasks; FrozenLake: map seeds), played "
            "greedily every evalEveryVersions policy versions and never trained on. No evaluation when empty."
        ),
    )
    eval_every_versions: int = Field(10, ge=1, description="An evaluation round each time the policy version reaches a multiple of this.")
    eval_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="Share of each actor's episode slots an evaluation round may take (at least one); training goes on in the rest.",
    )
    eval_episodes_per_task: int = Field(1, ge=1, le=1024, description="Greedy episodes of each evaluation task per round.")
    frozenlake: FrozenLakeOptions = Field(default_factory=FrozenLakeOptions)
    swe: SweOptions = Field(default_factory=SweOptions)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    max_turns: int = Field(8, ge=1, description="Turn limit per episode.")
    max_episode_seconds: float = Field(300.0, gt=0, description="Wall-clock limit per episode.")
    step_latency: StepLatency = Field(default_factory=StepLatency)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)


# -------------------------------------------------------------------------------------- actors


class ResourceList(SpecModel):
    cpu: Annotated[str, Field(pattern=QUANTITY_PATTERN)] | None = None
    memory: Annotated[str, Field(pattern=QUANTITY_PATTERN)] | None = None


class Resources(SpecModel):
    requests: ResourceList = Field(default_factory=ResourceList)
    limits: ResourceList = Field(default_factory=ResourceList)


class SamplingSpec(SpecModel):
    temperature: float = Field(1.0, gt=0, description="Softmax temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(4, ge=1, description="Token limit per model turn.")
    allowed_tokens: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "Constrained decoding: model turns may only produce these tokens (e.g. an environment's "
            "action words). The learner applies the same restriction, so trained and sampled "
            "log-probs agree. All tokens when unset."
        ),
    )


class ActorsSpec(SpecModel):
    replicas: int = Field(2, ge=0, description="Actor processes/pods.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling floor.")
    max_replicas: int = Field(8, ge=1, description="Autoscaling ceiling.")
    concurrency: int = Field(8, ge=1, description="Episodes each actor runs at once.")
    image: str | None = Field(None, description="Actor image; the operator's default when unset.")
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests=ResourceList(cpu="1", memory="2Gi"), limits=ResourceList(cpu="2", memory="4Gi")
        )
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    weight_sync: Literal["between-turns", "between-episodes"] = Field(
        "between-turns",
        description=(
            "between-turns: every turn samples with the newest weights (a running episode's cached "
            "conversation is prefilled again after a swap); between-episodes: an episode samples with "
            "the weights it started with to its end (one version per episode, its cache stays valid, "
            "later turns are staler)."
        ),
    )
    weight_poll_seconds: float = Field(
        1.0,
        gt=0,
        le=3600,
        description=(
            "How often each actor looks for newer weights. With between-turns, every running "
            "conversation is prefilled again after a swap: when environment steps are slow (turns "
            "seconds apart), a longer period saves most of that sampling work for slightly older "
            "weights (docs/sizing.md)."
        ),
    )
    conversation_cache_mib: int = Field(
        512,
        ge=0,
        alias="conversationCacheMiB",  # the unit as written everywhere else, not to_camel's "Mib"
        description=(
            "Memory for each actor's cache of running conversations (keys/values), so a turn prefills "
            "only its new tokens; up to one row per concurrent episode. 0 turns it off."
        ),
    )


# ------------------------------------------------------------------------------------- rollout


class RolloutSpec(SpecModel):
    """The rollout tier: generation servers on accelerators that the actors call (``stoker rollout``).

    Without it (the default) every actor samples in-process on its own CPU, which suits small
    policies; with it the actors keep episodes and sandboxes and send token ids to these servers.
    """

    replicas: int = Field(1, ge=0, description="Rollout servers (each a Deployment pod, or a group of hosts on a multi-host TPU slice).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling floor.")
    max_replicas: int = Field(4, ge=1, description="Autoscaling ceiling.")
    accelerator: Literal[
        "cpu", "nvidia-gpu", "tpu-v4-podslice", "tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu-v6e-slice", "tpu7x"
    ] = Field("cpu", description="cpu, nvidia-gpu, or a GKE TPU accelerator label.")
    topology: Annotated[str, Field(pattern=r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$", max_length=20)] | None = Field(
        None, description="TPU topology of each server's slice, e.g. 2x2."
    )
    gpus: int = Field(1, ge=1, le=16, description="GPUs per server (accelerator nvidia-gpu): the nvidia.com/gpu limit.")
    gpu_type: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] | None = Field(
        None, description="GKE GPU node label cloud.google.com/gke-accelerator, e.g. nvidia-l4 (nvidia-gpu only)."
    )
    image: str | None = Field(None, description="Rollout image; the learner image when unset (it has the accelerator runtime).")
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests=ResourceList(cpu="2", memory="8Gi"), limits=ResourceList(cpu="4", memory="16Gi")
        )
    )
    max_batch: int = Field(32, ge=1, le=4096, description="Sequences each server decodes together.")
    max_queue: int = Field(
        256,
        ge=1,
        description="Requests waiting beyond the batch after which a server answers RESOURCE_EXHAUSTED with a retry hint.",
    )
    port: int = Field(50053, ge=1, le=65535)


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
    tp: int = Field(1, ge=1, description="Tensor-parallel axis.")


class CheckpointSpec(SpecModel):
    dir: str = Field("checkpoints", description="Orbax checkpoint directory (local path or gs://).")
    interval_steps: int = Field(50, ge=1)
    keep: int = Field(3, ge=1, description="Checkpoints retained.")


TPU_ACCELERATORS = (
    "tpu-v4-podslice",
    "tpu-v5-lite-podslice",
    "tpu-v5p-slice",
    "tpu-v6e-slice",
    "tpu7x",
)


class LearnerSpec(SpecModel):
    accelerator: Literal["cpu", "tpu-v4-podslice", "tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu-v6e-slice", "tpu7x"] = Field(
        "cpu", description="GKE TPU accelerator label, or cpu for a local run (immutable)."
    )
    topology: Annotated[str, Field(pattern=r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$", max_length=20)] | None = Field(
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
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    publish_interval_steps: int = Field(1, ge=1, description="Publish weights to actors every k steps.")
    max_steps: int = Field(
        500, ge=1, description="Training stops after this many steps (batches consumed, updates or not)."
    )
    compilation_cache_dir: str | None = Field(None, description="JAX persistent compilation cache.")
    max_restarts: int = Field(3, ge=0, description="JobSet failurePolicy.maxRestarts.")
    queue_name: str | None = Field(None, description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name).")
    image: str | None = Field(None, description="Learner image; the operator's default when unset.")
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
    seed: int = Field(0, ge=0, description="Seeds initialisation, sampling and environments.")


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


# ---------------------------------------------------------------------- cross-field rules


def cross_field_problems(spec: RLJobSpec) -> list[tuple[str, str]]:
    """Rules spanning several fields, as ``(field path under spec, message)``.

    Kept as plain checks rather than pydantic validators so each problem names the exact field;
    the CRD carries the same rules as CEL (see ``stoker.crd``) so the API server enforces them too.
    """
    problems: list[tuple[str, str]] = []
    actors = spec.actors
    if actors.min_replicas > actors.max_replicas:
        problems.append(
            ("actors.minReplicas", f"got {actors.min_replicas}; expected <= maxReplicas ({actors.max_replicas})")
        )
    if spec.learner.accelerator != "cpu" and spec.learner.topology is None:
        problems.append(("learner.topology", f"missing; required for accelerator {spec.learner.accelerator}"))
    if spec.algorithm.name in (AlgorithmName.GRPO, AlgorithmName.GSPO) and spec.buffer.group_size < 2:
        problems.append(
            ("buffer.groupSize", f"got {spec.buffer.group_size}; expected >= 2 for group-relative advantages")
        )
    longest_bucket = spec.learner.sequence_buckets[-1]
    if longest_bucket > spec.model.architecture.max_seq_len:
        problems.append(
            (
                "learner.sequenceBuckets",
                f"got a {longest_bucket}-token bucket; expected <= model.architecture.maxSeqLen "
                f"({spec.model.architecture.max_seq_len})",
            )
        )
    if spec.learner.accelerator != "cpu" and spec.learner.topology is not None:
        try:
            hosts_per_slice(spec.learner.accelerator, spec.learner.topology)
        except TopologyError as exc:
            problems.append(("learner.topology", str(exc)))
    if spec.environment.name == "frozenlake":
        seeds = [task for task in spec.environment.eval_tasks if not task.isascii() or not task.isdigit()]
        if seeds:
            problems.append(("environment.evalTasks", f"got {seeds[:3]}; expected FrozenLake map seeds (non-negative integers)"))
    if spec.mode == "colocated" and spec.learner.service_account_name is not None:
        problems.append(
            ("learner.serviceAccountName", "set in colocated mode; expected unset (the learner runs as the sandbox manager)")
        )
    if spec.rollout is not None:
        problems += rollout_problems(spec)
    return problems


def rollout_problems(spec: RLJobSpec) -> list[tuple[str, str]]:
    """``spec.rollout``'s rules: the accelerator's own fields only, a slice GKE has, sane bounds.

    A colocated job refuses a rollout tier: its learner generates on its own mesh, so servers
    beside it would never be called (docs/operator.md, "The rollout tier")."""
    rollout = spec.rollout
    if rollout is None:
        return []
    problems: list[tuple[str, str]] = []
    if spec.mode == "colocated":
        problems.append(
            ("rollout", "set in colocated mode; expected unset (a colocated learner generates on its own mesh)")
        )
    if rollout.min_replicas > rollout.max_replicas:
        problems.append(
            ("rollout.minReplicas", f"got {rollout.min_replicas}; expected <= maxReplicas ({rollout.max_replicas})")
        )
    accelerator = rollout.accelerator
    if accelerator in TPU_ACCELERATORS:
        if rollout.topology is None:
            problems.append(("rollout.topology", f"missing; required for accelerator {accelerator}"))
        else:
            try:
                hosts_per_slice(accelerator, rollout.topology)
            except TopologyError as exc:
                problems.append(("rollout.topology", str(exc)))
    elif rollout.topology is not None:
        problems.append(("rollout.topology", f"got {rollout.topology}; expected unset for accelerator {accelerator} (TPU only)"))
    if accelerator != "nvidia-gpu":
        if rollout.gpus != 1:
            problems.append(("rollout.gpus", f"got {rollout.gpus}; expected unset for accelerator {accelerator} (nvidia-gpu only)"))
        if rollout.gpu_type is not None:
            problems.append(("rollout.gpuType", f"got {rollout.gpu_type}; expected unset for accelerator {accelerator} (nvidia-gpu only)"))
    return problems


def rollout_hosts(rollout: RolloutSpec) -> int:
    """Pods per rollout server: the hosts of its TPU slice, 1 otherwise (and for a bad topology,
    which is reported on its own)."""
    if rollout.accelerator not in TPU_ACCELERATORS:
        return 1
    try:
        return hosts_per_slice(rollout.accelerator, rollout.topology)
    except TopologyError:
        return 1


def name_problems(name: str, spec: RLJobSpec) -> list[str]:
    """Why ``name`` cannot name an RLJob with this spec: its learner's pod names must stay DNS labels."""
    try:
        hosts = hosts_per_slice(spec.learner.accelerator, spec.learner.topology)
    except TopologyError:
        hosts = 1  # the topology is reported on its own; check what holds for any shape
    problems = _name_problems(name, spec.learner.num_slices, hosts)
    if spec.rollout is not None and rollout_hosts(spec.rollout) > 1:
        problems += _rollout_name_problems(name, spec.rollout.max_replicas, rollout_hosts(spec.rollout))
    return problems


# CEL equivalents of cross_field_problems (and of the model validators above), attached to the
# CRD schema at these paths; tests/core/test_cel.py runs both on one table of cases.
_ROOT_ACCELERATOR = spec_cel.opt("self", ("spec", "learner", "accelerator"), "'cpu'")
_ROOT_TOPOLOGY = spec_cel.opt("self", ("spec", "learner", "topology"), "''")
_ROOT_SLICES = spec_cel.opt("self", ("spec", "learner", "numSlices"), "1")
_ROOT_MODE = spec_cel.opt("self", ("spec", "mode"), "'disaggregated'")
_LEARNER = "self.spec.learner"
_ROOT_HAS_TPU = f"has(self.spec) && has({_LEARNER}) && has({_LEARNER}.topology) && {_LEARNER}.accelerator != 'cpu'"


_ROLLOUT = "self.spec.rollout"
_TPUS = spec_cel.string_list(TPU_ACCELERATORS)
_ROLLOUT_HOSTS = spec_cel.hosts(f"{_ROLLOUT}.accelerator", f"{_ROLLOUT}.topology")
_ROOT_HAS_MULTI_HOST_ROLLOUT = (
    f"has(self.spec) && has({_ROLLOUT}) && {_ROLLOUT}.accelerator in {_TPUS} && has({_ROLLOUT}.topology) && "
    + spec_cel.valid_topology(f"{_ROLLOUT}.accelerator", f"{_ROLLOUT}.topology")
    + f" && {_ROLLOUT_HOSTS} > 1"
)


def _old(expression: str) -> str:
    return expression.replace("self.", "oldSelf.").replace("has(self)", "has(oldSelf)")


_ALGORITHM = spec_cel.opt("self", ("algorithm", "name"), "'grpo'")
_GROUP_SIZE = spec_cel.opt("self", ("buffer", "groupSize"), str(BufferSpec().group_size))
_BUCKETS = spec_cel.opt("self", ("learner", "sequenceBuckets"), str(LearnerSpec().sequence_buckets))
_MAX_SEQ_LEN = spec_cel.opt("self", ("model", "architecture", "maxSeqLen"), str(TransformerConfig().max_seq_len))

ROOT_CEL_RULES: list[dict[str, Any]] = [
    cel(
        f"!has(self.metadata.name) || ({_ROOT_HAS_TPU} ? "
        + spec_cel.name_fits("self.metadata.name", f"{_LEARNER}.numSlices", spec_cel.hosts(f"{_LEARNER}.accelerator", f"{_LEARNER}.topology"))
        + " : "
        + spec_cel.name_fits("self.metadata.name", _ROOT_SLICES, "1")
        + ")",
        "metadata.name is too long: the learner's pod names (<name>-learner-slice-<slice>-<host>-<5 characters>) "
        "must stay at most 63 characters (stoker validate says the limit)",
    ),
    cel("!has(self.metadata.name) || self.metadata.name.matches('^[a-z]')", "metadata.name must start with a letter"),
    cel(f"{_ROOT_MODE} == {_old(_ROOT_MODE)}", "spec.mode is immutable"),
    cel(f"{_ROOT_ACCELERATOR} == {_old(_ROOT_ACCELERATOR)}", "spec.learner.accelerator is immutable"),
    cel(f"{_old(_ROOT_TOPOLOGY)} == '' || {_ROOT_TOPOLOGY} == {_old(_ROOT_TOPOLOGY)}", "spec.learner.topology is immutable once set"),
    cel(f"{_ROOT_SLICES} == {_old(_ROOT_SLICES)}", "spec.learner.numSlices is immutable"),
    cel(
        f"!has(self.metadata.name) || !({_ROOT_HAS_MULTI_HOST_ROLLOUT}) || "
        + spec_cel.rollout_name_fits("self.metadata.name", f"{_ROLLOUT}.maxReplicas", _ROLLOUT_HOSTS),
        "metadata.name is too long: the rollout pods' names (<name>-rollout-<server>-slice-0-<host>-<5 characters>) "
        "must stay at most 63 characters (stoker validate says the limit)",
    ),
]

CEL_RULES: dict[tuple[str, ...], list[dict[str, Any]]] = {
    (): [
        cel(
            f"!({_ALGORITHM} in ['grpo', 'gspo'] && {_GROUP_SIZE} < 2)",
            "buffer.groupSize must be >= 2 for grpo and gspo (group-relative advantages)",
        ),
        cel(
            f"{_BUCKETS}[{_BUCKETS}.size() - 1] <= {_MAX_SEQ_LEN}",
            "learner.sequenceBuckets must not exceed model.architecture.maxSeqLen",
        ),
        cel(
            f"!({spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated'"
            " && has(self.learner) && has(self.learner.serviceAccountName))",
            "learner.serviceAccountName is for disaggregated mode (a colocated learner runs as the sandbox manager)",
        ),
        cel(
            f"!({spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated' && has(self.rollout))",
            "rollout is for disaggregated mode (a colocated learner generates on its own mesh)",
        ),
    ],
    ("rollout",): [
        cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
        cel(f"!(self.accelerator in {_TPUS}) || has(self.topology)", "topology is required for a TPU accelerator"),
        cel(
            f"!(self.accelerator in {_TPUS}) || !has(self.topology) || "
            + spec_cel.valid_topology("self.accelerator", "self.topology"),
            "topology is not one this accelerator has (stoker validate names the ones it has)",
        ),
        cel(f"self.accelerator in {_TPUS} || !has(self.topology)", "topology is for TPU accelerators only"),
        cel("self.accelerator == 'nvidia-gpu' || self.gpus == 1", "gpus is for accelerator nvidia-gpu only"),
        cel("self.accelerator == 'nvidia-gpu' || !has(self.gpuType)", "gpuType is for accelerator nvidia-gpu only"),
    ],
    ("actors",): [cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas")],
    ("environment",): [
        cel(
            f"{spec_cel.opt('self', ('name',), repr('frozenlake'))} != 'frozenlake' || !has(self.evalTasks)"
            " || self.evalTasks.all(t, t.matches('^[0-9]+$'))",
            "evalTasks of frozenlake must be map seeds (non-negative integers)",
        )
    ],
    ("model", "architecture"): [
        cel("self.numHeads % self.numKvHeads == 0", "numHeads must be a multiple of numKvHeads"),
        cel("has(self.headDim) || self.hiddenSize % self.numHeads == 0", "hiddenSize must be a multiple of numHeads when headDim is unset"),
    ],
    ("learner",): [
        cel("self.accelerator == 'cpu' || has(self.topology)", "topology is required for a TPU accelerator"),
        cel(
            "self.accelerator == 'cpu' || !has(self.topology) || " + spec_cel.valid_topology("self.accelerator", "self.topology"),
            "topology is not one this accelerator has (stoker validate names the ones it has)",
        ),
        cel(
            "!has(self.sequenceBuckets) || self.sequenceBuckets[0] >= 8 && "
            + spec_cel.strictly_ascending("self.sequenceBuckets", MAX_SEQUENCE_BUCKETS),
            "sequenceBuckets must be strictly ascending lengths >= 8",
        ),
    ],
}
