"""Kubernetes label and annotation keys on sandbox pods, shared by the actor and the operator.

Import-light on purpose (no kubernetes, no grpc): the operator imports it to find and reap sandbox
pods whose actor is gone or whose heartbeat went stale.
"""

from __future__ import annotations

from datetime import datetime, timezone

JOB_LABEL = "stoker.dev/job"
ROLE_LABEL = "stoker.dev/role"
ACTOR_LABEL = "stoker.dev/actor"
ROLE_SANDBOX = "sandbox"
HEARTBEAT_ANNOTATION = "stoker.dev/heartbeat"

# The port a sandbox pod's server listens on (a process sandbox picks a free one).
SANDBOX_POD_PORT = 50070


def rfc3339(moment: datetime | None = None) -> str:
    """A UTC timestamp as RFC 3339 with a ``Z`` suffix, the heartbeat annotation's format."""
    moment = moment or datetime.now(timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> datetime:
    """Inverse of ``rfc3339`` (also accepts ``+00:00`` offsets and whole seconds)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)


def sandbox_selector(job: str, actor: str | None = None) -> str:
    """A label selector for a job's sandbox pods (optionally one actor's)."""
    parts = [f"{ROLE_LABEL}={ROLE_SANDBOX}", f"{JOB_LABEL}={job}"]
    if actor is not None:
        parts.append(f"{ACTOR_LABEL}={actor}")
    return ",".join(parts)
