"""The learner loop's own duty cycle: how busy can the learner be when data is never missing?

A buffer (``stoker buffer``, its own process, default durability) is kept full by a filler process
that Puts FrozenLake-sized groups (the example's ~150 tokens and 7 model turns per episode, reward
spread in every group) stamped with the buffer's current policy version. The learner runs in this
process exactly as ``stoker learner`` does: ``Learner.run`` against a ``BufferClient``, publishing
every version to a weights directory. Whatever fraction of wall time is not inside train steps is
the loop's own overhead (sampling, committing, publishing, reporting): the ceiling on the duty
cycle of any run of this model, however many actors feed it.

    .venv/bin/python benchmarks/learner_duty.py [--steps 200] [--batch-groups 4]

Reported: steady duty cycle (train-step time / wall time from the first step's start to the last
step's end), updates per second, mean train-step seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from buffer_throughput import wait_ready_file
from local_runs import REPO

TOKENS, TURNS, VOCAB_MOVES = 150, 7, 4


def episodes_for(version: int, rng: np.random.Generator, group_size: int, vocab: int) -> list[Any]:
    from stoker.trajectory import Episode

    group_id = uuid.uuid4().hex
    out = []
    for j in range(group_size):
        ids = rng.integers(0, vocab, TOKENS).astype(np.int32)
        mask = np.zeros(TOKENS, np.uint8)
        mask[np.linspace(20, TOKENS - 1, TURNS).astype(int)] = 1  # one move per turn, as the example
        out.append(
            Episode(
                episode_id=uuid.uuid4().hex, group_id=group_id, group_size=group_size, task_id="map",
                token_ids=ids, loss_mask=mask,
                logprobs=np.where(mask > 0, np.log(1 / VOCAB_MOVES), 0).astype(np.float32),
                policy_versions=np.where(mask > 0, version, -1).astype(np.int32),
                reward=float(j % 2), status=1,
            )
        )
    return out


def fill(address: str, group_size: int, vocab: int, stop: Any) -> None:
    """Keep the buffer full: a group as soon as admission control grants credit for one."""
    from stoker.buffer.client import BufferClient

    rng = np.random.default_rng(0)
    with BufferClient(address) as client:
        client.wait_ready()
        while not stop.is_set():
            # Admission control, as actors do: the buffer holds no more than maxStaleness allows,
            # and each group carries the version current when it was admitted.
            credit = client.acquire(1, wait=1.0)
            if credit.granted:
                client.put(episodes_for(credit.policy_version, rng, group_size, vocab))


@contextlib.contextmanager
def filled_buffer(manifest: Path, work: Path, group_size: int, vocab: int) -> Iterator[str]:
    """A ``stoker buffer`` process kept full by a filler process; yields its address."""
    ready = work / "buffer.ready"
    # A unix socket: the TPU host allows no TCP, not even on loopback.
    address = f"unix://{work / 'buffer.sock'}"
    buffer = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "buffer", "--manifest", str(manifest), "--listen", address,
         "--data-dir", str(work / "buffer"), "--ready-file", str(ready), "--log-level", "warning"],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # the learner in this process holds the chip
    )
    stop = multiprocessing.Event()
    filler = None
    try:
        wait_ready_file(ready, buffer, timeout=60)
        filler = multiprocessing.Process(target=fill, args=(address, group_size, vocab, stop), daemon=True)
        filler.start()
        yield address
    finally:
        stop.set()
        if filler is not None:
            filler.join(timeout=10)
        buffer.terminate()
        buffer.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-groups", type=int, help="learner.batchGroups (default: the manifest's)")
    parser.add_argument("--microbatch-tokens", type=int, help="learner.microbatchTokens (default: the manifest's)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    import jax

    from stoker.buffer.client import BufferClient
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.weights.channel import WeightPublisher
    from stoker.manifest import load_job

    spec = load_job(args.manifest).spec
    overrides = {"batch_groups": args.batch_groups, "microbatch_tokens": args.microbatch_tokens}
    learner_spec = spec.learner.model_copy(update={k: v for k, v in overrides.items() if v})
    spec = spec.model_copy(update={"learner": learner_spec})
    work = Path(tempfile.mkdtemp(prefix="stoker-learner-duty-"))
    settings = LearnerSettings.from_spec(
        spec, run_dir=work, checkpoint_dir=None,
        allowed_token_ids=None,  # the filler's random ids are not constrained to the move words
    )
    with filled_buffer(args.manifest, work, spec.buffer.group_size, settings.architecture.vocab_size) as address:
        learner = Learner(settings, resume=False)
        steps: list[tuple[float, float]] = []  # (end time, train-step seconds)

        class Sink:
            def record(self, metrics: dict[str, float]) -> None:
                if metrics.get("trained"):
                    steps.append((time.perf_counter(), metrics["step_seconds"]))

        with BufferClient(address) as client, WeightPublisher(directory=work / "weights", keep=2) as publisher:
            client.wait_ready()
            learner.run(client, publisher, max_steps=args.steps, sink=Sink(), stop=threading.Event())
        learner.close()

    steady = steps[len(steps) // 10 :]  # after compilation and the first publishes
    wall = steady[-1][0] - (steady[0][0] - steady[0][1])
    result = {
        "batch_groups": settings.batch_groups,
        "microbatch_tokens": settings.microbatch_tokens_on(jax.devices()[0].platform),
        "updates": len(steady),
        "steady_duty_cycle": sum(s for _, s in steady) / wall,
        "updates_per_second": len(steady) / wall,
        "mean_step_seconds": float(np.mean([s for _, s in steady])),
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
