"""``stoker audit`` for a rollout tier: how many servers and actors keep the learner fed.

From the measured episodes (sampled tokens per model turn, turns, environment step), a server's
throughput (``--rollout-tokens-per-second``, or read from a running server's ``Stats`` with
``--rollout-address``) and the learner's step time:

* the learner consumes ``D = batchGroups x groupSize / step`` episodes/s, i.e.
  ``D x turns x tokens per turn`` sampled tokens/s, and ``servers = ceil(headroom x that /
  server tokens/s)``;
* a saturated server shares its throughput over its ``maxBatch`` sequences, so one turn takes
  ``tokens per turn x maxBatch / server tokens/s`` and an episode ``turns x (turn + env step)``;
  keeping ``D x episode`` episodes in flight (Little's law) takes ``ceil(headroom x D x episode /
  concurrency)`` actors;
* the rollout-to-trainer ratio is the servers' accelerator chips over the learner's.
"""

from __future__ import annotations

import math

from stoker.actor_count import replicas_text
from stoker.spec import RLJobSpec, RolloutSpec
from stoker.spec_rollout import rollout_chips
from stoker.tpu import TopologyError, slice_shape


def chips_per_server(rollout: RolloutSpec) -> int:
    """Accelerator chips one server holds (GPUs or TPU chips; 0 on the CPU)."""
    return rollout_chips(rollout) or 0


def learner_chips(spec: RLJobSpec) -> int:
    learner = spec.learner
    if learner.accelerator == "cpu":
        return 0
    try:
        return slice_shape(learner.accelerator, learner.topology).chips * learner.num_slices
    except TopologyError:
        return 0


def size_rollout(
    *,
    tokens_per_turn: float,
    turns: float,
    env_step_seconds: float,
    server_tokens_per_second: float,
    step_seconds: float,
    episodes_per_step: int,
    concurrency: int,
    max_batch: int,
    headroom: float,
) -> dict[str, float]:
    """The module docstring's arithmetic; every intermediate figure, for printing."""
    if server_tokens_per_second <= 0 or step_seconds <= 0:
        raise ValueError("server tokens/s and the learner's step time must be > 0")
    demand = episodes_per_step / step_seconds
    tokens_per_episode = turns * tokens_per_turn
    token_demand = demand * tokens_per_episode
    servers = max(1, math.ceil(headroom * token_demand / server_tokens_per_second))
    turn_seconds = tokens_per_turn * max_batch / server_tokens_per_second
    episode_seconds = turns * (turn_seconds + env_step_seconds)
    actors = max(1, math.ceil(headroom * demand * episode_seconds / concurrency))
    return {
        "demand": demand,
        "tokens_per_episode": tokens_per_episode,
        "token_demand": token_demand,
        "servers": float(servers),
        "turn_seconds": turn_seconds,
        "episode_seconds": episode_seconds,
        "in_flight": demand * episode_seconds,
        "actors": float(actors),
    }


def render_rollout(
    spec: RLJobSpec, *, tokens_per_turn: float, turns: float, env_step_seconds: float, server_tokens_per_second: float,
    step_seconds: float, headroom: float, source: str,
) -> list[str]:
    """The rollout section of the audit: figures, arithmetic, recommendation."""
    rollout = spec.rollout or RolloutSpec()
    per_step = spec.learner.batch_groups * spec.buffer.group_size
    concurrency = spec.actors.concurrency
    s = size_rollout(
        tokens_per_turn=tokens_per_turn, turns=turns, env_step_seconds=env_step_seconds,
        server_tokens_per_second=server_tokens_per_second, step_seconds=step_seconds, episodes_per_step=per_step,
        concurrency=concurrency, max_batch=rollout.max_batch, headroom=headroom,
    )
    servers, actors = int(s["servers"]), int(s["actors"])
    lines = [
        "",
        f"rollout tier (a server samples {server_tokens_per_second:.0f} tokens/s, {source})",
        f"  tokens per episode = turns x sampled tokens per turn = {turns:.1f} x {tokens_per_turn:.1f} "
        f"= {s['tokens_per_episode']:.0f} tokens",
        f"  learner needs      = {per_step} episodes / {step_seconds:.3f} s x {s['tokens_per_episode']:.0f} tokens "
        f"= {s['token_demand']:.0f} tokens/s",
        f"  rollout servers    = ceil({headroom} x {s['token_demand']:.0f} / {server_tokens_per_second:.0f}) = {servers}",
        f"  one turn           = tokens per turn x rollout.maxBatch / server tokens/s = {tokens_per_turn:.1f} x "
        f"{rollout.max_batch} / {server_tokens_per_second:.0f} = {s['turn_seconds']:.3f} s (a saturated server)",
        f"  episode time       = turns x (turn + env step) = {turns:.1f} x ({s['turn_seconds']:.3f} + "
        f"{env_step_seconds:.3f}) s = {s['episode_seconds']:.2f} s",
        f"  actors             = ceil({headroom} x {s['demand']:.1f} episodes/s x {s['episode_seconds']:.2f} s / "
        f"concurrency {concurrency}) = {actors}",
    ]
    server_chips, trainer_chips = chips_per_server(rollout), learner_chips(spec)
    if server_chips and trainer_chips:
        ratio = servers * server_chips / trainer_chips
        lines.append(
            f"  rollout : trainer  = {servers} servers x {server_chips} chips : {trainer_chips} learner chips "
            f"= {ratio:.2f} rollout chips per trainer chip"
        )
    else:
        lines.append(f"  rollout : trainer  = {servers} servers per learner")
    now = f"now {rollout.replicas}, maxReplicas {rollout.max_replicas}" if spec.rollout is not None else "the job has no spec.rollout yet"
    lines.append(
        f"recommendation: rollout.replicas >= {servers} ({now}) "
        f"and actors.replicas >= {actors} with actors.concurrency = {concurrency} (now {replicas_text(spec)})"
    )
    if spec.rollout is not None and servers > rollout.max_replicas:
        lines.append(f"warning: rollout.maxReplicas {rollout.max_replicas} is below the {servers} servers the learner needs")
    return lines
