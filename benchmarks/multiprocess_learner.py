"""The learner as 2 JAX processes against 1, same job and same total device count, side by side.

Each configuration trains the FrozenLake job's learner (``examples/frozenlake.yaml``) from a buffer
that a filler keeps full (as ``learner_duty.py``), so data never runs out and what differs is the
learner alone: ``1x2`` is one process with two CPU devices, ``2x1`` two processes (jax.distributed
on loopback, gloo) with one device each -- the same (fsdp=2) mesh. Configurations alternate over
``--rounds`` so machine noise falls on both. Per step the primary also times ``share_step`` -- the
header all-gather and the batch broadcast that make one batch reach every process -- and counts the
bytes shared.

    .venv/bin/python benchmarks/multiprocess_learner.py [--steps 60] [--rounds 2]

Reported per configuration: steady duty cycle (train-step time / wall time), mean train-step
seconds, updates per second, mean seconds per step spent sharing the batch, and its bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from learner_duty import filled_buffer
from local_runs import REPO


def worker(args: argparse.Namespace) -> int:
    """One learner process (the topology from STOKER_* variables, as ``stoker learner``)."""
    from stoker import distributed

    distributed.initialize()
    from stoker.buffer.client import BufferClient
    from stoker.learner import driver, multihost
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.weights.channel import WeightPublisher
    from stoker.manifest import load_job

    spec = load_job(args.manifest).spec
    work = Path(args.worker)
    settings = LearnerSettings.from_spec(
        spec, run_dir=work,
        allowed_token_ids=None, checkpoint_dir=None, compilation_cache_dir=None,  # random ids; no checkpoints
    )
    processes = distributed.Processes.current()
    shares: list[tuple[float, int]] = []  # (seconds, bytes) of every step's share_step
    real_share = multihost.share_step

    def timed_share(p: Any, batch: Any, stop: bool) -> Any:
        started = time.perf_counter()
        out = real_share(p, batch, stop)
        size = len(multihost_encode(out[1])) if out[1] is not None else 0
        shares.append((time.perf_counter() - started, size))
        return out

    def multihost_encode(batch: Any) -> bytes:
        from stoker.buffer.client_types import encode_sample

        return encode_sample(batch).SerializeToString()

    driver.multihost.share_step = timed_share  # type: ignore[assignment]
    steps: list[tuple[float, float]] = []  # (end time, train-step seconds)

    class Sink:
        def record(self, metrics: dict[str, float]) -> None:
            if metrics.get("trained"):
                steps.append((time.perf_counter(), metrics["step_seconds"]))

    learner = Learner(settings, resume=False)
    if processes.primary:
        with BufferClient(args.buffer) as client, WeightPublisher(directory=work / "weights", keep=2) as publisher:
            client.wait_ready()
            learner.run(client, publisher, max_steps=args.steps, sink=Sink(), stop=threading.Event())
    else:
        learner.run(None, None, max_steps=args.steps, stop=threading.Event())
    learner.close()
    if not processes.primary:
        return 0
    steady = steps[len(steps) // 5 :]  # after compilation and the first publishes
    wall = steady[-1][0] - (steady[0][0] - steady[0][1])
    shared = [s for s in shares[len(shares) // 5 :] if s[1] > 0]
    result = {
        "processes": processes.count,
        "devices": len(learner.mesh.devices.flat),
        "updates": len(steady),
        "steady_duty_cycle": sum(s for _, s in steady) / wall,
        "updates_per_second": len(steady) / wall,
        "mean_step_seconds": float(np.mean([s for _, s in steady])),
        "mean_share_seconds": float(np.mean([s for s, _ in shared])) if shared else 0.0,
        "mean_share_bytes": float(np.mean([b for _, b in shared])) if shared else 0.0,
    }
    (work / "result.json").write_text(json.dumps(result))
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_config(manifest: Path, processes: int, devices: int, steps: int) -> dict[str, Any]:
    from stoker.manifest import load_job

    spec = load_job(manifest).spec
    work = Path(tempfile.mkdtemp(prefix="stoker-mp-learner-"))
    with filled_buffer(manifest, work, spec.buffer.group_size, spec.model.architecture.vocab_size) as address:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        if processes > 1:
            env.update(STOKER_NUM_PROCESSES=str(processes), STOKER_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
        argv = [sys.executable, __file__, "--worker", str(work), "--buffer", address, "--manifest", str(manifest),
                "--steps", str(steps)]
        procs = [subprocess.Popen(argv, env={**env, "STOKER_PROCESS_ID": str(i)}) for i in range(processes)]
        for proc in procs:
            if proc.wait(timeout=1800) != 0:
                raise RuntimeError(f"a learner process exited {proc.returncode}")
        return dict(json.loads((work / "result.json").read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--buffer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    configs = {"1x2": (1, 2), "2x1": (2, 1)}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (processes, devices) in configs.items():
            results[name].append(run_config(args.manifest, processes, devices, args.steps))
            print(name, json.dumps(results[name][-1]), flush=True)
    summary = {
        name: {key: float(np.mean([r[key] for r in runs])) for key in runs[0]} for name, runs in results.items()
    }
    one, two = summary["1x2"], summary["2x1"]
    summary["ratio_2x1_over_1x2"] = {
        "mean_step_seconds": two["mean_step_seconds"] / one["mean_step_seconds"],
        "updates_per_second": two["updates_per_second"] / one["updates_per_second"],
        "steady_duty_cycle": two["steady_duty_cycle"] / one["steady_duty_cycle"],
        "share_fraction_of_step": two["mean_share_seconds"] / two["mean_step_seconds"],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
