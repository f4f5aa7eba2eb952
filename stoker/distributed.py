"""Multi-host JAX: ``jax.distributed.initialize`` from a pod's environment, and the few
host-to-host exchanges the learner and the rollout server build their lockstep on.

The topology comes from GKE's TPU variables (``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, and
``MEGASCALE_*`` for multislice; processes numbered slice-major) or, off TPU and winning over
them, ``STOKER_COORDINATOR_ADDRESS``/``STOKER_NUM_PROCESSES``/``STOKER_PROCESS_ID``. A process
silent for ``STOKER_HEARTBEAT_TIMEOUT_SECONDS`` ends the group. The variables and the failure
bound: docs/architecture.md, "One learner over several JAX processes".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from stoker.ports import JAX_COORDINATOR_PORT

log = logging.getLogger(__name__)

COORDINATOR_PORT = JAX_COORDINATOR_PORT  # not the Megascale port: both run on slice 0's first host
# A peer silent this long is failed and the group ends (JobSet then restarts it). Long enough for a
# host busy compiling (heartbeats run on their own thread), short next to a restart.
HEARTBEAT_TIMEOUT_SECONDS = 60
# How long processes wait for each other at start (pods of a JobSet start minutes apart) and at
# a clean exit.
INITIALIZATION_TIMEOUT_SECONDS = 600
SHUTDOWN_TIMEOUT_SECONDS = 120
# The exit status of a process that left because another of its group failed: its JobSet
# restarts the group.
EXIT_PEER_FAILED = 3
# Payloads are padded to a power of two no smaller than this, so a broadcast compiles one
# program per size class (a handful per run), not one per message.
MIN_PAYLOAD_BYTES = 1 << 12


class DistributedEnvError(ValueError):
    """The pod's environment describes an inconsistent topology."""


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str
    num_processes: int
    process_id: int
    heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_SECONDS


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise DistributedEnvError(f"{name}={raw!r}; expected an integer") from exc


def _host(address: str) -> str:
    """``host`` from ``host``, ``host:port`` or ``[v6]:port``."""
    address = address.strip()
    if address.startswith("["):
        return address[: address.index("]") + 1]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def from_environment(env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The distributed setup the environment describes, or None for a single process."""
    env = os.environ if env is None else env
    heartbeat = _int(env, "STOKER_HEARTBEAT_TIMEOUT_SECONDS", HEARTBEAT_TIMEOUT_SECONDS)
    if heartbeat < 1:
        raise DistributedEnvError(f"STOKER_HEARTBEAT_TIMEOUT_SECONDS={heartbeat}; expected >= 1")
    if env.get("STOKER_NUM_PROCESSES", "").strip():
        return _explicit(env, heartbeat)
    hostnames = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    hosts = max(len(hostnames), 1)
    worker = _int(env, "TPU_WORKER_ID", 0)
    num_slices = _int(env, "MEGASCALE_NUM_SLICES", 1)
    slice_id = _int(env, "MEGASCALE_SLICE_ID", 0)
    if not 0 <= worker < hosts:
        raise DistributedEnvError(f"TPU_WORKER_ID={worker}; expected 0..{hosts - 1} for {hosts} TPU_WORKER_HOSTNAMES")
    if num_slices < 1 or not 0 <= slice_id < num_slices:
        raise DistributedEnvError(
            f"MEGASCALE_SLICE_ID={slice_id}; expected 0..{num_slices - 1} for MEGASCALE_NUM_SLICES={num_slices}"
        )
    num_processes = hosts * num_slices
    if num_processes == 1:
        return None
    if num_slices > 1:
        coordinator = env.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip()
        if not coordinator:
            raise DistributedEnvError("MEGASCALE_NUM_SLICES > 1 but MEGASCALE_COORDINATOR_ADDRESS is unset")
        host = _host(coordinator)
    else:
        host = hostnames[0]
    return DistributedConfig(f"{host}:{COORDINATOR_PORT}", num_processes, worker + slice_id * hosts, heartbeat)


def _explicit(env: Mapping[str, str], heartbeat: int) -> DistributedConfig | None:
    count = _int(env, "STOKER_NUM_PROCESSES", 1)
    index = _int(env, "STOKER_PROCESS_ID", 0)
    if count < 1 or not 0 <= index < count:
        raise DistributedEnvError(f"STOKER_PROCESS_ID={index}; expected 0..{count - 1} for STOKER_NUM_PROCESSES={count}")
    if count == 1:
        return None
    address = env.get("STOKER_COORDINATOR_ADDRESS", "").strip()
    if not address:
        raise DistributedEnvError("STOKER_NUM_PROCESSES > 1 but STOKER_COORDINATOR_ADDRESS is unset")
    return DistributedConfig(address, count, index, heartbeat)


def initialize(env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """Call ``jax.distributed.initialize`` when the environment describes several processes.

    Must run before anything touches a JAX backend."""
    config = from_environment(env)
    if config is None:
        return None
    import jax

    log.info(
        "jax.distributed.initialize(coordinator=%s, processes=%d, process_id=%d)",
        config.coordinator_address, config.num_processes, config.process_id,
    )
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=INITIALIZATION_TIMEOUT_SECONDS,
        heartbeat_timeout_seconds=config.heartbeat_timeout_seconds,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
    )
    return config


# ---------------------------------------------------------------------------- exchanges


class PeerFailure(RuntimeError):
    """A collective failed: another process of the group died or lost its connection."""


@dataclass(frozen=True)
class Processes:
    """This process's place among a group's JAX processes; process 0 is the *primary*."""

    index: int = 0
    count: int = 1

    @property
    def primary(self) -> bool:
        return self.index == 0

    @property
    def multi(self) -> bool:
        return self.count > 1

    @classmethod
    def current(cls) -> Processes:
        import jax

        return cls(jax.process_index(), jax.process_count())


def padded_size(size: int) -> int:
    return max(MIN_PAYLOAD_BYTES, 1 << max(size - 1, 0).bit_length())


def share(
    processes: Processes, flag: int, payload: bytes = b"", *, doing: str,
    skip: Callable[[np.ndarray], bool] | None = None,
) -> tuple[np.ndarray, bytes]:
    """Every process's ``flag`` (one all-gather) and the primary's ``payload`` (one broadcast,
    left out when it is empty or ``skip(flags)``). Every process must call it, in the same order;
    only the primary's ``payload`` is read."""
    from jax.experimental import multihost_utils

    data = payload if processes.primary else b""
    with collective(doing):
        headers = multihost_utils.process_allgather(np.asarray([int(flag), len(data)], np.int64))
    flags, size = headers[:, 0], int(headers[0, 1])
    if size == 0 or (skip is not None and skip(flags)):
        return flags, b""
    buf = np.zeros(padded_size(size), np.uint8)
    if processes.primary:
        buf[:size] = np.frombuffer(data, np.uint8)
    with collective(doing):
        shared = multihost_utils.broadcast_one_to_all(buf)
    return flags, data if processes.primary else np.asarray(shared[:size]).tobytes()


class collective:  # noqa: N801 - used as a context manager, reads as a phrase
    """Turns a failed collective into ``PeerFailure`` naming what the group was doing."""

    def __init__(self, doing: str):
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        import jax

        if exc is not None and isinstance(exc, jax.errors.JaxRuntimeError):
            raise PeerFailure(f"another process failed while {self.doing}: {exc}") from exc


def broadcast_int(processes: Processes, value: int) -> int:
    """The primary's ``value`` on every process."""
    if not processes.multi:
        return value
    from jax.experimental import multihost_utils

    with collective("sharing a value"):
        return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int64)))
