"""The actors' sections of the RLJob spec: the environment they play (its tasks, rewards and
sandboxes) and the actor pool with its sampling.

Import the spec from ``stoker.spec``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from stoker.spec_base import ResourceList, Resources, SpecModel

# CEL checks every environment.evalTasks entry; bounded so the API server can cost the rule.
MAX_EVAL_TASK_ENTRIES = 1024
MAX_EVAL_TASK_CHARACTERS = 4096


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
    observation_role: Literal["user", "tool", "ipython"] = Field(
        "user",
        description=(
            "Chat-template role of the observations after the first (the first is always the user's task): "
            "tool (Qwen's <tool_response>) or ipython (Llama 3); user where the template has no such role (Gemma)."
        ),
    )
    max_turns: int = Field(8, ge=1, description="Turn limit per episode.")
    max_episode_seconds: float = Field(300.0, gt=0, description="Wall-clock limit per episode.")
    step_latency: StepLatency = Field(default_factory=StepLatency)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)


# -------------------------------------------------------------------------------------- actors


class SamplingSpec(SpecModel):
    temperature: float = Field(1.0, gt=0, description="Softmax temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(
        0, ge=0, le=1_000_000,
        description="Sample among the k most likely tokens only (0: all). Log-probs are recorded, and trained, under the renormalised distribution.",
    )
    min_p: float = Field(
        0.0, ge=0, lt=1,
        description=(
            "Drop tokens less likely than minP times the most likely one (0: off), at the sampling temperature; "
            "log-probs as with topK."
        ),
    )
    max_new_tokens: int = Field(4, ge=1, description="Token limit per model turn.")
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None,
        min_length=1,
        max_length=16,
        description=(
            "A model turn also ends once its text contains one of these (kept, like a stop token); the tokens "
            "sampled after it are dropped, so the trajectory stays exactly what was sampled up to there."
        ),
    )
    max_tokens_per_episode: int | None = Field(
        None,
        ge=1,
        description=(
            "Sampled tokens per episode over all its turns: a turn gets at most what is left (and maxNewTokens), "
            "and the episode is truncated when nothing is. No limit but maxNewTokens per turn when unset."
        ),
    )
    allowed_tokens: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "Constrained decoding: model turns may only produce these tokens (e.g. an environment's "
            "action words): each a vocabulary entry, or text that encodes to one token (with BPE "
            "tokenizers write ' 8' for the token after a space, raw spelling 'Ġ8'). The learner applies "
            "the same restriction, so trained and sampled log-probs agree. All tokens when unset."
        ),
    )


class ActorsSpec(SpecModel):
    replicas: int | None = Field(
        None,
        ge=0,
        description=(
            "Actor processes/pods. Unset: stoker run starts as many as the host's cores can feed (one core "
            "each, after one for the buffer and one per learner process); the operator starts as many as "
            "admission keeps busy ((maxStaleness + 1) x batchGroups x groupSize episodes / concurrency). "
            "Both within minReplicas..maxReplicas."
        ),
    )
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
