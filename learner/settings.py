"""The learner's settings: the RLJob spec, read the way the learner needs it.

The spec is the one source of truth. ``LearnerSettings`` holds it, plus only what the spec cannot
say: the run directory and the paths resolved against it, per-process overrides (a stop after
``--max-steps``, no checkpoints for a measurement, a sample timeout), and the allowed token ids,
which need the job's tokenizer and are looked up once. Every other value is a property computed
from the spec, so a setting and the spec can never disagree::

    settings = LearnerSettings.from_spec(spec, run_dir="run")
    settings.buckets          # spec.learner.sequenceBuckets, as a tuple
    settings.loss             # the objective's hyperparameters, from spec.algorithm
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.conversation.tokenization import allowed_token_ids
from stoker.learner.algorithms import AdvantageNormalization, LossConfig
from stoker.learner.lora import LoraConfig
from stoker.learner.optimizer import OptimizerConfig
from stoker.learner.packing import microbatch_tokens
from stoker.spec import AlgorithmName, RLJobSpec, SftSpec, TransformerConfig
from stoker.spec_model import RematSetting


@dataclass(frozen=True)
class LearnerSettings:
    """The spec plus what only this process knows; build it with ``from_spec``."""

    spec: RLJobSpec
    run_dir: Path  # relative paths of the spec resolve against it
    checkpoint_dir: str | None  # spec.learner.checkpoint.dir resolved; None: this process never checkpoints
    dpo_dataset: str | None  # spec.algorithm.dpoDataset resolved
    compilation_cache_dir: str | None  # spec.learner.compilationCacheDir resolved, or the local runner's
    # spec.learner.maxSteps, or the command line's --max-steps: where this process stops. The
    # learning-rate schedule still decays over spec.learner.maxSteps (``optimizer``).
    max_steps: int
    # spec.actors.sampling.allowedTokens as ids of the job's tokenizer (None: unconstrained, and
    # always for SFT): trained under the restriction the actors sample with.
    allowed_token_ids: tuple[int, ...] | None
    sample_timeout_s: float = 5.0  # how long one Sample call waits for a batch

    @classmethod
    def from_spec(cls, spec: RLJobSpec, *, run_dir: str | Path | None = None, **overrides: Any) -> LearnerSettings:
        """Settings for ``spec``; relative paths resolve against ``run_dir`` (the cwd when None).

        ``overrides`` replace the fields above (``checkpoint_dir=None``, ``max_steps=...``); a
        value the spec holds is changed in the spec, never here."""
        base = Path(run_dir) if run_dir is not None else Path.cwd()

        def resolve(path: str | None) -> str | None:
            if path is None or "://" in path:
                return path
            return str(base / path)

        learner = spec.learner
        settings = cls(
            spec=spec,
            run_dir=base,
            checkpoint_dir=resolve(learner.checkpoint.dir),
            dpo_dataset=resolve(spec.algorithm.dpo_dataset),
            compilation_cache_dir=resolve(learner.compilation_cache_dir),
            max_steps=learner.max_steps,
            # SFT trains the data's own tokens, unrestricted: there is no sampler to match.
            allowed_token_ids=None if _sft(spec) is not None else allowed_token_ids(spec),
        )
        return dataclasses.replace(settings, **overrides) if overrides else settings

    # ------------------------------------------------------------------------------ the model

    @property
    def architecture(self) -> TransformerConfig:
        """spec.model.architecture (a checkpoint's own config.json wins, see ``Learner``)."""
        return self.spec.model.architecture

    @property
    def model_checkpoint(self) -> str | None:
        """spec.model.checkpoint: a Hugging Face-format directory; random init when None."""
        return self.spec.model.checkpoint

    @property
    def dtype(self) -> str:
        """spec.model.dtype: what the learner computes, and publishes, in."""
        return self.spec.model.dtype

    @property
    def weight_dtype(self) -> str:
        """spec.learner.weightDtype: the trained (master) weights."""
        return self.spec.learner.weight_dtype

    @property
    def remat(self) -> RematSetting:
        """spec.model.remat; auto is resolved per device by ``stoker.learner.remat``."""
        return self.spec.model.remat

    @property
    def attention(self) -> str:
        """spec.model.attention, resolved against the backend by the ``Learner``."""
        return self.spec.model.attention

    @property
    def lora(self) -> LoraConfig | None:
        """spec.model.lora: adapters on a frozen base (None: every weight trains)."""
        lora = self.spec.model.lora
        if lora is None:
            return None
        return LoraConfig(lora.rank, lora.alpha, tuple(lora.targets), lora.dropout, seed=self.spec.seed)

    @property
    def seed(self) -> int:
        return self.spec.seed

    # -------------------------------------------------------------------------- the objective

    @property
    def algorithm(self) -> str:
        return str(self.spec.algorithm.name)

    @property
    def loss(self) -> LossConfig:
        """The objectives' hyperparameters from spec.algorithm (and its teacher, for distill)."""
        algorithm = self.spec.algorithm
        teacher = algorithm.teacher
        return LossConfig(
            clip_low=algorithm.clip_epsilon,
            clip_high=algorithm.clip_epsilon_high or algorithm.clip_epsilon,
            off_policy=algorithm.off_policy_correction,
            importance_cap=algorithm.importance_cap,
            m2po_budget=algorithm.m2po_budget,
            episode_cap=algorithm.episode_cap,
            dual_clip=algorithm.dual_clip,
            kl_coef=algorithm.kl_coef,
            entropy_coef=algorithm.entropy_coef,
            value_coef=algorithm.value_coef,
            gamma=algorithm.gamma,
            gae_lambda=algorithm.gae_lambda,
            dpo_beta=algorithm.dpo_beta,
            divergence="reverse_kl" if teacher is None else teacher.divergence,
            jsd_beta=0.5 if teacher is None else teacher.beta,
        )

    @property
    def loss_aggregation(self) -> str:
        return self.spec.algorithm.loss_aggregation

    @property
    def updates_per_batch(self) -> int:
        return self.spec.algorithm.updates_per_batch

    @property
    def advantage_normalization(self) -> AdvantageNormalization:
        """How GRPO/GSPO normalise a group's advantages (``batches.prepare_groups``)."""
        return self.spec.algorithm.advantage_normalization

    @property
    def learning_rate(self) -> float:
        """The peak learning rate (``optimizer`` holds the schedule around it)."""
        return self.spec.algorithm.learning_rate

    @property
    def max_grad_norm(self) -> float:
        return self.spec.algorithm.max_grad_norm

    @property
    def optimizer(self) -> OptimizerConfig:
        """The schedule (decaying over spec.learner.maxSteps), weight decay and Adam state dtype."""
        learner = self.spec.learner
        return OptimizerConfig.from_spec(self.spec.algorithm, learner.max_steps, learner.optimizer_state_dtype)

    @property
    def teacher_checkpoint(self) -> str | None:
        """spec.algorithm.teacher.checkpoint: the model distill's student is trained toward."""
        teacher = self.spec.algorithm.teacher
        return None if teacher is None else teacher.checkpoint

    @property
    def sft(self) -> SftSpec | None:
        """spec.algorithm.sft when the algorithm is SFT (its dataset, held-out split, eval interval)."""
        return _sft(self.spec)

    # ---------------------------------------- the distribution the actors sample (trained under)

    @property
    def temperature(self) -> float:
        """spec.actors.sampling.temperature; 1 for SFT, which trains the data, not samples."""
        return 1.0 if self.sft is not None else self.spec.actors.sampling.temperature

    @property
    def top_k(self) -> int:
        return self.spec.actors.sampling.top_k

    @property
    def min_p(self) -> float:
        return self.spec.actors.sampling.min_p

    # ---------------------------------------------------------------- batches, mesh, the loop

    @property
    def buckets(self) -> tuple[int, ...]:
        """spec.learner.sequenceBuckets: the packed row lengths, ascending."""
        return tuple(self.spec.learner.sequence_buckets)

    def microbatch_tokens_on(self, platform: str, config: TransformerConfig | None = None) -> int:
        """Tokens per packed micro-batch on ``platform`` ("cpu", "tpu", ...): ``packing.microbatch_tokens``."""
        return microbatch_tokens(self.spec, platform, config or self.architecture)

    @property
    def mesh_fsdp(self) -> int:
        return self.spec.learner.mesh.fsdp

    @property
    def mesh_tp(self) -> int:
        return self.spec.learner.mesh.tp

    @property
    def mesh_ep(self) -> int:
        return self.spec.learner.mesh.ep

    @property
    def expert_capacity_factor(self) -> float | None:
        return self.spec.learner.mesh.expert_capacity_factor

    @property
    def sequence_sharding(self) -> bool:
        return self.spec.learner.mesh.sequence_sharding

    @property
    def batch_groups(self) -> int:
        """Groups per step (spec.learner.batchGroups); dataset items per step for SFT and DPO."""
        return self.spec.learner.batch_groups

    @property
    def max_staleness(self) -> int:
        """spec.buffer.maxStaleness: the learner's own limit, unless a batch comes with the buffer's."""
        return self.spec.buffer.max_staleness

    @property
    def publish_interval(self) -> int:
        return self.spec.learner.publish_interval_steps

    @property
    def checkpoint_interval(self) -> int:
        return self.spec.learner.checkpoint.interval_steps

    @property
    def checkpoint_keep(self) -> int:
        return self.spec.learner.checkpoint.keep


def _sft(spec: RLJobSpec) -> SftSpec | None:
    """The SFT section when the job trains SFT (without one the learner reports the missing dataset)."""
    return spec.algorithm.sft if spec.algorithm.name == AlgorithmName.SFT else None
