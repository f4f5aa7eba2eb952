"""``stoker audit FILE``: measure this machine, then size the actor pool that keeps the learner fed.

Measures, with the job's own model, environment, sandboxes and learner:

1. environment step latency (injected delay included) and episode length, from real episodes;
2. the sampler's latency per model turn at the actor's batch size (``actors.concurrency``);
3. the learner's train-step time on a batch of ``batchGroups x groupSize`` of those episodes.

and prints the arithmetic: an episode takes ``turns x (sample turn + env step)`` seconds, an actor
running ``concurrency`` episodes at once delivers ``concurrency / episode_seconds`` episodes/s, and
the learner consumes ``batchGroups x groupSize / step_seconds`` episodes/s. Enough actors make the
supply at least the demand (with headroom for variance).

One limit no number of actors lifts comes from ``buffer.maxStaleness`` (S): while one episode
runs, a learner at full speed makes ``V = episode_seconds / step_seconds`` updates, and admission
keeps data within S versions by letting at most ``(S + 1) x batchGroups x groupSize`` episodes be
outstanding -- ``(S + 1) / V`` of the ``demand x episode_seconds`` the learner needs in flight
(Little's law). With ``V > S + 1`` the learner waits for data whatever the pool; a larger
``batchGroups`` makes each step longer, so the same episode spans fewer versions.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from stoker.actor_count import replicas_text
from stoker.conversation.tokenization import text_interface
from stoker.manifest import load_job
from stoker.sizing.audit_rollout import render_rollout
from stoker.spec import RLJobSpec
from stoker.v1 import rollout_pb2, rollout_pb2_grpc

# Supply above demand so a slow episode or a compile does not starve the learner.
HEADROOM = 1.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="RLJob manifest")
    parser.add_argument("--groups", type=int, default=2, help="episode groups to measure (default 2)")
    parser.add_argument("--train-steps", type=int, default=3, help="timed learner steps after a warm-up (default 3)")
    rollout = parser.add_mutually_exclusive_group()
    rollout.add_argument("--rollout-tokens-per-second", type=float, metavar="N",
                         help="size a rollout tier for servers sampling N tokens/s each")
    rollout.add_argument("--rollout-address", metavar="HOST:PORT",
                         help="size a rollout tier from a running `stoker rollout` server's Stats (tokens/s under load)")
    parser.add_argument("--learner-step-seconds", type=float, metavar="S",
                        help="the learner's step time on its own accelerator, instead of the one measured here")


@dataclass
class Audit:
    env_step_seconds: list[float]
    turns: list[int]
    tokens: list[int]
    sample_turn_seconds: float  # one model turn at the actor's batch size
    sampler_batch: int
    train_step_seconds: float
    compile_seconds: float
    sampled: list[int] = field(default_factory=list)
    """Sampled (loss-mask 1) tokens per episode."""

    @property
    def tokens_per_turn(self) -> float:
        turns = sum(self.turns)
        return sum(self.sampled) / turns if turns and self.sampled else 0.0

    def sizing(self, spec: RLJobSpec) -> dict[str, float]:
        env_step = statistics.mean(self.env_step_seconds) if self.env_step_seconds else 0.0
        turns = statistics.mean(self.turns) if self.turns else float(spec.environment.max_turns)
        episode_seconds = turns * (self.sample_turn_seconds + env_step)
        concurrency = spec.actors.concurrency
        per_actor = concurrency / episode_seconds if episode_seconds > 0 else math.inf
        demand = spec.learner.batch_groups * spec.buffer.group_size / self.train_step_seconds
        actors = max(1, math.ceil(HEADROOM * demand / per_actor)) if per_actor < math.inf else 1
        # Concurrency that hides the environment: while one batch of turns samples, the others wait
        # on their sandboxes; beyond this the sampler itself is the bottleneck.
        hide_env = max(1, math.ceil(concurrency * (1 + env_step / max(self.sample_turn_seconds, 1e-9))))
        stale = spec.buffer.max_staleness
        versions = episode_seconds / self.train_step_seconds  # updates while one episode runs
        # docs/sizing.md's bound, maxStaleness >= ceil(V) + 1, met by a larger batch instead -- if the
        # step time grows with the batch, as it does once the batch fills the device.
        batch_groups_to_feed = math.ceil(spec.learner.batch_groups * versions / (stale - 1)) if stale > 1 else 0
        return {
            "env_step": env_step,
            "turns": turns,
            "episode_seconds": episode_seconds,
            "per_actor": per_actor,
            "demand": demand,
            "actors": float(actors),
            "concurrency_to_hide_env": float(hide_env),
            "in_flight": demand * episode_seconds,
            "admission": float((stale + 1) * spec.learner.batch_groups * spec.buffer.group_size),
            "versions_per_episode": versions,
            "fed_fraction": min(1.0, (stale + 1) / versions) if versions > 0 else 1.0,
            "batch_groups_to_feed": float(batch_groups_to_feed),
            # With between-turns, each swap sends every running conversation back to a full prefill.
            "swaps_per_episode": episode_seconds / spec.actors.weight_poll_seconds if swaps_reprefill(spec) else 0.0,
        }


@dataclass
class TimedEnvironment:
    """An episode environment that records how long each step takes."""

    inner: Any
    step_seconds: list[float]

    async def reset(self, task_id: str, seed: int) -> Any:
        return await self.inner.reset(task_id, seed)

    async def step(self, action: str) -> Any:
        started = time.perf_counter()
        try:
            return await self.inner.step(action)
        finally:
            self.step_seconds.append(time.perf_counter() - started)

    async def close(self) -> None:
        await self.inner.close()


async def _episodes(spec: RLJobSpec, groups: int) -> tuple[list[Any], list[float], float, int]:
    # The actor's episode machinery, sampler and sandboxes: loaded for a measurement only, not
    # when stoker.cli imports this module to build `stoker audit --help`.
    from stoker.actor.episode import run_group
    from stoker.actor.sandbox import close_factory
    from stoker.actor.settings import ActorSettings
    from stoker.actor.wiring import environment_factory, make_policy

    actor = ActorSettings.from_spec(spec, actor_id="audit")
    interface = text_interface(spec)
    policy = make_policy(actor)
    base = environment_factory(actor)
    step_seconds: list[float] = []

    async def timed_factory() -> Any:
        return TimedEnvironment(await base(), step_seconds)

    episodes: list[Any] = []
    try:
        # Warm-up group: pays the sampler's compilations, not counted.
        await run_group(policy, base, interface, actor.tasks[0], actor.group_size, limits=actor.limits, seed=0)
        for index in range(groups):
            task = actor.tasks[index % len(actor.tasks)]
            episodes += await run_group(
                policy, timed_factory, interface, task, actor.group_size, limits=actor.limits, seed=index + 1
            )
        # Sampler latency at the actor's batch: one turn of `concurrency` conversations, each
        # halfway through an episode, in calls of at most the actor's rows per call. With the
        # conversation cache the earlier turns are cached as they would be, so only the turn's own
        # tokens are prefilled.
        prompts = [list(e.token_ids[: max(1, e.num_tokens // 2)]) for e in episodes[: actor.concurrency]]
        prompts += [prompts[0]] * (actor.concurrency - len(prompts))
        turn_tokens = max(1, round(sum(e.num_tokens for e in episodes) / max(1, sum(e.num_turns for e in episodes))))
        sampler = policy.sampler
        new_tokens = actor.sampling.max_new_tokens

        def turn(turn_prompts: list[list[int]], sessions: list[Any] | None) -> None:
            rows = policy.max_batch if sessions is None else policy.max_session_batch
            for first in range(0, len(turn_prompts), rows):
                part = None if sessions is None else sessions[first : first + rows]
                sampler.generate(turn_prompts[first : first + rows], max_new_tokens=new_tokens, sessions=part)

        def one_turn(round_: int) -> float:
            """Seconds of one timed turn (with sessions, after caching the turns before it)."""
            sessions = None
            if sampler.keeps_sessions:
                sessions = [(round_, i) for i in range(len(prompts))]
                turn([p[: max(1, len(p) - turn_tokens)] for p in prompts], sessions)
            started = time.perf_counter()
            turn(prompts, sessions)
            seconds = time.perf_counter() - started
            for session in sessions or ():
                sampler.end_session(session)
            return seconds

        one_turn(-1)  # compiles this shape
        repeats = 5
        sample_turn = sum(one_turn(round_) for round_ in range(repeats)) / repeats
    finally:
        await close_factory(base)
        await policy.close()
    return episodes, step_seconds, sample_turn, len(prompts)


def measure(spec: RLJobSpec, groups: int, train_steps: int) -> Audit:
    # The learner (JAX): loaded for a measurement only, as the actor's code above.
    from stoker.learner.batches import Group
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings

    episodes, step_seconds, sample_turn, batch = asyncio.run(_episodes(spec, groups))
    # The audit times an update's compute, which depends only on the episodes' shapes: spread the
    # rewards so that no group is left out for lack of signal, and let the same episodes be
    # trained on again as versions pass.
    settings = LearnerSettings.from_spec(spec, checkpoint_dir=None)
    learner = Learner(settings, resume=False)
    size = spec.buffer.group_size
    for index, episode in enumerate(episodes):
        episode.reward = float(index % size)
    groups_of = [episodes[i : i + size] for i in range(0, len(episodes), size)]
    batch_groups = [Group(groups_of[i % len(groups_of)]) for i in range(spec.learner.batch_groups)]
    learner.train_on(batch_groups, max_staleness=1 << 30)  # compiles
    compile_seconds = learner.compiles.seconds
    times = []
    for _ in range(train_steps):
        started = time.perf_counter()
        learner.train_on(batch_groups, max_staleness=1 << 30)
        times.append(time.perf_counter() - started)
    learner.close()
    return Audit(
        env_step_seconds=step_seconds,
        turns=[e.num_turns for e in episodes],
        tokens=[e.num_tokens for e in episodes],
        sample_turn_seconds=sample_turn,
        sampler_batch=batch,
        train_step_seconds=statistics.median(times),
        compile_seconds=compile_seconds,
        sampled=[int(sum(e.loss_mask)) for e in episodes],
    )


def render(audit: Audit, spec: RLJobSpec, *, rollout_tokens_per_second: float | None = None, rollout_source: str = "",
           step_seconds: float | None = None) -> str:
    if step_seconds is not None:
        audit = replace(audit, train_step_seconds=step_seconds)
    s = audit.sizing(spec)
    p90 = sorted(audit.env_step_seconds)[int(0.9 * (len(audit.env_step_seconds) - 1))] if audit.env_step_seconds else 0.0
    concurrency = spec.actors.concurrency
    per_step = spec.learner.batch_groups * spec.buffer.group_size
    lines = [
        "measured on this machine",
        f"  environment step      {s['env_step'] * 1000:8.1f} ms mean, {p90 * 1000:.1f} ms p90 "
        f"({len(audit.env_step_seconds)} steps, injected latency included)",
        f"  episode length        {s['turns']:8.1f} turns, {statistics.mean(audit.tokens):.0f} tokens mean",
        f"  sampler, one turn     {audit.sample_turn_seconds * 1000:8.1f} ms at batch {audit.sampler_batch}",
        f"  learner step          {audit.train_step_seconds * 1000:8.1f} ms for {per_step} episodes "
        f"(after {audit.compile_seconds:.1f} s of compilation)",
        "",
        "arithmetic",
        f"  episode time   = turns x (sample turn + env step) = {s['turns']:.1f} x "
        f"({audit.sample_turn_seconds:.3f} + {s['env_step']:.3f}) s = {s['episode_seconds']:.2f} s",
        f"  one actor      = concurrency / episode time = {concurrency} / {s['episode_seconds']:.2f} s "
        f"= {s['per_actor']:.1f} episodes/s",
        f"  learner needs  = batchGroups x groupSize / step time = {per_step} / {audit.train_step_seconds:.3f} s "
        f"= {s['demand']:.1f} episodes/s",
        f"  actors         = ceil({HEADROOM} x {s['demand']:.1f} / {s['per_actor']:.1f}) = {int(s['actors'])}",
        "",
        f"  in flight      = learner needs x episode time = {s['demand']:.1f} x {s['episode_seconds']:.2f} s "
        f"= {s['in_flight']:.0f} episodes (Little's law)",
        f"  admission      = (maxStaleness + 1) x batchGroups x groupSize = ({spec.buffer.max_staleness} + 1) x "
        f"{per_step} = {s['admission']:.0f} episodes outstanding at most",
        f"  staleness      = episode time / learner step = {s['episode_seconds']:.2f} / "
        f"{audit.train_step_seconds:.3f} s = {s['versions_per_episode']:.1f} updates while one episode runs",
        "",
        f"recommendation: actors.replicas >= {int(s['actors'])} with actors.concurrency = {concurrency}"
        f" (now {replicas_text(spec)}); concurrency up to {int(s['concurrency_to_hide_env'])} per actor hides the"
        " environment's latency behind sampling, fewer actors then suffice while the actor's CPU keeps up.",
    ]
    lines += [f"warning: {w}" for w in admission_warnings(s, spec)]
    lines += [f"note: {n}" for n in swap_notes(s, spec)]
    lines += [f"note: {n}" for n in order_notes(s, spec)]
    if rollout_tokens_per_second is not None:
        lines += render_rollout(
            spec, tokens_per_turn=audit.tokens_per_turn, turns=s["turns"], env_step_seconds=s["env_step"],
            server_tokens_per_second=rollout_tokens_per_second, step_seconds=audit.train_step_seconds,
            headroom=HEADROOM, source=rollout_source,
        )
    elif spec.rollout is not None:
        lines.append("note: the job has a rollout tier; pass --rollout-tokens-per-second N (or --rollout-address "
                     "HOST:PORT of a server under load) to size its servers and actors")
    return "\n".join(lines)


# From this many updates per episode on, a backlog of a few batches is a sizeable share of what
# the learner's data already trails by (the utilisation job: 16 updates per episode, ~6 more waiting).
MANY_VERSIONS_PER_EPISODE = 8


def order_notes(sizing: dict[str, float], spec: RLJobSpec) -> list[str]:
    """Stale data and a FIFO queue: every complete group waiting adds to each batch's staleness."""
    if sizing["versions_per_episode"] < MANY_VERSIONS_PER_EPISODE or spec.buffer.sample_order == "newest-first":
        return []
    return [
        f"with {sizing['versions_per_episode']:.1f} updates per episode the learner trains on old data already, and "
        "buffer.sampleOrder: oldest-first adds every complete group waiting ahead of a batch to its staleness; "
        "newest-first trains on the groups that completed last and lets a backlog age out at maxStaleness "
        "(docs/sizing.md)."
    ]


def swaps_reprefill(spec: RLJobSpec) -> bool:
    """Whether a weight swap makes running conversations prefill their history again."""
    return spec.actors.weight_sync == "between-turns" and spec.actors.conversation_cache_mib > 0


def swap_notes(sizing: dict[str, float], spec: RLJobSpec) -> list[str]:
    """Slow turns and frequent swaps: most turns re-read the whole conversation (docs/sizing.md)."""
    # A third of an episode, in 0.5 s steps: with 4.5 s episodes 1.5 s beat 2.5 s and 1 s
    # (benchmarks/README.md, utilisation, session 9).
    suggested = max(0.5, round(sizing["episode_seconds"] / 3 * 2) / 2)
    if not sizing["swaps_per_episode"] or sizing["turns"] <= 2 or spec.actors.weight_poll_seconds >= suggested:
        return []
    return [
        f"an episode sees episode time / actors.weightPollSeconds = {sizing['episode_seconds']:.2f} / "
        f"{spec.actors.weight_poll_seconds:g} s = {sizing['swaps_per_episode']:.1f} weight swaps, and after each one every running "
        "conversation prefills its whole history again, so the conversation cache saves little; "
        f"actors.weightPollSeconds: {suggested:g} (about a third of an episode) keeps most turns cached for "
        "weights that trail the learner by that much longer (docs/sizing.md)."
    ]


def admission_warnings(sizing: dict[str, float], spec: RLJobSpec) -> list[str]:
    """The limit of ``buffer.maxStaleness`` that more actors cannot lift (module docstring)."""
    stale = spec.buffer.max_staleness
    if sizing["fed_fraction"] >= 1.0 or stale == 0:  # 0: on-policy, waiting for each batch by design
        return []
    batch = f"learner.batchGroups to >= {int(sizing['batch_groups_to_feed'])} (longer steps, fewer versions per episode) or "
    return [
        f"an episode spans {sizing['versions_per_episode']:.1f} learner updates but admission keeps data within "
        f"buffer.maxStaleness = {stale}: the learner can be busy at most {sizing['fed_fraction']:.0%} of the time, "
        f"whatever the actor pool. Raise {batch if stale > 1 else ''}buffer.maxStaleness to >= "
        f"{math.ceil(sizing['versions_per_episode']) + 1} (staler data; docs/sizing.md)."
    ]


def server_tokens_per_second(address: str, timeout: float = 5.0) -> float:
    """A running rollout server's sampled tokens/s, from its Stats; ``ValueError`` saying why not."""
    with grpc.insecure_channel(address) as channel:
        try:
            stats = rollout_pb2_grpc.RolloutStub(channel).Stats(rollout_pb2.RolloutStatsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise ValueError(f"the rollout server at {address} did not answer Stats: {exc.code().name}: {exc.details()}") from None
    if stats.tokens_per_second <= 0:
        raise ValueError(f"the rollout server at {address} reports 0 tokens/s: read it while actors load it, "
                         "or pass --rollout-tokens-per-second")
    return float(stats.tokens_per_second)


def main(args: argparse.Namespace) -> int:
    job = load_job(args.file)
    if args.groups < 1 or args.train_steps < 1:
        print("stoker audit: --groups and --train-steps must be >= 1")
        return 2
    for flag in ("rollout_tokens_per_second", "learner_step_seconds"):
        if getattr(args, flag, None) is not None and getattr(args, flag) <= 0:
            print(f"stoker audit: --{flag.replace('_', '-')} must be > 0")
            return 2
    tokens_per_second, source = getattr(args, "rollout_tokens_per_second", None), "as given"
    if getattr(args, "rollout_address", None):
        try:
            tokens_per_second, source = server_tokens_per_second(args.rollout_address), f"read from {args.rollout_address}"
        except ValueError as exc:
            print(f"stoker audit: {exc}")
            return 2
    audit = measure(job.spec, args.groups, args.train_steps)
    print(render(audit, job.spec, rollout_tokens_per_second=tokens_per_second, rollout_source=source,
                 step_seconds=getattr(args, "learner_step_seconds", None)))
    return 0
