"""The learner's whole step at a manifest's real size, as a run takes it (issue 51, items 2-3).

    python3 benchmarks/real_step.py MANIFEST [--steps 4] [--json OUT.json]

``stoker bench`` times each program alone, with only its own arguments in memory; this builds the
manifest's ``Learner`` (real float weights, the optimizer state, the remat ``model.remat`` asks
for, ``auto`` decided as the learner decides it), holds a publish copy as the run loop does, and
trains ``--steps`` batches of ``batchGroups x groupSize`` synthetic episodes filling the longest
bucket (so a step is several micro-batches: the gradient sum lives beside each). Prints one JSON
line: the remat chosen, each step's seconds, the median step's MFU over the chip's published peak,
and the device's peak bytes in use against its limit -- what the plan's memory total predicts.
Meant for the lent TPU (``benchmarks/chip.sh step``); on the CPU MFU is null.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.manifest import load_job
from stoker.sizing.chips import chip_of_device
from stoker.model.flops import train_flops
from stoker.trajectory import Episode


def synthetic_groups(groups: int, size: int, length: int, vocab: int, version: int,
                     rng: np.random.Generator) -> list[Group]:
    """``groups`` groups of ``size`` episodes of ``length`` tokens sampled at ``version``, a
    quarter of each prompt, rewards spread within each group (every episode trains)."""
    out = []
    for g in range(groups):
        episodes = []
        for i in range(size):
            mask = np.ones(length, np.uint8)
            mask[: length // 4] = 0
            episodes.append(Episode(
                episode_id=f"e{g}-{i}", group_id=f"g{g}", group_size=size, task_id="t",
                token_ids=rng.integers(0, vocab, length).astype(np.int32), loss_mask=mask,
                logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                policy_versions=np.where(mask == 1, version, -1).astype(np.int32), reward=float(i % 2), actor_id="a",
            ))
        out.append(Group(episodes))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # where a slow start goes
    spec = load_job(args.manifest).spec
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        settings = LearnerSettings.from_spec(spec, run_dir=run_dir, max_steps=args.steps + 1, checkpoint_dir=None)
        learner = Learner(settings, resume=False)
        built = time.perf_counter() - started
        config = learner.model_config
        length = max(settings.buckets)
        rng = np.random.default_rng(0)
        published = learner.trainer.policy_copy()  # what the publisher holds while steps go on
        seconds, micro_batches = [], 0
        for _ in range(args.steps + 1):  # the first compiles
            groups = synthetic_groups(settings.batch_groups, spec.buffer.group_size, length, config.vocab_size,
                                      learner.version, rng)
            begun = time.perf_counter()
            metrics = learner.train_on(groups)
            jax.block_until_ready(learner.trainer.params)
            seconds.append(time.perf_counter() - begun)
            micro_batches = int(metrics.get("microbatches", 0))
        del published
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    median = statistics.median(seconds[1:])
    flops = micro_batches * train_flops(config, learner.rows[length], length)
    chip = chip_of_device(device.device_kind)
    result = {
        "manifest": args.manifest.stem, "device": device.device_kind, "remat": learner.remat.line,
        "built_s": round(built, 1), "first_step_s": round(seconds[0], 2), "step_s": [round(s, 4) for s in seconds[1:]],
        "median_step_s": round(median, 4), "micro_batches": micro_batches,
        "mfu": flops / (median * chip.peak_bf16_flops) if chip is not None else None,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
    }
    print(json.dumps(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
