"""The buffer loop: sample, train, commit, publish, report, checkpoint -- on one process or many.

``run`` trains until ``max_steps`` or a stop: each batch is sampled one step ahead
(``Prefetcher``), trained, committed; the version's weights are published every
``publish_interval`` steps and then reported to the buffer; checkpoints are written so that at
most ``checkpoint_interval`` steps are ever past a durable one (``checkpoint_schedule.py``), and
at the end. Commits, publishing and reports go through the ``Outbox``'s thread, in order, so
training never waits on them.

Over several JAX processes (``stoker.learner.multihost``) this is one logical learner: only the
primary holds the buffer client, the publisher and the metrics sink; every step's batch and stop
decision are shared before anything is trained, so each side effect happens once while every
collective (the step, the weight gather, Orbax's save) runs on every process in the same order. A
collective that fails because a peer died raises ``PeerFailure``: the caller exits at once, without
a final checkpoint (it would be a collective too), and the group restarts from the last one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from stoker.buffer.client_types import BufferClientError, LeaseLostError, SampledBatch
from stoker.distributed import Processes, broadcast_int, collective, share
from stoker.learner import multihost
from stoker.learner.batches import load_dpo_pairs
from stoker.learner.metrics import DutyCycle
from stoker.learner.outbox import Outbox
from stoker.learner.packing import TrainSequence
from stoker.learner.prefetch import Prefetcher

if TYPE_CHECKING:  # the Learner runs this loop (stoker.learner.loop imports this module)
    from stoker.learner.loop import Learner

log = logging.getLogger(__name__)

# After a stop request, how long the prefetcher and the last commits get to reach the buffer.
STOP_WAIT_SECONDS = 5.0


class BatchSource(Protocol):
    """The buffer as the loop sees it (``stoker.buffer.client.BufferClient`` fits)."""

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch | None: ...

    def commit(self, batch_id: str) -> Any: ...

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> Any: ...


class Publisher(Protocol):
    def publish(self, version: int, flat: Any) -> Any: ...


class RunLoop:
    """One call of ``Learner.run``: the loop's state (what was published and reported)."""

    def __init__(
        self,
        learner: Learner,
        source: BatchSource | None,
        publisher: Publisher | None,
        sink: Any,
        stop: threading.Event,
        processes: Processes,
    ):
        self.learner = learner
        self.processes = processes
        # Side effects belong to the primary; the others never see the buffer or the publisher.
        primary = processes.primary
        self.source = source if primary else None
        # A sharded publisher (``stoker.weights.publish``) publishes from every process.
        self.publisher = publisher if primary or getattr(publisher, "every_process", False) else None
        self.sink = sink if primary else None
        self.stop = stop
        self.stopped = False  # the stop every process agreed on (``multihost.share_step``)
        self._reported_version = -1  # written by the outbox's thread only, once running
        self._copied_version = -1
        self._unpublished: tuple[int, Any] | None = None  # (version, parameters copied for publishing)
        self._unpublished_lock = threading.Lock()
        # The buffer's newest evaluation round, read after each version report (outbox thread),
        # and the one last written to the metrics (training thread).
        self._newest_eval: dict[str, float] | None = None
        self._written_eval: dict[str, float] | None = None
        # Whether weights are gathered for publishing: the primary's choice, made on every process
        # (the gather is a collective).
        self.publishing = bool(broadcast_int(processes, int(self.publisher is not None)))
        self.sharded = bool(broadcast_int(processes, int(getattr(self.publisher, "every_process", False))))
        if self.sharded and self.publisher is None:
            raise ValueError(f"process {processes.index} has no sharded weights publisher, but the primary has one")
        self._shards_idle = threading.Event()  # no sharded publish of this process queued or running
        self._shards_idle.set()

    def run(self, limit: int) -> int:
        learner, s = self.learner, self.learner.settings
        started_at_step = learner.steps
        duty = DutyCycle()
        learner.busy_seconds = 0.0
        self._skip_reported_versions()
        dataset: Iterator[Any] | None = None
        if s.algorithm == "sft":
            dataset = self._sft_batches()
        elif s.algorithm == "dpo" and s.dpo_dataset:
            dataset = self._dataset_batches()
        if dataset is None and self.source is None and self.processes.primary:
            raise ValueError("no buffer to sample from (and no DPO or SFT dataset)")
        with contextlib.ExitStack() as cleanup:
            # Entered first, so it closes last: every commit and the final weights are sent
            # before run() returns, after the prefetcher has stopped.
            outbox = cleanup.enter_context(Outbox())
            self._publish(outbox)
            prefetcher = None
            if dataset is None and self.source is not None:
                prefetcher = cleanup.enter_context(
                    Prefetcher(
                        self.source, max_groups=s.batch_groups, min_groups=s.batch_groups, timeout=s.sample_timeout_s
                    )
                )
            with collective("training") if self.processes.multi else contextlib.nullcontext():
                made = self._run_steps(dataset, prefetcher, outbox, limit, duty)
            if made:
                duty.busy_seconds = learner.busy_seconds
                self._publish(outbox, duty.value, final=True)
            if self.stopped:
                # Stopped from outside -- maybe because the buffer is gone, when every commit would
                # retry for minutes: checkpoint first (it needs nothing from the buffer), then give
                # the buffer a bounded time. A commit not sent means the batch is trained again.
                if learner.steps > started_at_step:
                    learner.save()
                if prefetcher is not None:
                    prefetcher.close(wait=STOP_WAIT_SECONDS)
                abandoned = outbox.close(timeout=STOP_WAIT_SECONDS)
                if abandoned:
                    log.warning(
                        "buffer unreachable while stopping: %d commits/version reports not sent after %.0f s "
                        "(their batches are delivered again)", abandoned, STOP_WAIT_SECONDS,
                    )
        if learner.steps > started_at_step:  # batches without an update are steps too: resume after them
            learner.save()
        if learner.checkpointer is not None:
            learner.checkpointer.wait()
        return made

    def _run_steps(
        self,
        dataset: Iterator[Any] | None,
        prefetcher: Prefetcher | None,
        outbox: Outbox,
        limit: int,
        duty: Any,
    ) -> int:
        learner, s, source = self.learner, self.learner.settings, self.source
        made = 0
        while learner.steps < limit:
            batch = prefetcher.get() if prefetcher is not None and not self.stop.is_set() else None
            self.stopped, batch = multihost.share_step(self.processes, batch, self.stop.is_set())
            if self.stopped:
                break
            batch_id = None
            if dataset is not None:
                learner.before_step()
                items = next(dataset)
                metrics = learner.train_on_sequences(items) if s.algorithm == "sft" else learner.train_on_pairs(items)
            else:
                if batch is None:
                    if made and source is not None:
                        duty.busy_seconds = learner.busy_seconds
                        outbox.send(functools.partial(self._report_idle, source, duty.value))
                    continue
                batch_id = batch.batch_id
                learner.before_step()
                metrics = learner.train_on(batch.groups, sampled_at=batch.policy_version, max_staleness=batch.max_staleness)
            commit = functools.partial(self._commit, source, batch_id) if batch_id is not None and source is not None else None
            if batch is not None and self.sink is not None and hasattr(self.sink, "record_episodes"):
                # Trained or not: a batch without signal (every episode alike) is the one to read.
                self.sink.record_episodes(learner.steps, [e for g in batch.groups for e in g.episodes])
            if not metrics.get("trained"):
                if commit is not None:
                    outbox.send(commit)
                if self.sink is not None:
                    self.sink.record(metrics)  # its episodes still count toward the success rate
                continue
            made += 1
            if learner.sft_data is not None and learner.sft_data.eval and s.sft is not None and (
                learner.version % s.sft.eval_interval_steps == 0 or learner.steps >= limit
            ):
                metrics.update(learner.evaluate_sequences([c.sequence() for c in learner.sft_data.eval]))
            duty.busy_seconds = learner.busy_seconds
            metrics["duty_cycle"] = duty.value
            if learner.steps % s.publish_interval == 0:
                self._publish(outbox, metrics["duty_cycle"])
            if commit is not None:
                # After the version it made is reported: a commit frees the batch's admission
                # credit, and granted before the report the actors' next groups would start on
                # the weights this step just replaced.
                outbox.send(commit)
            learner.checkpoint_if_due()
            if self.sink is not None:
                newest = self._newest_eval
                if newest is not None and newest != self._written_eval:
                    metrics.update(newest)  # each new (or grown) evaluation round once
                    self._written_eval = newest
                self.sink.record(metrics)
            if self.processes.primary:
                log.info(
                    "step %d v%d loss %.4f reward %.3f %.0f trained tok/s (%d of %d sampled tokens) duty %.2f",
                    learner.steps, learner.version, metrics.get("loss", 0.0), metrics.get("reward_mean", 0.0),
                    metrics["tokens_per_second"], metrics.get("trained_tokens", 0.0), metrics.get("sampled_tokens", 0.0),
                    metrics["duty_cycle"],
                )
        else:  # reached the limit; a stop asked meanwhile only shortens the waits below
            self.stopped = self.stop.is_set() and not self.processes.multi
        return made

    def _dataset_batches(self) -> Iterator[list[list[TrainSequence]]]:
        """Endless shuffled epochs over the DPO dataset, batch_groups pairs at a time. Every process
        reads the file and draws the same order from the shared seed."""
        assert self.learner.settings.dpo_dataset is not None
        pairs = load_dpo_pairs(self.learner.settings.dpo_dataset)
        for batch in self._shuffled_batches(len(pairs)):
            yield [pairs[i] for i in batch]

    def _sft_batches(self) -> Iterator[list[TrainSequence]]:
        """Endless shuffled epochs over the SFT conversations, batch_groups at a time (the same
        order on every process, from the shared seed)."""
        data = self.learner.sft_data
        assert data is not None
        sequences = [c.sequence() for c in data.train]
        for batch in self._shuffled_batches(len(sequences)):
            yield [sequences[i] for i in batch]

    def _shuffled_batches(self, count: int) -> Iterator[list[int]]:
        learner = self.learner
        while True:
            key = jax.random.wrap_key_data(jnp.asarray(learner.rng))
            key, sub = jax.random.split(key)
            learner.rng = np.asarray(jax.random.key_data(key), np.uint32)
            order = np.asarray(jax.random.permutation(sub, count))
            for start in range(0, len(order), learner.settings.batch_groups):
                yield [int(i) for i in order[start : start + learner.settings.batch_groups]]

    def _skip_reported_versions(self) -> None:
        """Never hand out a version number twice.

        After a kill the checkpoint may be older than the last version the buffer (and the actors)
        saw; those versions' weights are lost. Numbering on from the checkpoint would give
        different weights an already-used version, so the restored weights take the next unused
        number instead. The primary asks the buffer; every process takes its answer."""
        learner = self.learner
        stats = getattr(self.source, "stats", None)
        reported = int(stats().policy_version) if stats is not None else -1
        reported = broadcast_int(self.processes, reported)
        if reported > learner.version:
            if self.processes.primary:
                log.warning(
                    "checkpoint is at version %d but version %d was already reported; continuing as version %d",
                    learner.version, reported, reported + 1,
                )
            learner.version = reported + 1

    @staticmethod
    def _commit(source: BatchSource, batch_id: str) -> None:
        try:
            source.commit(batch_id)
        except LeaseLostError as exc:
            # The lease ran out while we trained; the buffer will hand those groups out again.
            log.warning("commit of batch %s refused (%s); its groups will be delivered again", batch_id, exc)

    def _report_idle(self, source: BatchSource, duty_cycle: float) -> None:
        """Waiting for data: send the falling duty cycle with the version already reported (never
        an unpublished one), or the operator's starvation check would keep seeing the value from
        the last step for as long as the learner is starved."""
        if self._reported_version >= 0:
            source.set_policy_version(self._reported_version, duty_cycle=duty_cycle)

    def _read_eval(self, source: BatchSource) -> None:
        """The newest held-out evaluation round from the buffer's Stats, for the metrics."""
        stats = getattr(source, "stats", None)
        if stats is None:
            return
        try:
            rounds = list(stats().eval_rounds)
        except BufferClientError as exc:
            log.warning("could not read evaluation results from the buffer: %s", exc)
            return
        if rounds:
            newest = rounds[-1]
            self._newest_eval = {
                "eval_policy_version": float(newest.policy_version),
                "eval_success_rate": float(newest.success_rate),
                "eval_reward_mean": float(newest.mean_reward),
                "eval_episodes": float(newest.episodes),
            }

    def _publish(self, outbox: Outbox, duty_cycle: float | None = None, final: bool = False) -> None:
        """Publish the current version's weights (once per version) and then report it to the
        buffer, with the duty cycle when there is one (not before the first step: the operator would
        read a learner that has not started as a starved one).

        Only the copy of the parameters happens here (the next step donates them); converting,
        writing and reporting run on the outbox's thread, newest version wins. With the single-blob
        publisher over several processes the copy is gathered to a full replica on every device (a
        collective, so every process makes it), which the primary reads to the host; a sharded
        publisher gathers nothing (``_publish_shards``)."""
        learner, publisher, source = self.learner, self.publisher, self.source
        version = learner.version
        if self.sharded:
            self._publish_shards(outbox, duty_cycle, final)
            return
        if self.publishing and self._copied_version < version:
            copy = multihost.replicate(self.processes, learner.trainer.policy_copy(), learner.mesh)
            self._copied_version = version
            if publisher is None:
                return  # not the primary: the gather was this process's part
            with self._unpublished_lock:
                self._unpublished = (version, copy)
        if not self.processes.primary:
            return

        def publish_and_report() -> None:
            # The newest copy, not necessarily this call's: if publishing fell behind training,
            # actors get the latest weights rather than a backlog of older ones.
            unpublished = self._unpublished
            if unpublished is not None and getattr(publisher, "latest_version", -1) < unpublished[0]:
                assert publisher is not None
                publisher.publish(unpublished[0], learner.flat_weights(unpublished[1]))
            with self._unpublished_lock:  # unless a newer copy arrived meanwhile
                if self._unpublished is unpublished:
                    self._unpublished = None  # do not hold a second copy of the weights once published
            self._report(version, duty_cycle)

        outbox.send(publish_and_report)

    def _report(self, version: int, duty_cycle: float | None) -> None:
        source = self.source
        if source is not None and self._reported_version != version:
            if duty_cycle is None:
                source.set_policy_version(version)
            else:
                source.set_policy_version(version, duty_cycle=duty_cycle)
            self._reported_version = version
            self._read_eval(source)

    def _publish_shards(self, outbox: Outbox, duty_cycle: float | None, final: bool) -> None:
        """Every process stages its own shards of a ``policy_copy`` (training sharding, no gather)
        on its outbox's thread; the primary commits and then reports the version.

        A version is published on every process or on none, and no process holds a second copy
        waiting: while any process is still publishing the previous version, this one is skipped
        (decided together, one all-gather); the last one of a run waits its turn instead."""
        learner, publisher, version = self.learner, self.publisher, self.learner.version
        assert publisher is not None
        if self._copied_version >= version:
            return
        if final:
            self._shards_idle.wait()
        busy = not self._shards_idle.is_set()
        if self.processes.multi:
            flags, _ = share(self.processes, int(busy), doing="agreeing on publishing weights")
            busy = bool(flags.any())
        if busy:
            return
        copy = learner.trainer.policy_copy()
        self._copied_version = version
        self._shards_idle.clear()

        def publish_and_report() -> None:
            try:
                publisher.publish(version, learner.trainer.policy_model(copy))
            finally:
                self._shards_idle.set()
            self._report(version, duty_cycle)

        outbox.send(publish_and_report)
