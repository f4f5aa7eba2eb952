"""The actor's one settings dataclass, derived from the RLJob spec."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from stoker.actor.datasets import resolve_eval_tasks, training_tasks
from stoker.actor.environments import StepLatency, options_json
from stoker.actor.episode import EpisodeLimits
from stoker.actor.evaluation import EvalPlan
from stoker.labels import SANDBOX_POD_PORT
from stoker.actor.rewards import RewardTerm
from stoker.actor.sandbox import SandboxConfig
from stoker.conversation.tokenization import allowed_token_ids
from stoker.spec import RLJobSpec, SamplingSpec, TransformerConfig


@dataclass(frozen=True)
class PodSandboxSettings:
    """Where and how sandbox pods are created (``environment.sandbox.kind: pod``)."""

    namespace: str
    job: str
    actor_pod: str  # this actor's pod name: the label the operator reaps orphans by
    image: str
    cpu_limit: str = "1"
    memory_limit_mb: int = 512
    port: int = SANDBOX_POD_PORT
    actor_pod_uid: str | None = None
    """The actor pod's uid (``POD_UID``): sandbox pods name it as owner, so they go with it."""


@dataclass(frozen=True)
class ActorSettings:
    actor_id: str
    job: str
    environment: str
    tasks: tuple[str, ...]
    group_size: int
    concurrency: int
    limits: EpisodeLimits
    sandbox_kind: str
    sandbox: SandboxConfig
    weight_sync: str  # between-turns | between-episodes
    sampling: SamplingSpec
    model: TransformerConfig
    sampler_buckets: tuple[int, ...]
    seed: int
    max_groups: int | None = None
    weight_poll_seconds: float = 1.0
    pod: PodSandboxSettings | None = None
    checkpoint: str | None = None
    compilation_cache_dir: str | None = None  # JAX persistent cache: the sampler compiles once per shape
    allowed_token_ids: tuple[int, ...] | None = None  # constrained decoding (sampling.allowedTokens)
    conversation_cache_mib: int = 0
    reward_terms: tuple[RewardTerm, ...] = ()  # environment.reward: plugins added to each step's reward
    environment_reward_weight: float = 1.0
    evaluation: EvalPlan | None = None  # environment.evalTasks: held-out rounds, never trained on
    rollout_address: str | None = None  # a rollout server (host:port): sample there, not in-process

    @classmethod
    def from_spec(
        cls,
        spec: RLJobSpec,
        *,
        actor_id: str,
        job: str = "stoker",
        max_groups: int | None = None,
        namespace: str | None = None,
        pod_name: str | None = None,
        image: str | None = None,
        rollout_address: str | None = None,
    ) -> ActorSettings:
        env = spec.environment
        tasks, options = training_tasks(env)
        eval_tasks, options = resolve_eval_tasks(env, tasks, options)
        arch = spec.model.architecture
        # A whole conversation must fit the model's context and the learner's longest packed row.
        max_tokens = min(arch.max_seq_len, spec.learner.sequence_buckets[-1])
        buckets = tuple(b for b in spec.learner.sequence_buckets if b <= arch.max_seq_len) or (max_tokens,)
        sandbox = SandboxConfig(
            environment=env.name,
            options_json=options,
            step_latency=StepLatency(env.step_latency.distribution, env.step_latency.seconds),
            cpu_seconds=env.sandbox.cpu_seconds,
            memory_mb=env.sandbox.memory_mb,
            step_timeout_seconds=env.sandbox.step_timeout_seconds,
            heartbeat_seconds=env.sandbox.heartbeat_seconds,
            heartbeat_ttl_seconds=env.sandbox.heartbeat_ttl_seconds,
        )
        pod = None
        if env.sandbox.kind == "pod":
            pod = PodSandboxSettings(
                namespace=namespace or _current_namespace(),
                job=job,
                actor_pod=pod_name or os.environ.get("POD_NAME") or socket.gethostname(),
                image=env.sandbox.image or image or spec.actors.image or os.environ.get("STOKER_IMAGE", "stoker:latest"),
                memory_limit_mb=env.sandbox.memory_mb,
                actor_pod_uid=os.environ.get("POD_UID") or None,
            )
        return cls(
            actor_id=actor_id,
            job=job,
            environment=env.name,
            tasks=tasks,
            group_size=spec.buffer.group_size,
            concurrency=spec.actors.concurrency,
            limits=EpisodeLimits(
                max_turns=env.max_turns,
                max_new_tokens=spec.actors.sampling.max_new_tokens,
                max_tokens=max_tokens,
                episode_seconds=env.max_episode_seconds,
                max_sampled_tokens=spec.actors.sampling.max_tokens_per_episode,
                stop_strings=tuple(spec.actors.sampling.stop_strings or ()),
            ),
            sandbox_kind=env.sandbox.kind,
            sandbox=sandbox,
            weight_sync=spec.actors.weight_sync,
            weight_poll_seconds=spec.actors.weight_poll_seconds,
            sampling=spec.actors.sampling,
            model=arch,
            sampler_buckets=buckets,
            seed=spec.seed,
            max_groups=max_groups,
            pod=pod,
            checkpoint=spec.model.checkpoint,
            compilation_cache_dir=spec.learner.compilation_cache_dir,
            allowed_token_ids=allowed_token_ids(spec),
            conversation_cache_mib=spec.actors.conversation_cache_mib,
            reward_terms=tuple(RewardTerm(t.function, t.weight) for t in env.reward.terms),
            environment_reward_weight=env.reward.environment_weight,
            evaluation=EvalPlan.from_spec(env, eval_tasks, spec.actors.concurrency) if eval_tasks else None,
            rollout_address=rollout_address or None,
        )


def _current_namespace() -> str:
    """The pod's namespace from its service-account mount, else "default"."""
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as handle:
            return handle.read().strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE", "default")
