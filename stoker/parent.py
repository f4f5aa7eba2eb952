"""Processes started by ``stoker run`` stop when it is gone.

The runner starts the buffer, the learner and the actors in their own sessions (so that a
terminal's Ctrl-C reaches the runner alone, which then stops them in order) and names itself in
``STOKER_PARENT_PID``. If the runner is killed outright (SIGKILL, out of memory) nobody stops them
in order: without this the actors would retry against the buffer forever. Each child polls its
parent; once it has been re-parented, it sends itself SIGTERM and takes its own graceful path.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("stoker")

PARENT_ENV = "STOKER_PARENT_PID"
POLL_SECONDS = 1.0


def stop_with_parent() -> None:
    """Watch the process named in ``STOKER_PARENT_PID``, if any (taken out of the environment, so
    this process's own children -- sandboxes -- do not inherit a parent that is not theirs)."""
    named = os.environ.pop(PARENT_ENV, None)
    if not named:
        return
    parent = int(named)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)  # a poll: there is no portable parent-death notification
        log.warning("stoker run (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
