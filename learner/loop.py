"""The learner: ``Learner.train_on(groups)`` for one update, ``Learner.run`` for the buffer loop.

``train_on`` is everything one update needs and nothing about where data comes from, so the local
runner can call it in-process for a synchronous baseline::

    learner = Learner(LearnerSettings.from_spec(spec, run_dir="run"))
    metrics = learner.train_on(groups)      # groups: .episodes (list[Episode]) and .masked
    flat = learner.flat_weights()           # Hugging Face-named arrays for the actors' sampler

``run`` is the disaggregated loop: sample a batch of complete groups from the buffer, train,
commit the batch, bump the policy version, publish weights every k steps and report the version to
the buffer, checkpoint every n steps; on start it resumes from the latest checkpoint, so the version
continues monotonically after a kill.

The settings (the spec, read the learner's way) are in ``stoker.learner.settings``; host-side
preparation of one update (advantages, which flat groups train) in ``stoker.learner.batches``
(``Group``); the buffer loop (prefetch, commits, publishing, and the one logical
learner over several JAX processes) in ``stoker.learner.driver``.

A batch without any update still counts as a step (``steps`` counts batches consumed, ``version``
counts updates), so ``maxSteps`` ends a run whose policy has nothing left to learn.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from stoker.compilation_cache import enable_compilation_cache
from stoker.distributed import Processes
from stoker.learner.checkpoint_schedule import CheckpointSchedule
from stoker.learner import (
    algorithms, metrics, multihost, packing, precompile, remat, sharding, step, train, value_network,
)
from stoker.learner.batches import GroupLike, Prepared, prepare_groups
from stoker.learner.checkpoint import Checkpointer
from stoker.learner.driver import BatchSource, Publisher, RunLoop
from stoker.learner.optimizer import learning_rate_schedule
from stoker.learner.packing import TrainSequence
from stoker.learner.peft import ADAPTER_DIR, write_adapter
from stoker.learner.settings import LearnerSettings
from stoker.learner.sft import job_sft_data
from stoker.learner.teacher import TeacherError, load_teacher
from stoker.model import hf
from stoker.model.attention_kernels import detect_backend, select_attention
from stoker.model.layers import head_dim
from stoker.model.model import RematPolicy, init_model
from stoker.weights.channel import flatten_params
from stoker.weights.shards import DeviceWeights

log = logging.getLogger(__name__)

# How many versions behind the learner the buffer's view may be when it checks a batch's staleness:
# one batch trains while the next is fetched, and one version report may still be in flight. A
# trained token lags at most maxStaleness + this (see train_on).
SAMPLE_LAG_VERSIONS = 2


# ------------------------------------------------------------------------------------ learner


class Learner:
    """The trainer plus policy version, checkpoints, compile and duty-cycle accounting."""

    def __init__(self, settings: LearnerSettings, *, mesh: Any = None, resume: bool = True):
        self.settings = settings
        enable_compilation_cache(settings.compilation_cache_dir)
        self.compiles = metrics.CompileCounter.install()
        self.mesh = mesh if mesh is not None else sharding.make_mesh(settings.mesh_fsdp, settings.mesh_tp, ep=settings.mesh_ep)
        dtype = hf.dtype_from_name(settings.dtype)
        # Straight into the training layout: no device ever holds the whole model.
        placement = functools.partial(sharding.param_sharding, mesh=self.mesh)
        if settings.model_checkpoint:
            model = hf.load_checkpoint(settings.model_checkpoint, dtype=dtype, placement=placement)
        else:
            model = init_model(settings.architecture, settings.seed, dtype, placement=placement)
        self.model_config = model.config  # the checkpoint's, when it has one
        kernel = select_attention(
            settings.attention, detect_backend(self.mesh.devices.flat[0]), dtype=dtype, head_dim=head_dim(model.config),
            softcap=model.config.attn_logit_softcap,
        )
        log.info("attention: %s (%s)", kernel.implementation, kernel.reason)
        options = step.StepOptions(
            settings.algorithm, settings.loss, settings.temperature, allowed_token_ids=settings.allowed_token_ids,
            top_k=settings.top_k, min_p=settings.min_p,
            attention=kernel.implementation, lora=settings.lora, sequence_sharding=settings.sequence_sharding,
            expert_capacity_factor=settings.expert_capacity_factor,
        )
        value_model = None
        if options.needs_value:
            value_model = value_network.init_value_network(model.config, settings.seed + 1, dtype, placement=placement)
        teacher = None
        if options.needs_teacher:
            if settings.teacher_checkpoint is None:
                raise TeacherError("algorithm.teacher.checkpoint: missing (distill needs a teacher)")
            teacher = load_teacher(settings.spec, settings.teacher_checkpoint, dtype, model.config.vocab_size)
        optimizer = train.make_optimizer(settings.learning_rate, settings.max_grad_norm, settings.optimizer)
        schedule = learning_rate_schedule(settings.learning_rate, settings.optimizer)
        if settings.weight_dtype != "float32":
            log.warning("learner.weightDtype %s: an update smaller than about |w| x 2^-9 rounds away (at learning "
                        "rate %g, on every weight above %.2g)", settings.weight_dtype, settings.learning_rate,
                        settings.learning_rate * 2**9)
        platform = next(iter(self.mesh.devices.flat)).platform  # "cpu", "tpu", ...
        self.rows = packing.rows_for_buckets(
            settings.buckets, settings.microbatch_tokens_on(platform, model.config),
            sharding.data_parallel_size(self.mesh),
        )

        def trainer(policy: RematPolicy, model: Any, value_model: Any, teacher: Any) -> train.Trainer:
            return train.Trainer(
                model, dataclasses.replace(options, remat=policy), optimizer, self.mesh, value_model=value_model,
                schedule=schedule, teacher_model=teacher, weight_dtype=hf.dtype_from_name(settings.weight_dtype),
            )

        # auto: each policy's step compiled abstractly for this device until one fits (none on the CPU).
        self.remat = remat.learner_remat(settings.remat, self.mesh, self.rows, lambda policy: trainer(
            policy, remat.abstract(model), remat.abstract(value_model), remat.abstract(teacher)))
        log.info("%s", self.remat.line)
        self.trainer = trainer(self.remat.policy, model, value_model, teacher)
        self.version = 0  # the policy version of the current parameters
        self.steps = 0
        self.rng = np.asarray(jax.random.key_data(jax.random.key(settings.seed)), np.uint32)
        self.busy_seconds = 0.0
        self._best_rewards: dict[str, float] = {}  # task id -> best group reward seen (prepare_groups)
        self.checkpointer = (
            Checkpointer(settings.checkpoint_dir, keep=settings.checkpoint_keep) if settings.checkpoint_dir else None
        )
        self._saved_step = -1
        # Adaptive only for one process: every process must call each save (checkpoint_schedule.py).
        self.schedule = CheckpointSchedule(settings.checkpoint_interval, adaptive=Processes.current().count == 1)
        self.sft_data = None
        if settings.algorithm == "sft":
            self.sft_data = job_sft_data(settings.spec, model.config.vocab_size)
            log.info("SFT: %d conversations to train on, %d held out", len(self.sft_data.train), len(self.sft_data.eval))
        self.resumed = bool(resume and self.restore())
        self._precompile = precompile.start(self.trainer, self.rows, platform)

    # ----------------------------------------------------------------------------- training

    def train_on(
        self, groups: Sequence[GroupLike], *, sampled_at: int | None = None, max_staleness: int | None = None
    ) -> dict[str, float]:
        """One update from a batch of groups; returns its metrics (version is then bumped).

        ``sampled_at`` is the policy version the buffer judged the batch's staleness against (the
        Sample response's ``policy_version``). Tokens are dropped as stale against that version, not
        the learner's own: the learner is one or two versions ahead of what the buffer has been told
        (a batch is fetched while the previous one trains, versions are reported in the background),
        and judged against its own version a third of the tokens of groups the buffer had just
        passed were thrown away -- always the first turns of episodes, the oldest tokens -- so
        episodes trained without their opening moves. A buffer further behind than
        ``SAMPLE_LAG_VERSIONS`` is not trusted that far: a trained token never lags more than
        ``maxStaleness + SAMPLE_LAG_VERSIONS``. The staleness metrics count from the learner's own
        version: what a token really lagged when it was trained.

        ``max_staleness`` is the buffer's limit for the batch (the Sample response's), which the
        operator may have changed live since the learner started; None keeps the learner's own.
        """
        prepared = prepare_groups(groups, self.settings.algorithm, self._best_rewards, self.settings.advantage_normalization)
        return self._train_items(prepared, sampled_at, max_staleness)

    def train_on_pairs(self, pairs: Sequence[list[TrainSequence]]) -> dict[str, float]:
        """One DPO update from chosen/rejected pairs (``load_dpo_pairs``)."""
        prepared = Prepared(list(pairs), [], 2 * len(pairs), 0, num_pairs=len(pairs))
        return self._train_items(prepared)

    def train_on_sequences(self, sequences: Sequence[TrainSequence]) -> dict[str, float]:
        """One update from whole sequences trained where their loss mask says (SFT)."""
        prepared = Prepared([[seq] for seq in sequences], [], len(sequences), 0)
        return self._train_items(prepared)

    def evaluate_sequences(self, sequences: Sequence[TrainSequence]) -> dict[str, float]:
        """The mean loss per trained token over ``sequences``, without an update (a held-out split):
        ``eval_loss`` (the NLL per token) and ``eval_tokens``."""
        longest = max(self.settings.buckets)
        items = [[packing.truncate(seq, longest)] for seq in sequences]
        micros = packing.pack(items, self.settings.buckets, self.rows)
        step.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
        sums = self.trainer.evaluate(micros, self.version)
        tokens = sums.get("nll_tokens", 0.0)
        return {"eval_loss": sums.get("nll_sum", 0.0) / max(tokens, 1.0), "eval_tokens": tokens}

    def _train_items(self, prepared: Prepared, sampled_at: int | None = None, max_staleness: int | None = None) -> dict[str, float]:
        started = time.perf_counter()
        s = self.settings
        stale_limit = s.max_staleness if max_staleness is None else max_staleness
        judged_at = self.version
        if sampled_at is not None:
            judged_at = max(self.version - SAMPLE_LAG_VERSIONS, min(self.version, sampled_at))
        longest = max(s.buckets)
        truncated = 0
        items: list[list[TrainSequence]] = []
        for item in prepared.items:
            limit = longest // len(item)
            truncated += sum(len(seq) > limit for seq in item)
            items.append([packing.truncate(seq, limit) for seq in item])
        base: dict[str, float] = {
            "episodes": prepared.episodes,
            "skipped_episodes": prepared.skipped_episodes,
            "zero_signal_groups": prepared.zero_signal_groups,
            "stuck_groups": prepared.stuck_groups,
            "masked_groups": prepared.masked_groups,
            "truncated_sequences": truncated,
            **prepared.episode_metrics,
        }
        if prepared.rewards:
            base["reward_mean"] = float(np.mean(prepared.rewards))
            base["reward_max"] = float(np.max(prepared.rewards))
            base["reward_min"] = float(np.min(prepared.rewards))
        if not items:
            log.warning(
                "batch had nothing to train on: %d episodes, %d failed or empty, %d groups without reward spread",
                prepared.episodes, prepared.skipped_episodes, prepared.zero_signal_groups,
            )
            self.steps += 1  # a step is a batch consumed; the version counts updates
            return {**base, "policy_version": self.version, "step": self.steps, "trained": 0.0}
        micros = packing.pack(items, s.buckets, self.rows)
        trainable, lags, stale = [], [], 0
        for micro in micros:
            a = micro.arrays
            known = a["behaviour_known"] > 0
            too_old = algorithms.stale_tokens(a["versions"], a["mask"], judged_at, stale_limit) & known
            stale += int(too_old.sum())
            m = np.where(too_old, 0.0, a["mask"]).astype(np.float32)
            trainable.append(m)
            lags.append((self.version - a["versions"])[(m > 0) & known])
        if not any(m.any() for m in trainable):
            # Not even a zero-gradient step: Adam's momentum would still move the parameters.
            log.warning("batch skipped: all %d model tokens are past maxStaleness=%d", stale, stale_limit)
            self.steps += 1
            return {**base, "policy_version": self.version, "step": self.steps, "trained": 0.0, "stale_tokens": stale}
        step.assign_weights(micros, trainable, s.loss_aggregation)
        if self._precompile is not None:  # its programs come from the cache, not compiled a second time
            self._precompile.wait_for({micro.shape[1] for micro in micros})
        sums = self.trainer.step(micros, self.version, num_pairs=prepared.num_pairs, updates=s.updates_per_batch)
        applied = not sums["nonfinite_grads"]  # a non-finite gradient: no update (Trainer.step)
        if not applied:
            log.warning("update skipped: a gradient is not finite (%d so far)", sums["nonfinite_updates"])
        self.version += int(applied)
        self.steps += 1
        elapsed = time.perf_counter() - started
        self.busy_seconds += elapsed
        lag = np.concatenate(lags) if lags else np.zeros(0)
        real = sum(m.real_tokens for m in micros)
        out = {
            **base,
            **algorithms.finalize_stats(sums),
            "policy_version": self.version,
            "step": self.steps,
            "trained": float(applied),
            "step_seconds": elapsed,
            "tokens": real,
            "trained_tokens": sums.get("trained_tokens", 0.0),
            "tokens_per_second": real / elapsed if elapsed > 0 else 0.0,
            "padding_waste": packing.padding_waste(micros),
            "microbatches": len(micros),
            "stale_tokens": stale,
            "staleness_mean": float(lag.mean()) if lag.size else 0.0,
            "staleness_max": float(lag.max()) if lag.size else 0.0,
            "compilations": self.compiles.count,
            "compile_seconds": self.compiles.seconds,
            "compile_cache_hits": self.compiles.cache_hits,
            "grad_norm": sums["grad_norm"],
            "nonfinite_updates": sums["nonfinite_updates"],
            **({"learning_rate": sums["learning_rate"]} if "learning_rate" in sums else {}),
        }
        return out

    def device_weights(self) -> Any:
        """A copy of the current policy for a sampler in this process (colocated mode): loaded
        with ``load_hf``/``Sampler.load_weights``, it is resharded device to device into the
        sampler's layout, never gathered on the host (``stoker.weights.shards.DeviceWeights``)."""
        return DeviceWeights(self.trainer.policy_model(self.trainer.policy_copy()))

    def flat_weights(self, params: Any = None) -> dict[str, np.ndarray]:
        """The policy's parameters -- the current ones, or a ``Trainer.policy_copy`` -- as Hugging
        Face-named host arrays (what actors load)."""
        return flatten_params(self.trainer.policy_model(params))

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the current step (asynchronously unless ``wait``); once per step."""
        if self.checkpointer is None or self._saved_step == self.steps:
            return
        self._saved_step = self.steps
        job = {  # what `stoker export` of the checkpoint directory reads
            "architecture": self.model_config.model_dump(by_alias=True, mode="json"),
            "spec": self.settings.spec.model_dump(by_alias=True, mode="json"),
        }
        self.checkpointer.save(
            self.steps, self.trainer.params, self.trainer.opt_state, version=self.version, rng=self.rng, job=job
        )
        self.schedule.started(self.steps)
        if self.settings.lora is not None:
            self._write_adapter()
        if wait:
            self.checkpointer.wait()
            self.schedule.waited(self.steps)

    def checkpoint_if_due(self) -> None:
        """After a step: start a save when the schedule says (``CheckpointSchedule.due``)."""
        if self.checkpointer is not None:
            self.schedule.observe(self.steps, self.checkpointer.in_progress())
            if self.schedule.due(self.steps):
                self.save()

    def before_step(self) -> None:
        """Before a step: wait for the save in flight (or save) when the step would put more than
        ``checkpoint.intervalSteps`` steps past the newest durable checkpoint."""
        if self.checkpointer is None:
            return
        self.schedule.observe(self.steps, self.checkpointer.in_progress())
        if self.schedule.must_wait(self.steps + 1):
            started = time.perf_counter()
            if self.schedule.saving is None:
                self.save(wait=True)
            else:
                self.checkpointer.wait()
                self.schedule.waited(self.steps)
            log.info("waited %.2f s for checkpoint %d: at most %d steps may be past a written one",
                     time.perf_counter() - started, self.schedule.durable, self.schedule.interval)

    def _write_adapter(self) -> None:
        """The LoRA adapters as a PEFT directory, ``RUN_DIR/adapter`` (``stoker.learner.peft``),
        beside each checkpoint: ``stoker export`` copies it. Every process gathers; the primary writes."""
        assert self.settings.lora is not None
        processes = Processes.current()
        adapters = self.trainer.params["lora"]
        if processes.multi:
            adapters = multihost.replicate(processes, adapters, self.mesh)
        if processes.primary:
            write_adapter(
                self.settings.run_dir / ADAPTER_DIR, jax.device_get(adapters), self.settings.lora,
                base_model=self.settings.model_checkpoint, version=self.version,
            )

    def restore(self) -> bool:
        """Load the latest checkpoint if there is one; True when something was restored."""
        if self.checkpointer is None:
            return False
        restored = self.checkpointer.restore(self.trainer.params, self.trainer.opt_state)
        if restored is None:
            return False
        self.trainer.params = restored.params
        self.trainer.opt_state = restored.opt_state
        self.version = restored.version
        self.steps = restored.step
        self.rng = restored.rng
        self._saved_step = self.schedule.durable = restored.step
        log.info("resumed from checkpoint step %d, policy version %d", self.steps, self.version)
        return True

    def close(self) -> None:
        if self._precompile is not None:
            self._precompile.finish()
        if self.checkpointer is not None:
            self.checkpointer.close()

    # ----------------------------------------------------------------------------------- loop

    def run(
        self,
        source: BatchSource | None,
        publisher: Publisher | None = None,
        *,
        max_steps: int | None = None,
        sink: Any = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Train until ``max_steps`` total steps (resumed steps count) or ``stop`` is set
        (``stoker.learner.driver``). Over several JAX processes every process calls it; only the
        primary's ``source``, ``publisher`` and ``sink`` are used.

        Returns the number of updates made by this call."""
        limit = self.settings.max_steps if max_steps is None else max_steps
        loop = RunLoop(self, source, publisher, sink, stop or threading.Event(), Processes.current())
        return loop.run(limit)
