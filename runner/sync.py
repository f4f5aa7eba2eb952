"""``stoker run --mode sync``: the classic synchronous loop, the baseline async is measured against.

Each step: the current policy plays ``learner.batchGroups`` groups of ``buffer.groupSize``
episodes (all concurrently, in the same sandboxes the actors use), the learner trains on exactly
those episodes, and the sampler takes the new weights before the next step. Strictly on-policy:
every token was sampled by the version being trained, so there is no buffer and no staleness.
The learner idles while episodes run; its duty cycle is what the decoupled mode wins back.

Same model, tokenizer, environment, algorithm and metrics as the async mode (``Learner.train_on``
and ``run_group`` are the very functions the learner and actor processes run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import signal
import time
from pathlib import Path
from typing import Any

from stoker.actor.diagnostics import ActorDiagnostics, write_snapshot
from stoker.actor.episode import run_group
from stoker.actor.runner import task_cycle
from stoker.actor.sandbox import close_factory
from stoker.actor.settings import ActorSettings
from stoker.actor.wiring import environment_factory, make_policy
from stoker.conversation.tokenization import text_interface
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.metrics import DutyCycle, MetricsSink
from stoker.learner.samples import attach_samples
from stoker.learner.settings import LearnerSettings
from stoker.model.flops import matmul_params
from stoker.rollout.mesh import rollout_mesh
from stoker.runner import phases
from stoker.runner.local import Outcome, RunOptions, compilation_cache_dir
from stoker.runner.progress import Progress
from stoker.spec import RLJob, RLJobSpec

log = logging.getLogger("stoker.runner.sync")


def run_sync(options: RunOptions) -> Outcome:
    try:
        return asyncio.run(_run(options))
    except KeyboardInterrupt:
        return Outcome(130, f"interrupted; checkpoint kept in {options.run_dir}")


def run_colocated(job: RLJob, manifest: Path, run_dir: Path, max_steps: int | None) -> int:
    """``stoker learner`` in ``mode: colocated`` (the operator's colocated learner pod): this
    loop, on the learner's chips, with plain log lines; its exit status."""
    options = RunOptions(manifest=manifest, job=job, mode="sync", run_dir=run_dir, max_steps=max_steps, live=False)
    outcome = run_sync(options)
    log.info("%s", outcome.message)
    return outcome.exit_code


def episode_settings(spec: RLJobSpec, job: str) -> ActorSettings:
    """The actor settings the loop plays episodes with. It runs a whole batch at once --
    ``learner.batchGroups`` x ``buffer.groupSize`` episodes, not one actor's ``concurrency`` -- so
    the sampler's conversation cache gets a row for each of them (within conversationCacheMiB)."""
    actor = ActorSettings.from_spec(spec, actor_id="sync", job=job)
    return dataclasses.replace(actor, concurrency=spec.learner.batch_groups * spec.buffer.group_size)


def generation_mesh(learner: Learner) -> Any:
    """Where the loop samples: the learner's own chips, tensor parallel (rollout/mesh.py), so
    generation uses the mesh training does; None (one device) on the CPU or a one-chip mesh."""
    devices = list(learner.mesh.devices.flat)
    mesh = rollout_mesh(learner.model_config, devices=devices)
    return mesh if mesh.size > 1 else None


def compile_seconds(learner: Learner) -> float:
    """The process's time tracing, lowering and compiling so far (the sampler's programs too)."""
    return learner.compiles.seconds + learner.compiles.frontend_seconds


def prefilled_tokens(policy: Any) -> int:
    """The prompt tokens the policy's sampler has prefilled (``Sampler.prefilled_tokens``)."""
    return int(getattr(policy.sampler, "prefilled_tokens", 0))


async def _run(options: RunOptions) -> Outcome:
    spec = options.job.spec
    overrides: dict[str, object] = {"compilation_cache_dir": compilation_cache_dir(options)}
    if options.max_steps is not None:
        overrides["max_steps"] = options.max_steps
    settings = LearnerSettings.from_spec(spec, run_dir=options.run_dir, **overrides)
    learner = Learner(settings)
    actor = episode_settings(spec, options.job.metadata.name)
    if actor.evaluation is not None:
        log.warning("environment.evalTasks: actors play evaluation rounds; the sync baseline does not")
    interface = text_interface(spec)
    policy = make_policy(actor, spec.model.dtype, generation_mesh(learner))
    params, device = matmul_params(learner.model_config), learner.mesh.devices.flat[0]
    envs = environment_factory(actor)
    rng = random.Random(spec.seed * 7919 + learner.steps)
    pick_task = task_cycle(actor.tasks, rng)
    deadline = time.monotonic() + options.max_minutes * 60 if options.max_minutes else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    outcome = Outcome(0, "")
    try:
        with Progress(options) as progress, MetricsSink(options.metrics_path) as sink:
            attach_samples(sink, spec, options.run_dir)
            generated = ActorDiagnostics("sync")
            await policy.load_weights(learner.device_weights(), learner.version)
            duty = DutyCycle()
            learner.busy_seconds = 0.0
            while learner.steps < settings.max_steps:
                if stop.is_set():
                    outcome = Outcome(130, f"interrupted; checkpoint kept in {options.run_dir} ({progress.summary()})")
                    break
                if deadline is not None and time.monotonic() > deadline:
                    outcome = Outcome(0, f"stopped after {options.max_minutes} minutes ({progress.summary()})")
                    break
                if options.target_success is not None and progress.reached(options.target_success):
                    outcome = Outcome(0, f"done: success rate reached {options.target_success} ({progress.summary()})")
                    break
                chosen = [pick_task() for _ in range(settings.batch_groups)]
                step_started, busy, prefilled = time.monotonic(), policy.stats.busy_seconds, prefilled_tokens(policy)
                compiling = compile_seconds(learner)
                groups = await asyncio.gather(
                    *(
                        run_group(
                            policy, envs, interface, task, actor.group_size,
                            limits=actor.limits, seed=rng.randrange(1 << 30),
                        )
                        for task in chosen
                    )
                )
                # A group with a failed or timed-out episode is masked, as the buffer would deliver it.
                batch = [Group(episodes, masked=not all(e.ok for e in episodes)) for episodes in groups]
                played = time.monotonic()
                metrics = learner.train_on(batch)
                trained = time.monotonic()
                episodes = [e for group in groups for e in group]
                sink.record_episodes(learner.steps, episodes)
                for reason in generated.add(episodes):
                    log.warning("an episode failed for a new reason (%s); the first such message:\n%s",
                                reason, generated.examples[reason])
                write_snapshot(options.actor_stats_dir / "sync.json", generated.snapshot())
                duty.busy_seconds = learner.busy_seconds
                metrics["duty_cycle"] = duty.value
                if metrics.get("trained"):
                    await policy.load_weights(learner.device_weights(), learner.version)
                weights_loaded = time.monotonic()
                if metrics.get("trained") and learner.steps % settings.checkpoint_interval == 0:
                    learner.save()
                phases.append(options.run_dir, phases.StepPhases(
                    step=learner.steps, wall_seconds=time.monotonic() - step_started,
                    generate_seconds=policy.stats.busy_seconds - busy, play_seconds=played - step_started,
                    train_seconds=trained - played, weights_seconds=weights_loaded - trained,
                    sampled_tokens=float(metrics.get("sampled_tokens") or 0.0),
                    prefilled_tokens=float(prefilled_tokens(policy) - prefilled),
                    trained_tokens=float(metrics.get("tokens") or 0.0) * settings.updates_per_batch,
                    matmul_params=params, device_kind=device.device_kind, devices=learner.mesh.size,
                    compile_seconds=compile_seconds(learner) - compiling,
                ))
                sink.record(metrics)
                progress.refresh()
            else:
                outcome = Outcome(0, f"done: {learner.steps} steps ({progress.summary()})")
    finally:
        learner.save(wait=True)
        learner.close()
        await close_factory(envs)
        await policy.close()
    return outcome
