"""Scaling the rollout tier: the servers' Stats and learner starvation -> rollout replicas.

Pure functions over one look at every server; the status timer applies the decision and posts
one Event per action, as for the actors (``stoker.operator.control``).

* **Saturated** -- requests wait for a batch slot (queue depth summed over the servers is at least
  ``rollout_saturated_queue_fraction`` of their summed ``max_batch``) or a server answered
  ``RESOURCE_EXHAUSTED`` since the last look: actors wait on generation, so one more server
  (``scale_step_fraction`` of the current count, at least one) up to ``maxReplicas``.
* **Busy while the learner starves** -- batches run at least ``rollout_busy_occupancy`` full and
  the buffer is empty: generation is what the learner waits for, so scale up the same way.
* **Idle** -- batches under ``rollout_idle_occupancy`` full, no queue, no refusals, every server
  answering and the learner not starved: one server fewer, down to ``minReplicas``. One at a time,
  because a removed server's running conversations lose their cache and pinned weights.

Servers that have not loaded weights yet (``ready`` false) are left out of the figures, and with
no ready server at all nothing is decided: a tier that is still starting is not idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stoker.operator.control import Action, scale_step
from stoker.operator.settings import OperatorSettings


@dataclass(frozen=True)
class ServerStats:
    """The fields of ``stoker.v1.RolloutStats`` the operator reads, for one server."""

    address: str
    ready: bool = True
    policy_version: int = -1
    tokens_per_second: float = 0.0
    queue_depth: int = 0
    running: int = 0
    max_batch: int = 1
    batch_occupancy: float = 0.0
    kv_cache_bytes_used: int = 0
    kv_cache_bytes_total: int = 0
    rejected_total: int = 0


@dataclass(frozen=True)
class RolloutReading:
    """One look at every server: those that answered, and why the others did not."""

    servers: tuple[ServerStats, ...] = ()
    errors: tuple[str, ...] = ()
    """``"address: why"`` for each server that did not answer Stats."""
    rejected: int = 0
    """RESOURCE_EXHAUSTED answers since the previous look (servers seen both times)."""

    @property
    def serving(self) -> tuple[ServerStats, ...]:
        return tuple(s for s in self.servers if s.ready)

    @property
    def tokens_per_second(self) -> float:
        return sum(s.tokens_per_second for s in self.servers)

    @property
    def queue_depth(self) -> int:
        return sum(s.queue_depth for s in self.servers)

    @property
    def occupancy(self) -> float | None:
        """Mean batch occupancy of the ready servers (None without one)."""
        serving = self.serving
        return sum(s.batch_occupancy for s in serving) / len(serving) if serving else None


def rejected_since(previous: Mapping[str, int], servers: Sequence[ServerStats]) -> int:
    """Refusals since ``previous`` (address -> rejected_total); a counter that went down is a
    restarted server, whose whole count is new."""
    total = 0
    for server in servers:
        before = previous.get(server.address)
        if before is not None:
            total += server.rejected_total - before if server.rejected_total >= before else server.rejected_total
    return total


@dataclass(frozen=True)
class RolloutDecision:
    target: int
    actions: tuple[Action, ...] = field(default_factory=tuple)


def decide_rollout(
    *,
    target: int,
    min_replicas: int,
    max_replicas: int,
    reading: RolloutReading,
    expected_servers: int,
    starved: bool | None,
    cooled_down: bool,
    settings: OperatorSettings,
) -> RolloutDecision:
    """The next rollout-server target (module docstring); ``expected_servers`` is how many should
    answer (ready pods), so an idle verdict never rests on part of the tier."""
    serving = reading.serving
    occupancy = reading.occupancy
    if not serving or occupancy is None or not cooled_down:
        return RolloutDecision(target)
    slots = sum(max(1, s.max_batch) for s in serving)
    queue = sum(s.queue_depth for s in serving)
    detail = (
        f"{len(serving)} servers, queue {queue} for {slots} batch slots, occupancy {occupancy:.0%}, "
        f"{reading.rejected} refused, {reading.tokens_per_second:.0f} tokens/s"
    )
    saturated = reading.rejected > 0 or queue >= settings.rollout_saturated_queue_fraction * slots
    starving_busy = bool(starved) and occupancy >= settings.rollout_busy_occupancy
    if (saturated or starving_busy) and target < max_replicas:
        new_target = min(max_replicas, target + scale_step(target, settings.scale_step_fraction))
        why = "generation saturated" if saturated else "learner starved and servers busy"
        return RolloutDecision(new_target, (Action("ScaledUpRollout", f"rollout servers {target} -> {new_target}: {why} ({detail})"),))
    idle = occupancy < settings.rollout_idle_occupancy and queue == 0 and reading.rejected == 0
    if idle and starved is not True and len(serving) >= expected_servers and target > min_replicas:
        return RolloutDecision(
            target - 1, (Action("ScaledDownRollout", f"rollout servers {target} -> {target - 1}: idle ({detail})"),)
        )
    return RolloutDecision(target)
