"""/proc/PID/stat is split after the command name, whatever that name holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stoker.procstat import proc_stat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

# A process that renames itself (prctl PR_SET_NAME) to a name with spaces and parentheses.
RENAMED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"a) b (c", 0, 0, 0)
print("named", flush=True)
time.sleep(60)
"""


def test_fields_follow_the_command_name() -> None:
    child = subprocess.Popen([sys.executable, "-c", RENAMED], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"named\n"
        fields = proc_stat(child.pid)
        assert fields[0] in ("R", "S") and int(fields[1]) == os.getpid()
        assert int(fields[19]) > 0  # the start time, in ticks since boot
    finally:
        child.kill()
        child.wait()


def test_own_cpu_time_is_counted_in_ticks() -> None:
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    fields = proc_stat(os.getpid())
    assert int(fields[11]) + int(fields[12]) > 0
    assert proc_stat("self")[1] == str(os.getppid())


def test_a_process_that_is_gone_raises_file_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        proc_stat(2**22 + 1)  # above the largest pid_max Linux allows
