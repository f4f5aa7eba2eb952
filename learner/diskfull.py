"""The learner's exit on a full disk: a checkpoint, a metrics record or a weight file it could not
write. Import-light (no JAX), so ``stoker run``'s parent reads the exit code from here.

A full disk is not a crash a restart mends: the learner leaves with ``EXIT_DISK_FULL`` (and one
line saying what it could not write, where its log has room for it), and ``stoker run`` stops the
run instead of restarting it (``runner/diskfull.py``). What it leaves is resumable: Orbax renames
a checkpoint to its step only once all of it is written, so an unfinished one stays a
``<step>.orbax-checkpoint-tmp`` folder that a restore passes over.
"""

from __future__ import annotations

import errno

__all__ = ["EXIT_DISK_FULL", "NO_SPACE", "no_space"]

# sysexits' EX_TEMPFAIL: the run can go on (resume) once space is freed.
EXIT_DISK_FULL = 75
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# tensorstore and XLA re-raise a failed write as their own error, keeping only the OS's text.
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")


def no_space(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain (its causes and contexts) that says the disk is full; None
    when none does."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE:
            return current
        if any(text in str(current) for text in _NO_SPACE_TEXT):
            return current
        current = current.__cause__ or current.__context__
    return None
