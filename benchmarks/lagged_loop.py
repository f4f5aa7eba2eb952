"""Sample efficiency under a fixed policy lag, in one process: how many learner steps to a target.

The synchronous loop (``runner/sync.py``: the same ``run_group`` episodes, the same
``Learner.train_on``), except that every batch is played by the policy of ``lag`` versions ago,
so every token reaches the loss exactly ``lag`` versions stale. Lag 0 is the synchronous baseline.
This isolates the objective's sample efficiency from the actors' and learner's speeds (which set
the staleness of a real asynchronous run); ``frozenlake_seeds.py`` then checks a choice in the
real loop.

    .venv/bin/python benchmarks/lagged_loop.py [--manifest examples/frozenlake.yaml] [--lags 0 2]
        [--seeds 0 1 2] [--max-steps 300] [--target 0.9] [--jobs 1] [--drop-slowest K]
        [--config NAME=algorithm.offPolicyCorrection=m2po,algorithm.learningRate=0.002 ...]
        [--out runs/bench-lagged]

Each ``--config`` is a named set of spec overrides (``path=value`` joined by commas); with none,
the manifest as it is ("shipped"). Every (config, lag, seed) is one run, ``--jobs`` at a time in
their own processes (JAX on the CPU, one thread each). Prints each run's step at which the rolling
success (10 steps, as ``stoker run --target-success`` judges it) first reached the target, then the
median per config and lag; writes them to ``results.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from local_runs import REPO, set_path
from stoker.actor.episode import run_group
from stoker.actor.runner import task_cycle
from stoker.actor.sandbox import close_factory
from stoker.actor.wiring import environment_factory, make_policy
from stoker.conversation.tokenization import text_interface
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.runner.sync import episode_settings
from stoker.spec import RLJob

WINDOW = 10  # steps in the rolling success rate (runner/progress.py)


async def steps_to_target(
    job: RLJob, lag: int, max_steps: int, target: float, run_dir: Path, tasks: str = "cycle", drop_slowest: int = 0
) -> dict[str, Any]:
    spec = job.spec
    settings = LearnerSettings.from_spec(spec, run_dir=run_dir, max_steps=max_steps, checkpoint_dir=None)
    learner = Learner(settings, resume=False)
    actor = episode_settings(spec, job.metadata.name)
    interface = text_interface(spec)
    policy = make_policy(actor, spec.model.dtype, None)
    envs = environment_factory(actor)
    rng = random.Random(spec.seed * 7919)
    # "random": each group's task drawn independently, as groups from several actors land in an
    # asynchronous batch; "cycle": every task once per batch, as the synchronous loop does.
    pick_task = task_cycle(actor.tasks, rng) if tasks == "cycle" else (lambda: rng.choice(actor.tasks))
    versions = collections.deque([(learner.device_weights(), learner.version)], maxlen=lag + 1)
    recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
    reached = None
    log = (run_dir / "metrics.jsonl").open("w")  # a line per step: a cut-off run still tells
    try:
        await policy.load_weights(*versions[0])
        while learner.steps < max_steps and reached is None:
            chosen = [pick_task() for _ in range(settings.batch_groups + drop_slowest)]
            groups = await asyncio.gather(*(
                run_group(policy, envs, interface, task, actor.group_size, limits=actor.limits, seed=rng.randrange(1 << 30))
                for task in chosen
            ))
            if drop_slowest:  # the asynchronous loop's stale drops: the groups whose longest episode ran longest
                groups = sorted(groups, key=lambda g: (max(e.num_turns for e in g), rng.random()))[: settings.batch_groups]
            metrics = learner.train_on([Group(g, masked=not all(e.ok for e in g)) for g in groups])
            log.write(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}) + "\n")
            log.flush()
            recent.append(float(metrics.get("success_rate", 0.0)))
            if len(recent) == WINDOW and sum(recent) / WINDOW >= target:
                reached = learner.steps
            if metrics.get("trained"):
                versions.append((learner.device_weights(), learner.version))
                await policy.load_weights(*versions[0])  # the oldest kept: `lag` versions back
    finally:
        log.close()
        learner.close()
        await close_factory(envs)
        await policy.close()
    return {"steps_to_target": reached, "steps": learner.steps}


def one_run(
    manifest: Path, overrides: list[str], lag: int, seed: int, max_steps: int, target: float, run_dir: Path, tasks: str,
    drop_slowest: int = 0,
) -> dict[str, Any]:
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["seed"] = seed
    for item in overrides:
        path, _, value = item.partition("=")
        set_path(doc, path, value)
    run_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(steps_to_target(RLJob.model_validate(doc), lag, max_steps, target, run_dir, tasks, drop_slowest))


def _single_threaded() -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--tasks", choices=["cycle", "random"], default="cycle",
                        help="cycle: every task once per batch (the synchronous loop); random: each group's own draw")
    parser.add_argument("--drop-slowest", type=int, default=0, metavar="K",
                        help="play K groups more a step and leave out the K whose longest episode ran longest "
                             "(what the asynchronous loop's stale drops remove)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=PATH=VALUE[,PATH=VALUE]",
                        help="a named set of spec overrides (repeatable)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-lagged")
    args = parser.parse_args()
    configs = {"shipped": []} if not args.config else {}
    for item in args.config:
        name, _, rest = item.partition("=")
        configs[name] = [part for part in rest.split(",") if part]
    runs = [(name, lag, seed) for name in configs for lag in args.lags for seed in args.seeds]
    results: dict[str, dict[str, dict[str, Any]]] = {f"{name} lag {lag}": {} for name in configs for lag in args.lags}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_single_threaded) as pool:
        futures = {
            pool.submit(
                one_run, args.manifest, configs[name], lag, seed, args.max_steps, args.target,
                args.out / f"{name}-lag-{lag}-seed-{seed}", args.tasks, args.drop_slowest,
            ): (name, lag, seed)
            for name, lag, seed in runs
        }
        for future in concurrent.futures.as_completed(futures):
            name, lag, seed = futures[future]
            results[f"{name} lag {lag}"][str(seed)] = result = future.result()
            print(f"{name} lag {lag} seed {seed}: {json.dumps(result)}", flush=True)
    summary = {}
    for key, by_seed in results.items():
        steps = sorted(r["steps_to_target"] if r["steps_to_target"] is not None else float("inf") for r in by_seed.values())
        summary[key] = {"steps": steps, "median": statistics.median(steps)}
        print(f"{key}: steps to {args.target} {steps}, median {statistics.median(steps)}", flush=True)
    (args.out / "results.json").write_text(
        json.dumps({"configs": configs, "summary": summary, "results": results}, indent=2, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
