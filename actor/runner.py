"""The actor's main loop: admission, episode groups, submission and weight sync.

Groups overlap: as soon as an episode slot is free the next group starts, its episodes taking slots
as they free up (there is no barrier between episodes, and a group's straggler holds only its own
slot); at most ``concurrency`` episodes run at once. Before starting a group
the actor asks the buffer for admission credit and waits (for the buffer's hint) while it is
refused. A finished group is submitted whole, failed and timed-out episodes included (the buffer
masks or discards them by policy), so no group is ever silently lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from stoker.actor.diagnostics import ActorDiagnostics, LoadMeter, LoadReading, StatsFile
from stoker.actor.episode import EpisodeSlots, run_group, summarize
from stoker.actor.evaluation import EvalOutcome, play_round, round_due
from stoker.conversation.policy import Policy
from stoker.actor.sandbox import EnvironmentFactory
from stoker.actor.settings import ActorSettings
from stoker.actor.weight_sync import LoadsWeights, WeightSource, WeightSync
from stoker.conversation.tokenization import TextInterface
from stoker.trajectory import Episode

log = logging.getLogger("stoker.actor")

T = TypeVar("T")

MAX_RETRY_WAIT_SECONDS = 5.0
# Once stopping, how long a finished group may still wait for an unreachable buffer.
STOP_SUBMIT_SECONDS = 5.0


@dataclass
class Grant:
    granted: int
    retry_after_seconds: float = 0.5  # 0: ask again at once (the port waited for credit already)
    policy_version: int = 0  # the buffer's version when it answered


class BufferUnavailable(Exception):
    """The buffer cannot take the call right now (down, full); retrying later may succeed."""


class BufferPort(Protocol):
    """The buffer as the actor sees it (async); see ``GrpcBuffer`` for the real one."""

    async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
        """Credit for ``groups`` groups; ``load`` is what the actor measured of itself (the
        buffer shows it in Stats for stoker.bottleneck)."""

    async def put(self, episodes: list[Episode]) -> None: ...

    async def release(self, groups: int) -> None: ...

    async def report_eval(self, outcome: EvalOutcome, report_id: str) -> None:
        """An evaluation round's sums (``ReportEval``); its episodes are never Put."""


@dataclass
class ActorStats:
    groups_started: int = 0
    groups_submitted: int = 0
    episodes: int = 0
    admission_refusals: int = 0
    weight_updates: int = 0
    submit_retries: int = 0
    abandoned_groups: int = 0  # finished while stopping with the buffer unreachable: not submitted
    eval_rounds: list[EvalOutcome] = field(default_factory=list)  # played and reported, oldest first
    recent: list[Episode] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    diagnostics: ActorDiagnostics = field(default_factory=ActorDiagnostics)

    def record(self, episodes: list[Episode]) -> list[str]:
        """Count a submitted group; returns the failure reasons its episodes showed first."""
        self.groups_submitted += 1
        self.episodes += len(episodes)
        self.recent = (self.recent + episodes)[-256:]
        return self.diagnostics.add(episodes)


def task_cycle(tasks: Sequence[str], rng: random.Random) -> Callable[[], str]:
    """Every task once per cycle, each cycle in a fresh random order (stratified sampling).

    Uniform sampling can leave a task out of many consecutive batches; meanwhile the other tasks'
    gradients may push the shared policy somewhere that task punishes, until it has no reward
    variance left to recover from. Cycling keeps every task in every few batches."""
    order: list[str] = []

    def pick() -> str:
        if not order:
            order.extend(tasks)
            rng.shuffle(order)
        return order.pop()

    return pick


class Actor:
    """Runs episode groups until ``max_groups`` are submitted or ``stop()`` is called."""

    def __init__(
        self,
        settings: ActorSettings,
        policy: Policy,
        interface: TextInterface,
        env_factory: EnvironmentFactory,
        buffer: BufferPort,
        *,
        weights: WeightSource | None = None,
        loader: LoadsWeights | None = None,
        task_picker: Callable[[], str] | None = None,
        stats_path: Path | None = None,
    ):
        self.settings = settings
        self.stats_file = StatsFile(stats_path) if stats_path is not None else None  # stoker.actor.diagnostics
        self.policy = policy
        self.interface = interface
        self.env_factory = env_factory
        self.buffer = buffer
        self.sync: WeightSync | None = None
        if weights is not None and loader is not None:
            self.sync = WeightSync(weights, loader, settings.weight_poll_seconds, settings.actor_id, self._weights_loaded)
        self.stats = ActorStats(diagnostics=ActorDiagnostics(settings.actor_id))
        self._stopping = asyncio.Event()
        self._training_over = asyncio.Event()  # no more groups start: no more evaluation rounds either
        self._last_eval_round = -1
        self._fatal: BaseException | None = None
        rng = random.Random(f"{settings.seed}/{settings.actor_id}")
        self._pick = task_picker or task_cycle(settings.tasks, rng)
        self._group_seed = rng.randrange(1 << 30)
        self._load: LoadMeter | None = None  # set by run(), over its episode slots

    def _weights_loaded(self) -> None:
        self.stats.weight_updates += 1

    def stop(self) -> None:
        """Start no new groups; the running ones finish and are submitted."""
        self._stopping.set()

    async def run(self) -> ActorStats:
        s = self.settings
        slots = EpisodeSlots(s.concurrency)
        self._load = LoadMeter(s.concurrency, slots.slot_seconds, lambda: self.stats.episodes)
        running: set[asyncio.Task[None]] = set()
        sync = asyncio.create_task(self.sync.run(), name="weight sync") if self.sync is not None else None
        if sync is not None:
            sync.add_done_callback(self._sync_ended)
        evaluation = asyncio.create_task(self._evaluate(slots), name="evaluation") if s.evaluation is not None else None
        # The stats file stays current while the actor waits (for admission, a slow group): its
        # recent rates then fall instead of repeating the last group's.
        snapshots = None
        if self.stats_file is not None:
            snapshots = asyncio.create_task(self.stats_file.keep(self.stats.diagnostics), name="stats")
        if evaluation is not None:
            evaluation.add_done_callback(self._sync_ended)
        try:
            while not self._stopping.is_set():
                if s.max_groups is not None and self.stats.groups_started >= s.max_groups:
                    break
                # A free slot first, then credit: credit is not held by groups that cannot start.
                await slots.reserve(s.group_size)
                for task in [t for t in running if t.done()]:
                    running.discard(task)
                    task.result()  # a bug in a group task surfaces here
                if not await self._admit():
                    await slots.give_back(s.group_size)
                    break
                self.stats.groups_started += 1
                running.add(asyncio.create_task(self._group(slots)))
            if running:
                for outcome in await asyncio.gather(*running, return_exceptions=True):
                    if isinstance(outcome, BaseException):
                        raise outcome
                running = set()
            self._training_over.set()
            if evaluation is not None:
                await evaluation  # a round under way finishes and is reported
        finally:
            if evaluation is not None and not evaluation.done():
                evaluation.cancel()
                await asyncio.gather(evaluation, return_exceptions=True)
            for task in running:  # only left on an error: do not orphan the other groups
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if sync is not None:
                sync.cancel()
                await asyncio.gather(sync, return_exceptions=True)
            if snapshots is not None:
                snapshots.cancel()
                await asyncio.gather(snapshots, return_exceptions=True)
        self._log_progress()
        if self.stats_file is not None:
            self.stats_file.write(self.stats.diagnostics, force=True)
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _evaluate(self, slots: EpisodeSlots) -> None:
        """Play an evaluation round whenever the policy version reaches a new multiple of
        ``evalEveryVersions`` (see ``stoker.actor.evaluation``), until training is over."""
        s = self.settings
        assert s.evaluation is not None
        plan = s.evaluation
        while not self._training_over.is_set() and not self._stopping.is_set():
            due = round_due(int(getattr(self.policy, "version", 0)), self._last_eval_round, plan.every_versions)
            if due is None:
                try:
                    await asyncio.wait_for(self._training_over.wait(), s.weight_poll_seconds)
                except TimeoutError:
                    pass
                continue
            self._last_eval_round = due
            outcome, _ = await play_round(
                self.policy, self.env_factory, self.interface, plan,
                version=due, limits=s.limits, slots=slots, actor_id=s.actor_id,
            )
            if await self._report_eval(outcome):
                self.stats.eval_rounds.append(outcome)
                log.info(
                    "actor %s: evaluation round at version %d: success %.2f, reward %.3f over %d greedy episodes",
                    s.actor_id, due, outcome.success_rate, outcome.reward_sum / max(outcome.episodes, 1), outcome.episodes,
                )

    async def _report_eval(self, outcome: EvalOutcome) -> bool:
        """Send a round's sums, retrying while the buffer is unavailable (a report id counts once)."""
        delay = 0.2
        for _ in range(8):
            try:
                await self.buffer.report_eval(outcome, f"{self.settings.actor_id}/{outcome.version}")
                return True
            except BufferUnavailable as exc:
                log.warning("evaluation report failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)  # backoff before retrying a remote call
                delay = min(delay * 2, MAX_RETRY_WAIT_SECONDS)
        log.error("evaluation round at version %d not reported: the buffer stayed unreachable", outcome.version)
        return False

    def _sync_ended(self, task: asyncio.Task[None]) -> None:
        """Weight sync only ends by cancellation (evaluation, by finishing); anything else stops the
        actor, loudly."""
        if task.cancelled() or task.exception() is None:
            return
        self._fatal = task.exception()
        log.error("%s failed: %r; stopping after the running groups", task.get_name(), self._fatal)
        self.stop()

    async def _admit(self) -> bool:
        """Wait for one group of credit; False if stopped while waiting."""
        while not self._stopping.is_set():
            try:
                load = self._load.read() if self._load is not None else None
                answered, credit = await self._unless_stopped(self.buffer.acquire(1, load), 0.0)
                if not answered:
                    return False
                assert credit is not None
                grant = credit
            except BufferUnavailable as exc:
                log.warning("buffer unavailable for admission: %s", exc)
                grant = Grant(0, 1.0)
            if grant.granted > 0:
                if grant.granted > 1:  # asked for one; give back any extra
                    await self.buffer.release(grant.granted - 1)
                if self.sync is not None:
                    await self.sync.catch_up(grant.policy_version)
                return True
            self.stats.admission_refusals += 1
            wait = min(grant.retry_after_seconds, MAX_RETRY_WAIT_SECONDS)
            if wait <= 0:  # the port already waited (a long poll)
                continue
            try:
                await asyncio.wait_for(self._stopping.wait(), wait)
            except TimeoutError:
                continue
        return False

    async def _group(self, slots: EpisodeSlots) -> None:
        s = self.settings
        task_id = self._pick()
        self._group_seed += 1
        episodes = await run_group(
            self.policy,
            self.env_factory,
            self.interface,
            task_id,
            s.group_size,
            limits=s.limits,
            seed=self._group_seed,
            group_id=f"{s.actor_id}-{uuid.uuid4().hex[:12]}",
            actor_id=s.actor_id,
            slots=slots,
        )
        if not await self._submit(episodes):
            return
        for reason in self.stats.record(episodes):
            log.warning(
                "actor %s: an episode failed for a new reason (%s); the first such message:\n%s",
                s.actor_id, reason, self.stats.diagnostics.examples.get(reason, ""),
            )
        if self.stats_file is not None:
            self.stats_file.write(self.stats.diagnostics)
        if self.stats.groups_submitted % 10 == 0:
            self._log_progress()

    async def _submit(self, episodes: list[Episode]) -> bool:
        """Put a whole group; False if it could not be. Transient failures are retried (Put is
        idempotent per episode id) for as long as it takes while running -- a restarting buffer
        comes back -- but once the actor is stopping for ``STOP_SUBMIT_SECONDS`` more at most: a
        buffer that is gone would otherwise hold the actor until it is killed."""
        loop = asyncio.get_running_loop()
        delay = 0.2
        give_up_at: float | None = None
        while True:
            try:
                answered, _ = await self._unless_stopped(self.buffer.put(episodes), STOP_SUBMIT_SECONDS)
                if answered:
                    return True
            except BufferUnavailable as exc:
                self.stats.submit_retries += 1
                if self._stopping.is_set():
                    give_up_at = give_up_at or loop.time() + STOP_SUBMIT_SECONDS
                if give_up_at is None or loop.time() < give_up_at:
                    log.warning("buffer put failed (%s); retrying in %.1f s", exc, delay)
                    await asyncio.sleep(delay)  # backoff before retrying a remote call
                    delay = min(delay * 2, MAX_RETRY_WAIT_SECONDS)
                    continue
            self.stats.abandoned_groups += 1
            log.error("stopping with the buffer unreachable: a group of %d episodes was not submitted", len(episodes))
            return False

    async def _unless_stopped(self, call: Awaitable[T], grace: float) -> tuple[bool, T | None]:
        """Await ``call``; if the actor is told to stop meanwhile, wait ``grace`` seconds more at
        most. ``(False, None)`` when it did not finish: a remote call retries against an unreachable
        buffer for minutes."""
        task = asyncio.ensure_future(call)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=grace)
            if not task.done():
                task.cancel()
                return False, None
            return True, task.result()
        finally:
            stopping.cancel()

    def _log_progress(self) -> None:
        summary = summarize(self.stats.recent)
        elapsed = time.monotonic() - self.stats.started
        sampling = ""
        batching, cache = getattr(self.policy, "stats", None), getattr(getattr(self.policy, "sampler", None), "cache_stats", None)
        if batching is not None and cache is not None:
            # An episode's sampling CPU hangs on these two: rows per sampler call, and how much of
            # each prompt comes from the conversation cache instead of being prefilled again.
            sampling = (
                f"; sampler: busy {100 * batching.busy_share:.0f}% of the time, {batching.mean_batch:.1f} rows per call, "
                f"{100 * cache.reuse:.0f}% of prompt tokens cached"
            )
        diagnostics = self.stats.diagnostics
        failures = "".join(f"; {count} x {reason}" for reason, count in diagnostics.top_failures())
        log.info(
            "actor %s: %d groups, %d episodes (%.1f/s), policy v%s, success %.2f, reward %.3f, statuses %s; %s%s%s",
            self.settings.actor_id,
            self.stats.groups_submitted,
            self.stats.episodes,
            self.stats.episodes / max(elapsed, 1e-9),
            getattr(self.policy, "version", "?"),
            summary["success_rate"],
            summary["mean_reward"],
            summary["statuses"],
            diagnostics.summary_line(),
            sampling,
            failures,
        )
