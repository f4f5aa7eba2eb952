"""What publishing sharded weights every step costs the learner's step, on CPU: ``Learner.run``
(the real loop: prefetch, train, outbox, the publish decision) with a ``ShardedPublisher`` to a
local directory publishing every version, against the same loop publishing nothing, runs
alternated so load drift hits both. The source is in-process (always full, no buffer process),
so the difference is the publish alone: the copy program, the flag agreement, and the outbox
thread's device-to-host copies, crc32 and writes competing with training for these cores.

    .venv/bin/python benchmarks/publish_step.py [--steps 12] [--repeats 3]

Reported: seconds per step both ways, their ratio, and how many versions were published (the
rest were skipped because the previous publish was still running: the learner never waits).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from learner_duty import episodes_for
from stoker.buffer.client import SampledBatch, SampledGroup
from stoker.distributed import Processes
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import tiny_spec
from stoker.weights.publish import ShardedPublisher
from stoker.spec import TransformerConfig

CONFIG = TransformerConfig(vocab_size=8192, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=4, intermediate_size=1408)
GROUPS, GROUP_SIZE = 2, 4


class FullSource:
    """Always a batch ready, sampled by the learner's current version (never stale: every step
    trains, whatever was published)."""

    def __init__(self, learner: Learner) -> None:
        self.rng = np.random.default_rng(0)
        self.learner = learner
        self.version = 0

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
        groups = [SampledGroup(uuid.uuid4().hex, False, episodes_for(self.learner.version, self.rng, GROUP_SIZE, CONFIG.vocab_size))
                  for _ in range(max_groups)]
        for group in groups:
            for episode in group.episodes:
                episode.group_id = group.group_id
        return SampledBatch(uuid.uuid4().hex, groups, self.learner.version)

    def commit(self, batch_id: str) -> None:
        pass

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        self.version = version


class Counting(ShardedPublisher):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.versions: list[int] = []

    def publish(self, version: int, model: Any) -> Any:
        self.versions.append(version)
        return super().publish(version, model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = tiny_spec(
        model={"architecture": CONFIG}, algorithm={"learningRate": 1e-4}, buffer={"groupSize": GROUP_SIZE},
        learner={"sequenceBuckets": [160], "microbatchTokens": 640, "batchGroups": GROUPS, "publishIntervalSteps": 1},
    )
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))
    mb = sum(np.asarray(v).nbytes for v in learner.flat_weights().values()) / 1e6
    never, every, published = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        learner.run(FullSource(learner), None, max_steps=learner.steps + 2)  # compile
        for repeat in range(args.repeats + 1):
            start, first = time.perf_counter(), learner.steps
            learner.run(FullSource(learner), None, max_steps=first + args.steps)
            never_s = (time.perf_counter() - start) / args.steps
            with Counting(directory=str(Path(tmp) / f"w{repeat}"), processes=Processes(), keep=2) as publisher:
                start, first = time.perf_counter(), learner.version
                learner.run(FullSource(learner), publisher, max_steps=learner.steps + args.steps)
                assert learner.version == first + args.steps, "a step did not train"
                every_s = (time.perf_counter() - start) / args.steps
                staged = [v for v in publisher.versions if v > first]
            if repeat:  # the first round warms the publish path's programs
                never.append(never_s)
                every.append(every_s)
                published.append(len(staged))
    learner.close()
    n, e = statistics.median(never), statistics.median(every)
    print("| model MB | steps | s/step, never publishing | s/step, publishing every step | ratio | versions published / steps |")
    print("|---|---|---|---|---|---|")
    print(f"| {mb:.1f} | {args.steps} | {n:.3f} | {e:.3f} | {e / n:.2f} | {statistics.median(published):.0f} / {args.steps} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
