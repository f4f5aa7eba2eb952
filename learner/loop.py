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

Host-side preparation of one update (advantages, which flat groups train) is in
``stoker.learner.batches``; the buffer loop (prefetch, commits, publishing, and the one logical
learner over several JAX processes) in ``stoker.learner.driver``.

A batch without any update still counts as a step (``steps`` counts batches consumed, ``version``
counts updates), so ``maxSteps`` ends a run whose policy has nothing left to learn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.learner import algorithms, packing
from stoker.learner.algorithms import LossConfig
from stoker.learner.lora import LoraConfig
from stoker.learner.optimizer import OptimizerConfig, learning_rate_schedule
from stoker.learner.batches import (  # noqa: F401 - Group, DatasetError, load_dpo_pairs: the loop's API
    DatasetError,
    Group,
    GroupLike,
    Prepared,
    load_dpo_pairs,
    prepare_groups,
)
from stoker.learner.packing import TrainSequence
from stoker.spec import RLJobSpec, TransformerConfig

if TYPE_CHECKING:
    from stoker.learner.driver import BatchSource, Publisher

log = logging.getLogger(__name__)

# How many versions behind the learner the buffer's view may be when it checks a batch's staleness:
# one batch trains while the next is fetched, and one version report may still be in flight. A
# trained token lags at most maxStaleness + this (see train_on).
SAMPLE_LAG_VERSIONS = 2


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class LearnerSettings:
    """Everything the learner reads from the RLJob, resolved (paths against ``run_dir``)."""

    architecture: TransformerConfig = field(default_factory=TransformerConfig)
    dtype: str = "float32"  # spec.model.dtype: the compute dtype
    weight_dtype: str = "float32"  # spec.learner.weightDtype: the trained (master) weights
    model_checkpoint: str | None = None  # Hugging Face-format directory; random init when None
    remat: str = "full"  # spec.model.remat
    attention: str = "auto"  # spec.model.attention, resolved against the backend by the Learner
    seed: int = 0
    algorithm: str = "grpo"
    loss: LossConfig = LossConfig()
    loss_aggregation: str = "token-mean"
    learning_rate: float = 3e-3
    max_grad_norm: float = 1.0
    optimizer: OptimizerConfig = OptimizerConfig()  # schedule and weight decay
    advantage_normalization: algorithms.AdvantageNormalization = "population-std"  # group_advantages
    temperature: float = 1.0
    top_k: int = 0  # spec.actors.sampling.topK: trained under the distribution the actors sample
    min_p: float = 0.0
    dpo_dataset: str | None = None
    buckets: tuple[int, ...] = (128, 256, 512, 1024)
    microbatch_tokens: int = 4096
    mesh_fsdp: int = -1
    mesh_tp: int = 1
    sequence_sharding: bool = False  # spec.learner.mesh.sequenceSharding
    batch_groups: int = 4
    group_size: int = 8
    max_staleness: int = 4
    checkpoint_dir: str | None = None  # None disables checkpointing
    checkpoint_interval: int = 50
    checkpoint_keep: int = 3
    publish_interval: int = 1
    max_steps: int = 500
    compilation_cache_dir: str | None = None
    run_dir: str | None = None
    sample_timeout_s: float = 5.0
    allowed_token_ids: tuple[int, ...] | None = None  # constrained decoding, as the actors sample
    # SFT (spec.algorithm.sft): the dataset paths as written (relative ones against the working
    # directory, like environment.tasks), and the job for its tokenizer and chat template.
    sft_dataset: str | None = None
    sft_eval_dataset: str | None = None
    sft_eval_fraction: float = 0.0
    sft_loss_on: str = "assistant"
    eval_interval: int = 10
    spec: RLJobSpec | None = None
    lora: LoraConfig | None = None  # spec.model.lora: adapters on a frozen base
    teacher_checkpoint: str | None = None  # spec.algorithm.teacher.checkpoint (distill)

    @classmethod
    def from_spec(cls, spec: RLJobSpec, *, run_dir: str | Path | None = None, **overrides: Any) -> LearnerSettings:
        """Settings for ``spec``; relative paths resolve against ``run_dir`` (the cwd when None)."""
        base = Path(run_dir) if run_dir is not None else Path.cwd()

        def resolve(path: str | None) -> str | None:
            if path is None or "://" in path:
                return path
            return str(base / path)

        learner, algorithm = spec.learner, spec.algorithm
        settings = cls(
            architecture=spec.model.architecture,
            dtype=spec.model.dtype,
            weight_dtype=learner.weight_dtype,
            model_checkpoint=spec.model.checkpoint,
            remat=spec.model.remat,
            attention=spec.model.attention,
            seed=spec.seed,
            algorithm=str(algorithm.name),
            loss=LossConfig(
                clip_low=algorithm.clip_epsilon,
                clip_high=algorithm.clip_epsilon_high or algorithm.clip_epsilon,
                off_policy=algorithm.off_policy_correction,
                importance_cap=algorithm.importance_cap,
                dual_clip=algorithm.dual_clip,
                kl_coef=algorithm.kl_coef,
                entropy_coef=algorithm.entropy_coef,
                value_coef=algorithm.value_coef,
                gamma=algorithm.gamma,
                gae_lambda=algorithm.gae_lambda,
                dpo_beta=algorithm.dpo_beta,
                divergence="reverse_kl" if algorithm.teacher is None else algorithm.teacher.divergence,
                jsd_beta=0.5 if algorithm.teacher is None else algorithm.teacher.beta,
            ),
            loss_aggregation=algorithm.loss_aggregation,
            learning_rate=algorithm.learning_rate,
            max_grad_norm=algorithm.max_grad_norm,
            optimizer=OptimizerConfig.from_spec(algorithm, learner.max_steps, learner.optimizer_state_dtype),
            advantage_normalization=algorithm.advantage_normalization,
            temperature=spec.actors.sampling.temperature,
            top_k=spec.actors.sampling.top_k,
            min_p=spec.actors.sampling.min_p,
            dpo_dataset=resolve(algorithm.dpo_dataset),
            buckets=tuple(learner.sequence_buckets),
            microbatch_tokens=learner.microbatch_tokens or 4 * max(learner.sequence_buckets),
            mesh_fsdp=learner.mesh.fsdp,
            mesh_tp=learner.mesh.tp,
            sequence_sharding=learner.mesh.sequence_sharding,
            batch_groups=learner.batch_groups,
            group_size=spec.buffer.group_size,
            max_staleness=spec.buffer.max_staleness,
            checkpoint_dir=resolve(learner.checkpoint.dir),
            checkpoint_interval=learner.checkpoint.interval_steps,
            checkpoint_keep=learner.checkpoint.keep,
            publish_interval=learner.publish_interval_steps,
            max_steps=learner.max_steps,
            compilation_cache_dir=resolve(learner.compilation_cache_dir),
            run_dir=str(base),
            allowed_token_ids=_allowed_token_ids(spec),
            spec=spec,
            teacher_checkpoint=algorithm.teacher.checkpoint if algorithm.teacher is not None else None,
            lora=None if spec.model.lora is None else LoraConfig(
                spec.model.lora.rank, spec.model.lora.alpha, tuple(spec.model.lora.targets), spec.model.lora.dropout,
                seed=spec.seed,
            ),
        )
        if algorithm.sft is not None and algorithm.name == "sft":
            sft = algorithm.sft
            settings = settings.replace(
                sft_dataset=sft.dataset, sft_eval_dataset=sft.eval_dataset, sft_eval_fraction=sft.eval_fraction,
                sft_loss_on=sft.loss_on, eval_interval=sft.eval_interval_steps,
                # The data's own tokens, unrestricted and untempered: no sampler to match.
                temperature=1.0, allowed_token_ids=None,
            )
        return settings.replace(**overrides) if overrides else settings

    def replace(self, **changes: Any) -> LearnerSettings:
        import dataclasses

        return dataclasses.replace(self, **changes)


def _allowed_token_ids(spec: RLJobSpec) -> tuple[int, ...] | None:
    """The constrained-decoding token ids, resolved with the job's tokenizer as the actors do."""
    if spec.actors.sampling.allowed_tokens is None:
        return None
    # The tokenizer is the environment's (the actor owns it); only this one function is shared.
    from stoker.actor.tokenization import allowed_token_ids

    return allowed_token_ids(spec)


# ------------------------------------------------------------------------------------ learner


class Learner:
    """The trainer plus policy version, checkpoints, compile and duty-cycle accounting."""

    def __init__(self, settings: LearnerSettings, *, mesh: Any = None, resume: bool = True):
        import functools

        import jax

        from stoker.learner import metrics, sharding, step, train, value_network
        from stoker.model import hf
        from stoker.learner.checkpoint import Checkpointer
        from stoker.model.attention_kernels import detect_backend, select_attention
        from stoker.model.model import head_dim, init_model

        self.settings = settings
        metrics.enable_compilation_cache(settings.compilation_cache_dir)
        self.compiles = metrics.CompileCounter.install()
        self.mesh = mesh if mesh is not None else sharding.make_mesh(settings.mesh_fsdp, settings.mesh_tp)
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
            remat=settings.remat,  # type: ignore[arg-type]  # a RematPolicy, checked by the spec
            attention=kernel.implementation, lora=settings.lora, sequence_sharding=settings.sequence_sharding,
        )
        value_model = None
        if options.needs_value:
            value_model = value_network.init_value_network(model.config, settings.seed + 1, dtype, placement=placement)
        teacher = None
        if options.needs_teacher:
            from stoker.learner.teacher import TeacherError, load_teacher

            if settings.teacher_checkpoint is None or settings.spec is None:
                raise TeacherError("algorithm.teacher.checkpoint: missing (distill needs a teacher)")
            teacher = load_teacher(settings.spec, settings.teacher_checkpoint, dtype, model.config.vocab_size)
        optimizer = train.make_optimizer(settings.learning_rate, settings.max_grad_norm, settings.optimizer)
        schedule = learning_rate_schedule(settings.learning_rate, settings.optimizer)
        if settings.weight_dtype != "float32":
            log.warning("learner.weightDtype %s: an update smaller than about |w| x 2^-9 rounds away (at learning "
                        "rate %g, on every weight above %.2g)", settings.weight_dtype, settings.learning_rate,
                        settings.learning_rate * 2**9)
        self.trainer = train.Trainer(
            model, options, optimizer, self.mesh, value_model=value_model, schedule=schedule, teacher_model=teacher,
            weight_dtype=hf.dtype_from_name(settings.weight_dtype),
        )
        self.rows = packing.rows_for_buckets(
            settings.buckets, settings.microbatch_tokens, sharding.data_parallel_size(self.mesh)
        )
        self.version = 0  # the policy version of the current parameters
        self.steps = 0
        self.rng = np.asarray(jax.random.key_data(jax.random.key(settings.seed)), np.uint32)
        self.busy_seconds = 0.0
        self._best_rewards: dict[str, float] = {}  # task id -> best group reward seen (prepare_groups)
        self.checkpointer = (
            Checkpointer(settings.checkpoint_dir, keep=settings.checkpoint_keep) if settings.checkpoint_dir else None
        )
        self._saved_step = -1
        self.sft_data = None
        if settings.algorithm == "sft":
            from stoker.learner.sft import settings_sft_data

            self.sft_data = settings_sft_data(settings, model.config.vocab_size)
            log.info("SFT: %d conversations to train on, %d held out", len(self.sft_data.train), len(self.sft_data.eval))
        self.resumed = bool(resume and self.restore())

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
        from stoker.learner.step import assign_weights

        longest = max(self.settings.buckets)
        items = [[packing.truncate(seq, longest)] for seq in sequences]
        micros = packing.pack(items, self.settings.buckets, self.rows)
        assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
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
        from stoker.learner.step import assign_weights

        assign_weights(micros, trainable, s.loss_aggregation)
        sums = self.trainer.step(micros, self.version, num_pairs=prepared.num_pairs)
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
        sampler's layout, never gathered on the host (``stoker.model.shards.DeviceWeights``)."""
        from stoker.model.shards import DeviceWeights

        return DeviceWeights(self.trainer.policy_model(self.trainer.policy_copy()))

    def flat_weights(self, params: Any = None) -> dict[str, np.ndarray]:
        """The policy's parameters -- the current ones, or a ``Trainer.policy_copy`` -- as Hugging
        Face-named host arrays (what actors load)."""
        from stoker.model.weights import flatten_params

        return flatten_params(self.trainer.policy_model(params))

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the current step (asynchronously unless ``wait``); once per step."""
        if self.checkpointer is None or self._saved_step == self.steps:
            return
        self._saved_step = self.steps
        job = {"architecture": self.model_config.model_dump(by_alias=True, mode="json")}
        if self.settings.spec is not None:  # what `stoker export` of the checkpoint directory reads
            job["spec"] = self.settings.spec.model_dump(by_alias=True, mode="json")
        self.checkpointer.save(
            self.steps, self.trainer.params, self.trainer.opt_state, version=self.version, rng=self.rng, job=job
        )
        if self.settings.lora is not None and self.settings.run_dir:
            self._write_adapter()
        if wait:
            self.checkpointer.wait()

    def _write_adapter(self) -> None:
        """The LoRA adapters as a PEFT directory, ``RUN_DIR/adapter`` (``stoker.learner.peft``),
        beside each checkpoint: ``stoker export`` copies it. Every process gathers; the primary writes."""
        import jax

        from stoker.learner import multihost
        from stoker.learner.peft import ADAPTER_DIR, write_adapter

        assert self.settings.lora is not None and self.settings.run_dir is not None
        processes = multihost.Processes.current()
        adapters = self.trainer.params["lora"]
        if processes.multi:
            adapters = multihost.replicate(processes, adapters, self.mesh)
        if processes.primary:
            write_adapter(
                Path(self.settings.run_dir) / ADAPTER_DIR, jax.device_get(adapters), self.settings.lora,
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
        self._saved_step = restored.step
        log.info("resumed from checkpoint step %d, policy version %d", self.steps, self.version)
        return True

    def close(self) -> None:
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
        from stoker.learner.driver import RunLoop
        from stoker.learner.multihost import Processes

        limit = self.settings.max_steps if max_steps is None else max_steps
        loop = RunLoop(self, source, publisher, sink, stop or threading.Event(), Processes.current())
        return loop.run(limit)
