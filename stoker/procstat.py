"""``/proc/PID/stat``, split the one way that survives any command name (Linux only)."""

from __future__ import annotations

from pathlib import Path


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: ``[0]`` is the state (field 3 in
    proc(5)), ``[1]`` the parent pid (4), ``[11]`` and ``[12]`` the user and system CPU time in
    clock ticks (14, 15), ``[19]`` the start time (22).

    The command name is in parentheses and may hold spaces and parentheses itself, so the fields
    are split after the file's last ``)``. Raises ``FileNotFoundError`` for a process that is gone
    (another ``OSError`` where /proc cannot be read) and ``IndexError`` for a file without ``)``."""
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].decode("ascii").split()
