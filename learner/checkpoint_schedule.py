"""When the learner checkpoints, so that one killed at any moment trains at most
``checkpoint.intervalSteps`` steps again.

Saves are asynchronous: a save of step c becomes durable some steps later, and a learner killed
meanwhile resumes from the checkpoint before c. Saving every ``interval`` steps therefore risked
the interval plus the steps trained during the write. Here a save starts early by as many steps
as the last one took to become durable, and before a step that would put more than ``interval``
steps past the newest durable checkpoint the learner waits for the save in flight (or saves and
waits, when none is): slow saves cost waiting, never more than ``interval`` steps at risk.

Several JAX processes must all call each save, so they keep the fixed schedule (every
``interval`` steps): whether a save is durable is each process's own observation and could differ.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointSchedule:
    interval: int
    adaptive: bool = True  # False: every ``interval`` steps (several processes)
    durable: int = 0  # the newest step known to be on disk (a restored one counts)
    saving: int | None = None  # a save started and not yet seen durable
    lag: int = 0  # steps the last save took to become durable

    def started(self, step: int) -> None:
        self.saving = step

    def observe(self, step: int, in_progress: bool) -> None:
        """At ``step``, whether a save is still being written (the checkpointer's own answer)."""
        if self.saving is not None and not in_progress:
            self.lag = max(0, step - self.saving)
            self.durable, self.saving = self.saving, None

    def due(self, step: int) -> bool:
        """Whether to start a save of ``step`` now."""
        if not self.adaptive:
            return step % self.interval == 0
        lead = min(self.lag, self.interval - 1)
        return self.saving is None and step > self.durable and step - self.durable >= self.interval - lead

    def must_wait(self, next_step: int) -> bool:
        """Whether training ``next_step`` would put more than ``interval`` steps past the newest
        durable checkpoint: the save in flight must finish first (or one be made)."""
        return self.adaptive and next_step - self.durable > self.interval

    def waited(self, step: int) -> None:
        """The save in flight (or one just made of ``step``) is durable: the learner waited for it.
        One in flight took longer than the steps since it started, so the next starts earlier."""
        if self.saving is not None:
            self.lag = max(self.lag, step - self.saving + 1)
        self.durable, self.saving = (self.saving if self.saving is not None else step), None
