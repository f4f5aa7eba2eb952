"""The learner's first steps with and without its programs compiled ahead (learner/precompile.py).

Each mode runs in a fresh process with an empty compilation cache: the example's learner (its model
and buckets) trains one batch of the shortest bucket, then one that needs the longest. "ahead"
first lets the background thread compile every bucket, as it does while a real learner waits for
its first batch (the time it took is printed beside), so the steps read their programs back from
the cache; "lazy" compiles each when first needed, as the learner did before.

    .venv/bin/python benchmarks/compile_ahead.py [--manifest examples/frozenlake.yaml] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from local_runs import REPO
from stuck_loss_cost import group


def one_mode(manifest: Path, mode: str) -> dict[str, float]:
    import yaml

    from stoker.learner import precompile
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.spec import RLJob

    job = RLJob.model_validate(yaml.safe_load(manifest.read_text()))
    cache = tempfile.mkdtemp(prefix="compile-ahead-")
    settings = LearnerSettings.from_spec(job.spec, checkpoint_dir=None)
    settings = dataclasses.replace(settings, compilation_cache_dir=cache)
    learner = Learner(settings, resume=False)
    figures: dict[str, float] = {}
    if mode == "ahead" and learner._precompile is None:  # the CPU: started here as on an accelerator
        learner._precompile = precompile.AheadOfTime(learner.trainer, learner.rows).start()
    if learner._precompile is not None:
        started = time.perf_counter()
        learner._precompile.wait_for(learner.rows)
        figures["ahead_seconds"] = time.perf_counter() - started
    rng = np.random.default_rng(0)
    vocab, groups, size = job.spec.model.architecture.vocab_size, job.spec.learner.batch_groups, job.spec.buffer.group_size
    short, long = min(learner.rows), max(learner.rows)
    rewards = [float(j % 2) for j in range(size)]
    for name, length in (("first_step_seconds", short - 8), ("long_bucket_step_seconds", long - 8)):
        batch = [group("t", rewards, length, vocab, rng) for _ in range(groups)]
        started = time.perf_counter()
        learner.train_on(batch)
        figures[name] = time.perf_counter() - started
    learner.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", choices=["ahead", "lazy"], help=argparse.SUPPRESS)  # a child's mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_mode(args.manifest, args.one)))
        return 0
    print("| mode | compiled ahead (s) | first step (s) | first step of the longest bucket (s) |")
    print("|---|---|---|---|")
    for _ in range(args.repeats):  # alternated: a shared machine's load falls on both
        for mode in ("lazy", "ahead"):
            out = subprocess.run(
                [sys.executable, __file__, "--manifest", str(args.manifest), "--one", mode],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            f = json.loads(out)
            ahead = f"{f['ahead_seconds']:.2f}" if "ahead_seconds" in f else "–"
            print(f"| {mode} | {ahead} | {f['first_step_seconds']:.2f} | {f['long_bucket_step_seconds']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
