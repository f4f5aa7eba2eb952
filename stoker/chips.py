"""This host's accelerator chips, and who holds them, found without starting JAX.

libtpu lets one process open a host's TPU chips: a second one fails deep inside JAX's backend
start with a lockfile error that names neither the holder nor a fix. A process that is about to
open the chip asks ``held_by`` first and says both; ``stoker run`` uses ``host_chips`` to give the
chip to the learner and run everything else on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# TPU VMs expose their chips as /dev/accel* (v2-v5e) or VFIO groups (v5p, v6e).
_DEVICE_GLOBS = (("/dev", "accel*"), ("/dev/vfio", "[0-9]*"))
# A process that loaded libtpu holds the chips (libtpu's own check looks for the same mapping).
_LIBTPU = "libtpu"


class ChipHeld(RuntimeError):
    """Another process holds this host's TPU; the message names it and what to do."""


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str


def host_chips(dev: str = "/dev") -> list[str]:
    """The TPU chip device files on this host (empty on a machine without one)."""
    found: list[str] = []
    for folder, pattern in _DEVICE_GLOBS:
        base = Path(folder.replace("/dev", dev, 1))
        if base.is_dir():
            found += sorted(str(p) for p in base.glob(pattern))
    return found


def wants_chip(env: dict[str, str] | None = None) -> bool:
    """Whether a JAX process started with ``env`` may open an accelerator (not pinned to the CPU)."""
    platforms = (os.environ if env is None else env).get("JAX_PLATFORMS", "")
    return platforms.strip().lower() not in ("cpu",)


def holders(proc: str = "/proc", *, exclude: int | None = None) -> list[Holder]:
    """Processes that have libtpu loaded (they hold, or are opening, the chip)."""
    me = os.getpid() if exclude is None else exclude
    found = []
    for entry in Path(proc).iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            maps = (entry / "maps").read_text(errors="replace")
        except OSError:  # gone meanwhile, or another user's
            continue
        if _LIBTPU in maps:
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                command = "?"
            found.append(Holder(int(entry.name), command))
    return found


def check_free(role: str, *, proc: str = "/proc", dev: str = "/dev") -> None:
    """Raise ``ChipHeld`` if this host has a TPU and another process holds it, before ``role`` (the
    learner, a rollout server) starts JAX on it. No-op on a host without chips or pinned to the CPU."""
    if not host_chips(dev) or not wants_chip():
        return
    taken = holders(proc)
    if taken:
        who = ", ".join(f"pid {h.pid} ({h.command[:80]})" for h in taken)
        raise ChipHeld(
            f"{role}: this host's TPU is held by {who}; one process can open a host's chips at a time. "
            "Stop that process, or run this one on the CPU (JAX_PLATFORMS=cpu)"
        )
