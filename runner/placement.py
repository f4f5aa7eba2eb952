"""Where a local run's children listen, and which of them may open this host's chip.

Transport: by default every server of ``stoker run`` (the buffer, a rollout server and its other
processes) listens on a unix socket in the run's socket folder: no port is allocated, so runs
never race for one, and nothing makes an inet socket, which some hosts refuse outright (a TPU VM
that allows no ``socket(AF_INET)``). ``--transport tcp`` keeps loopback ports. The one TCP port
a unix run still takes is ``jax.distributed``'s coordinator, for a learner or rollout server split
over several JAX processes (it listens on nothing else).

Chips: libtpu lets one process open a host's TPU. On a host with chips the learner holds them and
every other child (actors, a rollout server) runs JAX on the CPU; the run says so at the start.

Actors: ``actors.replicas``, or when it is unset as many as the host's cores can feed
(``stoker.actor_count``); the run's first lines say how many and why.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from stoker import chips
from stoker.actor_count import ActorCount, host_actors, host_cores, reserved_cores
from stoker.bottleneck import HostFigures
from stoker.cpu_threads import CPU_THREADS_ENV
from stoker.endpoints import Address, socket_directory
from stoker.spec import RLJobSpec

UNIX, TCP = "unix", "tcp"
TRANSPORTS = (UNIX, TCP)


class PlacementError(ValueError):
    """Options that cannot work together on this host; the message says which and why."""


@dataclass(frozen=True)
class Placement:
    transport: str
    socket_dir: Path | None  # with the unix transport
    chips: tuple[str, ...] = ()  # this host's TPU chip devices
    cpu_only_env: dict[str, str] = field(default_factory=dict)  # for every child but the learner
    actors: ActorCount = ActorCount(1, "actors.replicas")
    host: HostFigures = HostFigures(cores=1, reserved=0)  # what the bottleneck advice counts as spare

    @property
    def actor_cpu_threads(self) -> int:
        """Each actor's share of the host's cores (after the buffer's and learner's), the size of
        its XLA CPU pools (``stoker.cpu_threads``): pools as large as the host contend."""
        return max(1, (self.host.cores - self.host.reserved) // max(self.actors.replicas, 1))

    def actor_env(self, env: dict[str, str]) -> dict[str, str]:
        """An in-process-sampling actor's environment: ``env`` with its CPU share unless set there."""
        return {CPU_THREADS_ENV: str(self.actor_cpu_threads), **env}

    def listen(self, name: str) -> list[str]:
        """The flags that make server ``name`` listen (``--ready-file`` then says where)."""
        if self.socket_dir is None:
            return ["--host", "127.0.0.1", "--port", "0"]
        return ["--listen", Address(path=str(self.socket_dir / f"{name}.sock")).target]

    def describe(self) -> str:
        where = f"unix sockets in {self.socket_dir}" if self.socket_dir is not None else "loopback TCP"
        actors = f"\nstoker run: actors: {self.actors.replicas} ({self.actors.why})"
        if not self.chips:
            return f"stoker run: servers on {where}{actors}"
        return (
            f"stoker run: servers on {where}; this host's TPU ({len(self.chips)} chip device(s)) is held by the "
            f"learner, actors and rollout servers sample on the CPU{actors}"
        )


def plan(
    run_dir: Path, spec: RLJobSpec, *, transport: str, learner_processes: int = 1, rollout_processes: int = 0,
    cores: int | None = None,
) -> Placement:
    """The placement of a local async run on ``cores`` (this process's, when not given), or
    ``PlacementError``; ``rollout_processes`` 0 when the job has no rollout server."""
    if transport not in TRANSPORTS:
        raise PlacementError(f"--transport {transport}: expected one of {', '.join(TRANSPORTS)}")
    found = tuple(chips.host_chips()) if chips.wants_chip() else ()
    cores = host_cores() if cores is None else cores
    processes = {"learner_processes": learner_processes, "rollout_processes": rollout_processes}
    return Placement(
        transport=transport,
        socket_dir=socket_directory(run_dir) if transport == UNIX else None,
        chips=found,
        cpu_only_env={"JAX_PLATFORMS": "cpu"} if found else {},
        actors=host_actors(spec, cores, **processes),
        host=HostFigures(cores=cores, reserved=reserved_cores(**processes)),
    )


def jax_process_envs(env: dict[str, str], processes: int, devices: int) -> list[dict[str, str]]:
    """The environment of each of ``processes`` processes of one JAX group (the learner's, or a
    rollout server's): one JAX process each on the CPU,
    ``devices`` devices apiece, meeting at a coordinator on a free loopback port
    (``stoker.distributed``). One process gets ``env`` unchanged."""
    if processes == 1:
        return [env]
    try:
        with socket.socket() as probe:  # a free port now; the coordinator binds it a moment later
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    except OSError as exc:  # a host that refuses inet sockets (errno 97 on a TPU VM)
        raise PlacementError(
            f"{processes} JAX processes meet at jax.distributed's coordinator, which needs a TCP port on loopback, "
            f"and this host refuses one ({exc}); run them as one process"
        ) from None
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    shared = {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "STOKER_NUM_PROCESSES": str(processes),
        # A local peer that dies closes its sockets and is seen at once; the heartbeat covers a
        # hung one, and a short one keeps a broken local run from lingering.
        "STOKER_HEARTBEAT_TIMEOUT_SECONDS": env.get("STOKER_HEARTBEAT_TIMEOUT_SECONDS", "20"),
    }
    return [{**shared, "STOKER_PROCESS_ID": str(index)} for index in range(processes)]
