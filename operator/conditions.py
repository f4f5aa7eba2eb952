"""A status condition before its timestamps (``jobstatus.merge_conditions`` adds them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cond:
    """A condition before timestamps: type, status, reason, message."""

    type: str
    status: str
    reason: str
    message: str = ""
