"""Assemble a real actor from a manifest: JAX sampler, weight channel, buffer client, sandboxes.

Also the in-process entry points the local runner uses (``make_policy``, ``environment_factory``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from stoker import chips
from stoker.compilation_cache import cache_dir_for, enable_compilation_cache
from stoker.cpu_threads import cpu_share, start_jax_cpu
from stoker.actor.diagnostics import LoadReading
from stoker.actor.environments import EnvironmentProblem
from stoker.actor.evaluation import EvalOutcome, GreedyPolicy
from stoker.actor.pods import pod_factory
from stoker.actor.policy import BatchedSampler, call_limits
from stoker.actor.process_sandbox import process_factory
from stoker.actor.rewards import RewardedFactory
from stoker.actor.runner import Actor, ActorStats, BufferUnavailable, Grant
from stoker.actor.sandbox import EnvironmentFactory, close_factory, inline_factory
from stoker.actor.settings import ActorSettings
from stoker.buffer.client import BufferClient, BufferUnavailableError, InvalidTrajectoryError
from stoker.rollout.client import RemotePolicy
from stoker.conversation.tokenization import text_interface
from stoker.spec import RLJob
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.actor")

# Sampler calls are padded to at least this many rows. Each distinct batch size is one more program
# to compile per prefill bucket, but padding costs: a call of 8 rows costs ~1.5x one of 4, and at
# 0.5 s environment steps most calls carry fewer than 4 (benchmarks/README.md, actor sampling).
MIN_SAMPLER_BATCH = 4
# How long one Acquire may wait at the buffer for credit (a long poll). Short, so that a stopping
# actor's last call ends soon; long enough that a waiting actor costs the buffer ~1 call a second.
ADMISSION_WAIT_SECONDS = 1.0


class ActorSetupError(Exception):
    """Something the user configured that keeps the actor from starting."""


def environment_factory(settings: ActorSettings) -> EnvironmentFactory:
    """One fresh environment per episode, in the sandbox kind the spec asks for, with its reward plugins."""
    factory = _sandbox_factory(settings)
    if settings.reward_terms or settings.environment_reward_weight != 1.0:
        return RewardedFactory(factory, list(settings.reward_terms), settings.environment_reward_weight)
    return factory


def _sandbox_factory(settings: ActorSettings) -> EnvironmentFactory:
    if settings.sandbox_kind == "inline":
        return inline_factory(settings.sandbox)
    if settings.sandbox_kind == "pod":
        assert settings.pod is not None
        return pod_factory(settings.sandbox, settings.pod)
    return process_factory(settings.sandbox)


def make_sampler(settings: ActorSettings, dtype: str = "float32", mesh: Any = None, cpu_threads: int | None = None) -> Any:
    """The JAX sampler with the job's initial weights (checkpoint, or the learner's version-0 init),
    over ``mesh`` when given (a colocated learner's chips: rollout/mesh.py). ``cpu_threads``: the
    size of XLA's CPU pools when this call starts JAX (``stoker.cpu_threads``; None: XLA's own)."""
    try:
        chips.check_free("stoker actor's sampler")  # a TPU the learner holds: say so, not libtpu's lockfile
    except chips.ChipHeld as exc:
        raise ActorSetupError(str(exc)) from None
    start_jax_cpu(cpu_threads)
    # Here, not at the top: the model and the sampler import JAX, which an actor sampling from a
    # rollout server never loads (the actor stays import-light until a sampler is built).
    from stoker.model.hf import CheckpointError, dtype_from_name, read_config, read_weights
    from stoker.rollout.sampling import Sampler

    # The sampler compiles one program per call shape; the next actor on the host, or this one
    # restarted, then reads them back instead of compiling again.
    enable_compilation_cache(cache_dir_for(settings.compilation_cache_dir))
    config, params = settings.model, None
    try:
        if settings.checkpoint:
            config, params = read_config(settings.checkpoint), read_weights(settings.checkpoint)
        # Inside the try: loading the weights into the model is where a missing or misshapen
        # tensor shows, with the same message the learner gives.
        return Sampler(
            config,
            settings.sampling,
            seed=settings.seed,
            buckets=settings.sampler_buckets,
            params=params,
            dtype=dtype_from_name(dtype),
            allowed_token_ids=settings.allowed_token_ids,
            min_batch=min(settings.concurrency, MIN_SAMPLER_BATCH),
            session_rows=conversation_rows(settings, config, dtype),
            pin_sessions=settings.weight_sync == "between-episodes",
            mesh=mesh,
        )
    except CheckpointError as exc:
        raise ActorSetupError(f"spec.model.checkpoint: {exc}") from None


def conversation_rows(settings: ActorSettings, config: Any, dtype: str) -> int:
    """Rows of the sampler's conversation cache: one per concurrent episode, as many as
    ``conversationCacheMiB`` holds (fewer rows only means some turns prefill their whole
    conversation again)."""
    # Here, not at the top: JAX, as in make_sampler.
    from stoker.model.hf import dtype_from_name
    from stoker.rollout.sampling import session_row_bytes

    per_row = session_row_bytes(config, settings.sampler_buckets, dtype_from_name(dtype))
    if per_row == 0:
        return 0
    rows = min(settings.concurrency, settings.conversation_cache_mib * 2**20 // per_row)
    if 0 < rows < settings.concurrency:
        log.warning(
            "conversationCacheMiB %d holds %d of %d concurrent conversations (%.1f MiB each)",
            settings.conversation_cache_mib, rows, settings.concurrency, per_row / 2**20,
        )
    return rows


def make_policy(
    settings: ActorSettings, dtype: str = "float32", mesh: Any = None, cpu_threads: int | None = None
) -> BatchedSampler:
    sampler = make_sampler(settings, dtype, mesh, cpu_threads)
    return BatchedSampler(sampler, *call_limits(sampler.platform))


async def warm_up(policy: BatchedSampler, settings: ActorSettings) -> None:
    """Compile every sampler program before the first episode (``stoker.rollout.warmup``). Each
    actor starts at the shape its index names, so actors starting together compile different
    ones and read the rest from the shared compilation cache."""
    index = re.search(r"\d+$", settings.actor_id)
    started = time.monotonic()
    programs = await asyncio.to_thread(policy.warm_up, settings.concurrency, int(index.group()) if index else 0)
    log.info("actor %s: %d sampler programs ready in %.1f s", settings.actor_id, programs, time.monotonic() - started)


class GrpcBuffer:
    """``BufferPort`` over ``stoker.buffer.client.BufferClient`` (its blocking calls run in threads).

    The client already retries transient failures up to its deadline; what still fails becomes
    ``BufferUnavailable`` (the actor retries later). Trajectories the buffer refuses as invalid are
    logged and counted, not retried: sending them again cannot succeed.
    """

    def __init__(self, client: Any, admission_wait: float = ADMISSION_WAIT_SECONDS):
        self.client = client
        self.admission_wait = admission_wait
        self.invalid = 0
        self._stream: Any = None  # the client's PutStream, opened on the first Put

    async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
        figures = None if load is None else buffer_pb2.ActorLoad(**dataclasses.asdict(load))
        wait = self.admission_wait
        credit = await self._call(functools.partial(self.client.acquire, groups, wait=wait, load=figures))
        # After a long poll, ask again at once: the buffer answers the moment credit frees up.
        retry = 0.0 if wait > 0 else float(credit.retry_after_seconds)
        return Grant(int(credit.granted), retry, int(credit.policy_version))

    async def put(self, episodes: list[Episode]) -> None:
        # On the client's PutStream: the group's episodes go out without a round trip each, and
        # the Put is answered once every one of them is durable.
        if self._stream is None:
            self._stream = self.client.put_stream()
        stream = self._stream
        try:
            acks = await asyncio.to_thread(lambda: [stream.put(episode) for episode in episodes])
            outcomes = await asyncio.gather(*(asyncio.wrap_future(ack) for ack in acks), return_exceptions=True)
        except BufferUnavailableError as exc:
            self._stream = None  # that stream gave up; the next Put opens a new one
            raise BufferUnavailable(str(exc)) from None
        for outcome in outcomes:
            if isinstance(outcome, InvalidTrajectoryError):
                self.invalid += len(outcome.rejections)
                log.error("buffer refused trajectories: %s", outcome)
            elif isinstance(outcome, BufferUnavailableError):
                self._stream = None
                raise BufferUnavailable(str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome

    async def release(self, groups: int) -> None:
        await self._call(self.client.release, groups)

    async def report_eval(self, outcome: EvalOutcome, report_id: str) -> None:
        try:
            await self._call(
                lambda: self.client.report_eval(
                    report_id, outcome.version, episodes=outcome.episodes, reward_sum=outcome.reward_sum,
                    success_sum=outcome.success_sum, failed=outcome.failed,
                )
            )
        except grpc.RpcError as exc:  # refused (not unavailable): sending it again cannot succeed
            log.error("buffer refused evaluation report %s: %s: %s", report_id, exc.code().name, exc.details())

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except BufferUnavailableError as exc:
            raise BufferUnavailable(str(exc)) from None


async def build_and_run(
    job: RLJob,
    *,
    actor_id: str,
    buffer_address: str,
    token: str | None,
    weights: str | None,
    max_groups: int | None,
    job_name: str,
    install_signals: Callable[[Callable[[], None]], None] | None = None,
    rollout_address: str | None = None,
    stats_path: Path | None = None,
) -> ActorStats:
    spec = job.spec
    try:
        settings = ActorSettings.from_spec(
            spec, actor_id=actor_id, job=job_name, max_groups=max_groups, rollout_address=rollout_address
        )
    except EnvironmentProblem as exc:  # a task file, an evaluation task: the user's to fix
        raise ActorSetupError(f"spec.environment: {exc}") from None
    interface = text_interface(spec)
    policy: BatchedSampler | RemotePolicy
    if settings.rollout_address:
        # The rollout server holds the model and follows the learner's weights: no sampler here.
        policy = RemotePolicy(
            settings.rollout_address, actor_id=actor_id, pin_weights=settings.weight_sync == "between-episodes"
        )
        source, loader = None, None
    else:
        # Here, not at the top: the weight channel imports Flax, which an actor using a rollout
        # server never needs.
        from stoker.weights.channel import make_weight_source

        try:
            threads = cpu_share()  # this actor's share of the host, for XLA's CPU pools
        except ValueError as exc:
            raise ActorSetupError(str(exc)) from None
        policy = await asyncio.to_thread(make_policy, settings, spec.model.dtype, None, threads)
        source, loader = (make_weight_source(weights, token) if weights else None), policy
        await warm_up(policy, settings)
    buffer = GrpcBuffer(BufferClient(buffer_address, token=token, client_id=actor_id))
    if settings.evaluation is not None:
        try:
            GreedyPolicy(policy)
        except TypeError as exc:  # e.g. a generation server without greedy decoding
            raise ActorSetupError(f"spec.environment.evalTasks: {exc}") from None
    factory = environment_factory(settings)
    actor = Actor(settings, policy, interface, factory, buffer, weights=source, loader=loader, stats_path=stats_path)
    if install_signals is not None:
        install_signals(actor.stop)
    log.info(
        "actor %s: %s, %d tasks, groups of %d, %d concurrent episodes, %s sandboxes, weight sync %s",
        actor_id,
        settings.environment,
        len(settings.tasks),
        settings.group_size,
        settings.concurrency,
        settings.sandbox_kind,
        settings.weight_sync,
    )
    if settings.rollout_address:
        log.info("actor %s samples from the rollout server at %s", actor_id, settings.rollout_address)
    try:
        return await actor.run()
    finally:
        # Closing the channel ends a Put still retrying in a worker thread (one abandoned while
        # stopping), which would otherwise hold the process at exit for the client's deadline.
        buffer.client.close()
        await policy.close()
        await close_factory(factory)

