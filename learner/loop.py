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

Host-side preparation of one update: episodes -> advantages (GRPO/GSPO group-relative; PPO's GAE
runs on the device) or DPO pairs -> first-fit-decreasing packing into bucket shapes -> tokens past
``buffer.maxStaleness`` masked out -> aggregation weights over the whole batch -> ``Trainer.step``.

GRPO/GSPO groups whose episodes all scored alike carry no policy gradient. A flat group at its
task's best reward so far is *solved* and is left out (DAPO's dynamic-sampling filter, Yu et al.
2025); a batch of nothing else makes no update at all. Training on them anyway gives a step made of
the entropy bonus and numerical noise that Adam scales up to a full learning-rate step, and
shrinks Adam's second moment so that the next real gradient makes an outsized step: on FrozenLake
a policy that had solved every map then drifted off two of them and never came back.

A flat group *below* its task's best reward is *stuck* -- the policy fails there the same way every
time -- and does train: its episodes share the advantage one of them would have had if one more
sample had reached the best reward again (``stuck_advantages``: -1/sqrt(n) over n episodes, each
-n^-1.5, as the n samples of a deterministic policy are one trajectory), and its tokens train by
unlikelihood (``algorithms.stuck_unlikelihood``: A log(1 - pi(y_t))) instead of the
policy-gradient surrogate. Both obvious pushes vanish exactly when they are needed: on a policy
that has turned deterministic on the failing moves, the entropy bonus's gradient is ~pi log pi and
the policy gradient's is A (1 - pi), both ~0, and Adam, whose second moment still remembers the
large gradients of earlier steps, scales such a gradient to nothing. That is how a 400-step on-policy
FrozenLake run lost a solved map for good: an outsized step knocked it onto one losing path, its
entropy fell to ~0.001, and 100 steps of entropy bonus (then the stuck rule's only push) never
brought it back. The unlikelihood gradient on the failing token's logit is -A pi(y_t), largest on a
saturated policy, and fades once pi(y_t) falls -- by then the group's samples differ and GRPO's own
signal takes over. Counted at full weight per episode (-1/sqrt(n) each), a
stuck group's push was eight coherent copies of one trajectory: in a maxStaleness-4 run its
gradient norm was 12 against the batch's usual 0.5-2, and the next steps broke every map (success
0.75 -> 0.09). The rule cannot change the optimum: a group at its task's best reward is never
stuck, so on a policy that reaches the best reward every time (deterministic environments) it is
inactive. (A stochastic environment can leave a flat group below a lucky best under an optimal
policy; the push then makes the policy explore, and the spread groups that follow pull it back.)
A batch without any update still counts as a step (``steps`` counts batches consumed, ``version``
counts updates), so ``maxSteps`` ends a run whose policy has nothing left to learn.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoker.learner import algorithms, packing
from stoker.learner.algorithms import LossConfig
from stoker.learner.optimizer import OptimizerConfig, learning_rate_schedule
from stoker.learner.packing import TrainSequence
from stoker.learner.outbox import Outbox
from stoker.learner.prefetch import Prefetcher
from stoker.spec import RLJobSpec, TransformerConfig
from stoker.trajectory import Episode

if TYPE_CHECKING:  # the client pulls in grpc; the loop only needs the batch's shape
    from stoker.buffer.client import SampledBatch

log = logging.getLogger(__name__)

# How many versions behind the learner the buffer's view may be when it checks a batch's staleness:
# one batch trains while the next is fetched, and one version report may still be in flight. A
# trained token lags at most maxStaleness + this (see train_on).
SAMPLE_LAG_VERSIONS = 2
# After a stop request, how long the prefetcher and the last commits get to reach the buffer.
STOP_WAIT_SECONDS = 5.0


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class LearnerSettings:
    """Everything the learner reads from the RLJob, resolved (paths against ``run_dir``)."""

    architecture: TransformerConfig = field(default_factory=TransformerConfig)
    dtype: str = "float32"
    model_checkpoint: str | None = None  # Hugging Face-format directory; random init when None
    seed: int = 0
    algorithm: str = "grpo"
    loss: LossConfig = LossConfig()
    loss_aggregation: str = "token-mean"
    learning_rate: float = 3e-3
    max_grad_norm: float = 1.0
    optimizer: OptimizerConfig = OptimizerConfig()  # schedule and weight decay
    advantage_normalization: algorithms.AdvantageNormalization = "population-std"  # group_advantages
    temperature: float = 1.0
    dpo_dataset: str | None = None
    buckets: tuple[int, ...] = (128, 256, 512, 1024)
    microbatch_tokens: int = 4096
    mesh_fsdp: int = -1
    mesh_tp: int = 1
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
            model_checkpoint=spec.model.checkpoint,
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
            ),
            loss_aggregation=algorithm.loss_aggregation,
            learning_rate=algorithm.learning_rate,
            max_grad_norm=algorithm.max_grad_norm,
            optimizer=OptimizerConfig.from_spec(algorithm, learner.max_steps),
            advantage_normalization=algorithm.advantage_normalization,
            temperature=spec.actors.sampling.temperature,
            dpo_dataset=resolve(algorithm.dpo_dataset),
            buckets=tuple(learner.sequence_buckets),
            microbatch_tokens=learner.microbatch_tokens or 4 * max(learner.sequence_buckets),
            mesh_fsdp=learner.mesh.fsdp,
            mesh_tp=learner.mesh.tp,
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


# ---------------------------------------------------------------------------------- data in


class GroupLike(Protocol):
    """What ``train_on`` needs of a group: the buffer client's ``SampledGroup`` and ``Group`` fit."""

    @property
    def episodes(self) -> Sequence[Episode]: ...

    @property
    def masked(self) -> bool: ...


@dataclass
class Group:
    """A group of episodes of one task, for callers that build groups themselves."""

    episodes: list[Episode]
    masked: bool = False


def _trainable(episode: Episode) -> bool:
    return episode.ok and episode.num_tokens > 1 and bool(np.asarray(episode.loss_mask).any())


def _sequence(episode: Episode, *, advantage: float = 0.0, pair_sign: int = 0, stuck: bool = False) -> TrainSequence:
    return TrainSequence(
        token_ids=np.asarray(episode.token_ids, np.int32),
        loss_mask=np.asarray(episode.loss_mask, np.uint8),
        logprobs=np.asarray(episode.logprobs, np.float32),
        versions=np.asarray(episode.policy_versions, np.int32),
        advantage=advantage,
        reward=float(episode.reward),
        pair_sign=pair_sign,
        stuck=stuck,
    )


@dataclass
class Prepared:
    """One batch turned into packable items, plus what the metrics need to know about it."""

    items: list[list[TrainSequence]]
    rewards: list[float]
    episodes: int
    skipped_episodes: int  # failed/empty episodes that never train
    zero_signal_groups: int = 0  # groups whose rewards were all equal (no GRPO signal)
    stuck_groups: int = 0  # of those, the ones below their task's best reward (they train)
    masked_groups: int = 0  # groups holding a failed episode (its ok members still train)
    num_pairs: int = 0
    episode_metrics: dict[str, float] = field(default_factory=dict)


def episode_metric_means(episodes: Sequence[Episode]) -> dict[str, float]:
    """Batch means of what the environments reported (``Episode.metrics``).

    ``success`` becomes ``success_rate`` over *all* episodes (a failed episode did not succeed);
    other keys become ``episode_<key>`` over the episodes that reported them."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for episode in episodes:
        for key, value in episode.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    out = {f"episode_{key}": sums[key] / counts[key] for key in sums if key != "success"}
    if episodes:
        out["success_rate"] = sums.get("success", 0.0) / len(episodes)
    return out


REWARD_TOLERANCE = 1e-6  # relative: group rewards closer than this count as equal


def stuck_advantages(rewards: np.ndarray, best: float) -> np.ndarray:
    """Advantages for a stuck group's episodes (``rewards``, all alike, below ``best``): GRPO's
    group-relative advantage had one more episode reached ``best``, shared by the n episodes

        A_i = (1/n) (r - mean) / std over [r] * n + [best]   =   -1 / (n sqrt(n))

    The n episodes are n copies of the one path a deterministic policy takes, so together they
    weigh as one failure (module docstring). Negative, independent of the reward's units."""
    n = rewards.shape[0]
    with_best = np.concatenate([rewards, [best]]).astype(np.float32)[None, :]
    return np.asarray(algorithms.group_advantages(with_best, np.ones_like(with_best)))[0, :n] / n


def prepare_groups(
    groups: Sequence[GroupLike],
    algorithm: str,
    best_rewards: dict[str, float] | None = None,
    normalization: algorithms.AdvantageNormalization = "population-std",
) -> Prepared:
    """Episodes of the groups -> items to pack, per algorithm (see the module docstring).

    Failed or empty episodes never train; GRPO/GSPO advantages are normalised over a group's
    trainable episodes only (a masked group's failed member is left out, not scored 0).
    ``best_rewards`` (task id -> best group reward so far) tells solved flat groups from stuck ones
    (module docstring) and is updated in place."""
    trainable = [[e for e in g.episodes if _trainable(e)] for g in groups]
    total = sum(len(g.episodes) for g in groups)
    kept = sum(len(t) for t in trainable)
    rewards = [float(e.reward) for t in trainable for e in t]
    prepared = Prepared(
        [], rewards, total, total - kept, masked_groups=sum(bool(g.masked) for g in groups),
        episode_metrics=episode_metric_means([e for g in groups for e in g.episodes]),
    )
    if algorithm in ("grpo", "gspo"):
        width = max((len(t) for t in trainable), default=0)
        if width == 0:
            return prepared
        dense = np.zeros((len(trainable), width), np.float32)
        valid = np.zeros((len(trainable), width), np.float32)
        for i, episodes in enumerate(trainable):
            dense[i, : len(episodes)] = [e.reward for e in episodes]
            valid[i, : len(episodes)] = 1.0
        advantages = algorithms.group_advantages(dense, valid, normalization=normalization)
        best = {} if best_rewards is None else best_rewards
        keep: list[tuple[int, np.ndarray | None]] = []  # (group index, stuck advantages or None)
        for i, episodes in enumerate(trainable):
            if not episodes:
                continue
            task, top = episodes[0].task_id, float(dense[i, : len(episodes)].max())
            # Rewards summed over different paths differ in the last bits; that is not a spread.
            tolerance = REWARD_TOLERANCE * (1.0 + abs(top))
            flat = len(episodes) < 2 or bool(np.ptp(dense[i, : len(episodes)]) <= tolerance)
            prepared.zero_signal_groups += flat
            task_best = best.get(task, top)
            if not flat:
                keep.append((i, None))
            elif top < task_best - tolerance:  # stuck, not solved: pushed off its path (module docstring)
                prepared.stuck_groups += 1
                keep.append((i, stuck_advantages(dense[i, : len(episodes)], task_best)))
            best[task] = max(task_best, top)
        if not keep:
            return prepared  # nothing to learn from: no update at all (module docstring)
        for i, stuck in keep:
            for j, e in enumerate(trainable[i]):
                if stuck is None:
                    prepared.items.append([_sequence(e, advantage=float(advantages[i, j]))])
                else:
                    prepared.items.append([_sequence(e, advantage=float(stuck[j]), stuck=True)])
    elif algorithm == "ppo":
        prepared.items.extend([_sequence(e)] for episodes in trainable for e in episodes)
    elif algorithm == "dpo":
        for episodes in trainable:
            if len(episodes) < 2:
                continue
            ranked = sorted(episodes, key=lambda e: e.reward)
            if ranked[-1].reward == ranked[0].reward:
                prepared.zero_signal_groups += 1
                continue
            prepared.items.append([_sequence(ranked[-1], pair_sign=1), _sequence(ranked[0], pair_sign=-1)])
        prepared.num_pairs = len(prepared.items)
    else:
        raise ValueError(f"algorithm {algorithm!r}; expected grpo, ppo, gspo or dpo")
    return prepared


class DatasetError(ValueError):
    """A DPO dataset file that cannot be read; the message names the line and field."""


def load_dpo_pairs(path: str | Path) -> list[list[TrainSequence]]:
    """Chosen/rejected pairs from a JSONL file, one pair per line::

        {"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}

    Token ids as the policy's tokenizer produces them; the prompt is shared and never trains.
    Each pair becomes two sequences (prompt + response) with no sampler log-probs, so its
    importance weight is 1."""
    pairs: list[list[TrainSequence]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not JSON: {exc.msg}") from exc
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{number}: expected an object with prompt_ids, chosen_ids, rejected_ids")
        fields = {}
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            value = record.get(key)
            if not isinstance(value, list) or not all(isinstance(x, int) and x >= 0 for x in value):
                raise DatasetError(f"{path}:{number}: {key} must be a list of non-negative token ids")
            fields[key] = value
        if not fields["prompt_ids"] or not fields["chosen_ids"] or not fields["rejected_ids"]:
            raise DatasetError(f"{path}:{number}: prompt_ids, chosen_ids and rejected_ids must be non-empty")
        pair = []
        for key, sign in (("chosen_ids", 1), ("rejected_ids", -1)):
            ids = np.asarray(fields["prompt_ids"] + fields[key], np.int32)
            mask = np.zeros(ids.shape, np.uint8)
            mask[len(fields["prompt_ids"]) :] = 1
            pair.append(
                TrainSequence(
                    ids, mask, np.zeros(ids.shape, np.float32), np.full(ids.shape, -1, np.int32),
                    behaviour_known=False, pair_sign=sign,
                )
            )
        pairs.append(pair)
    if not pairs:
        raise DatasetError(f"{path}: no pairs")
    return pairs


# ------------------------------------------------------------------------------------ learner


class BatchSource(Protocol):
    """The buffer as the loop sees it (``stoker.buffer.client.BufferClient`` fits)."""

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch | None: ...

    def commit(self, batch_id: str) -> Any: ...

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> Any: ...


class Publisher(Protocol):
    def publish(self, version: int, flat: Any) -> Any: ...


class Learner:
    """The trainer plus policy version, checkpoints, compile and duty-cycle accounting."""

    def __init__(self, settings: LearnerSettings, *, mesh: Any = None, resume: bool = True):
        import jax
        from flax import nnx

        from stoker.learner import hf, metrics, sharding, train
        from stoker.learner.checkpoint import Checkpointer
        from stoker.learner.model import init_model

        self.settings = settings
        metrics.enable_compilation_cache(settings.compilation_cache_dir)
        self.compiles = metrics.CompileCounter.install()
        self.mesh = mesh if mesh is not None else sharding.make_mesh(settings.mesh_fsdp, settings.mesh_tp)
        dtype = hf.dtype_from_name(settings.dtype)
        if settings.model_checkpoint:
            model = hf.load_checkpoint(settings.model_checkpoint, dtype=dtype)
        else:
            model = init_model(settings.architecture, settings.seed, dtype)
        options = train.StepOptions(
            settings.algorithm, settings.loss, settings.temperature, allowed_token_ids=settings.allowed_token_ids
        )
        value_model = None
        if options.needs_value:
            value_model = train.ValueNetwork(model.config, rngs=nnx.Rngs(params=settings.seed + 1), dtype=dtype)
        optimizer = train.make_optimizer(settings.learning_rate, settings.max_grad_norm, settings.optimizer)
        schedule = learning_rate_schedule(settings.learning_rate, settings.optimizer)
        self.trainer = train.Trainer(model, options, optimizer, self.mesh, value_model=value_model, schedule=schedule)
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
        self._reported_version = -1  # written by the outbox's thread only, once running
        self._copied_version = -1
        self._unpublished: tuple[int, Any] | None = None  # (version, parameters copied for publishing)
        self._unpublished_lock = threading.Lock()
        self.resumed = bool(resume and self.restore())

    # ----------------------------------------------------------------------------- training

    def train_on(self, groups: Sequence[GroupLike], *, sampled_at: int | None = None) -> dict[str, float]:
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
        """
        prepared = prepare_groups(groups, self.settings.algorithm, self._best_rewards, self.settings.advantage_normalization)
        return self._train_items(prepared, sampled_at)

    def train_on_pairs(self, pairs: Sequence[list[TrainSequence]]) -> dict[str, float]:
        """One DPO update from chosen/rejected pairs (``load_dpo_pairs``)."""
        prepared = Prepared(list(pairs), [], 2 * len(pairs), 0, num_pairs=len(pairs))
        return self._train_items(prepared)

    def _train_items(self, prepared: Prepared, sampled_at: int | None = None) -> dict[str, float]:
        started = time.perf_counter()
        s = self.settings
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
            too_old = algorithms.stale_tokens(a["versions"], a["mask"], judged_at, s.max_staleness) & known
            stale += int(too_old.sum())
            m = np.where(too_old, 0.0, a["mask"]).astype(np.float32)
            trainable.append(m)
            lags.append((self.version - a["versions"])[(m > 0) & known])
        if not any(m.any() for m in trainable):
            # Not even a zero-gradient step: Adam's momentum would still move the parameters.
            log.warning("batch skipped: all %d model tokens are past maxStaleness=%d", stale, s.max_staleness)
            self.steps += 1
            return {**base, "policy_version": self.version, "step": self.steps, "trained": 0.0, "stale_tokens": stale}
        from stoker.learner.train import assign_weights

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

    def flat_weights(self, params: Any = None) -> dict[str, np.ndarray]:
        """The policy's parameters -- the current ones, or a ``Trainer.policy_copy`` -- as Hugging
        Face-named host arrays (what actors load)."""
        from stoker.learner.weights import flatten_params

        return flatten_params(self.trainer.policy_model(params))

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the current step (asynchronously unless ``wait``); once per step."""
        if self.checkpointer is None or self._saved_step == self.steps:
            return
        self._saved_step = self.steps
        self.checkpointer.save(
            self.steps, self.trainer.params, self.trainer.opt_state, version=self.version, rng=self.rng
        )
        if wait:
            self.checkpointer.wait()

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

    def _dataset_batches(self) -> Iterator[list[list[TrainSequence]]]:
        """Endless shuffled epochs over the DPO dataset, batch_groups pairs at a time."""
        import jax
        import jax.numpy as jnp

        assert self.settings.dpo_dataset is not None
        pairs = load_dpo_pairs(self.settings.dpo_dataset)
        while True:
            key = jax.random.wrap_key_data(jnp.asarray(self.rng))
            key, sub = jax.random.split(key)
            self.rng = np.asarray(jax.random.key_data(key), np.uint32)
            order = np.asarray(jax.random.permutation(sub, len(pairs)))
            for start in range(0, len(order), self.settings.batch_groups):
                yield [pairs[i] for i in order[start : start + self.settings.batch_groups]]

    def run(
        self,
        source: BatchSource | None,
        publisher: Publisher | None = None,
        *,
        max_steps: int | None = None,
        sink: Any = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Train until ``max_steps`` total steps (resumed steps count) or ``stop`` is set.

        Returns the number of updates made by this call."""
        from stoker.learner.metrics import DutyCycle

        s = self.settings
        limit = s.max_steps if max_steps is None else max_steps
        stop = stop or threading.Event()
        started_at_step = self.steps
        duty = DutyCycle()
        self.busy_seconds = 0.0
        self._skip_reported_versions(source)
        dataset = self._dataset_batches() if s.algorithm == "dpo" and s.dpo_dataset else None
        if dataset is None and source is None:
            raise ValueError("no buffer to sample from (and no DPO dataset)")
        with contextlib.ExitStack() as cleanup:
            # Entered first, so it closes last: every commit and the final weights are sent
            # before run() returns, after the prefetcher has stopped.
            outbox = cleanup.enter_context(Outbox())
            self._publish(outbox, publisher, source)
            prefetcher = None
            if dataset is None:
                assert source is not None
                prefetcher = cleanup.enter_context(
                    Prefetcher(source, max_groups=s.batch_groups, min_groups=s.batch_groups, timeout=s.sample_timeout_s)
                )
            made = self._run_steps(source, publisher, dataset, prefetcher, outbox, limit, stop, duty, sink)
            if made:
                duty.busy_seconds = self.busy_seconds
                self._publish(outbox, publisher, source, duty.value)
            if stop.is_set():
                # Stopped from outside -- maybe because the buffer is gone, when every commit would
                # retry for minutes: checkpoint first (it needs nothing from the buffer), then give
                # the buffer a bounded time. A commit not sent means the batch is trained again.
                if self.steps > started_at_step:
                    self.save()
                if prefetcher is not None:
                    prefetcher.close(wait=STOP_WAIT_SECONDS)
                abandoned = outbox.close(timeout=STOP_WAIT_SECONDS)
                if abandoned:
                    log.warning(
                        "buffer unreachable while stopping: %d commits/version reports not sent after %.0f s "
                        "(their batches are delivered again)", abandoned, STOP_WAIT_SECONDS,
                    )
        if self.steps > started_at_step:  # batches without an update are steps too: resume after them
            self.save()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        return made

    def _run_steps(
        self,
        source: BatchSource | None,
        publisher: Publisher | None,
        dataset: Iterator[list[list[TrainSequence]]] | None,
        prefetcher: Prefetcher | None,
        outbox: Outbox,
        limit: int,
        stop: threading.Event,
        duty: Any,
        sink: Any,
    ) -> int:
        s = self.settings
        made = 0
        while self.steps < limit and not stop.is_set():
            batch_id = None
            if dataset is not None:
                metrics = self.train_on_pairs(next(dataset))
            else:
                assert prefetcher is not None and source is not None
                batch = prefetcher.get()
                if batch is None:
                    if made:
                        duty.busy_seconds = self.busy_seconds
                        outbox.send(functools.partial(self._report_idle, source, duty.value))
                    continue
                batch_id = batch.batch_id
                metrics = self.train_on(batch.groups, sampled_at=batch.policy_version)
            if batch_id is not None and source is not None:
                outbox.send(functools.partial(self._commit, source, batch_id))
            if not metrics.get("trained"):
                if sink is not None:
                    sink.record(metrics)  # its episodes still count toward the success rate
                continue
            made += 1
            duty.busy_seconds = self.busy_seconds
            metrics["duty_cycle"] = duty.value
            if self.steps % s.publish_interval == 0:
                self._publish(outbox, publisher, source, metrics["duty_cycle"])
            if self.steps % s.checkpoint_interval == 0:
                self.save()
            if sink is not None:
                sink.record(metrics)
            log.info(
                "step %d v%d loss %.4f reward %.3f %.0f tok/s duty %.2f",
                self.steps, self.version, metrics.get("loss", 0.0), metrics.get("reward_mean", 0.0),
                metrics["tokens_per_second"], metrics["duty_cycle"],
            )
        return made

    def _skip_reported_versions(self, source: BatchSource | None) -> None:
        """Never hand out a version number twice.

        After a kill the checkpoint may be older than the last version the buffer (and the actors)
        saw; those versions' weights are lost. Numbering on from the checkpoint would give
        different weights an already-used version, so the restored weights take the next unused
        number instead."""
        stats = getattr(source, "stats", None)
        if stats is None:
            return
        reported = int(stats().policy_version)
        if reported > self.version:
            log.warning(
                "checkpoint is at version %d but version %d was already reported; continuing as version %d",
                self.version, reported, reported + 1,
            )
            self.version = reported + 1

    @staticmethod
    def _commit(source: BatchSource, batch_id: str) -> None:
        from stoker.buffer.client import LeaseLostError

        try:
            source.commit(batch_id)
        except LeaseLostError as exc:
            # The lease ran out while we trained; the buffer will hand those groups out again.
            log.warning("commit of batch %s refused (%s); its groups will be delivered again", batch_id, exc)

    def _report_idle(self, source: BatchSource, duty_cycle: float) -> None:
        """Waiting for data: send the falling duty cycle with the version already reported (never
        an unpublished one), or the operator's starvation check would keep seeing the value from
        the last step for as long as the learner is starved."""
        if self._reported_version >= 0:
            source.set_policy_version(self._reported_version, duty_cycle=duty_cycle)

    def _publish(
        self, outbox: Outbox, publisher: Publisher | None, source: BatchSource | None, duty_cycle: float | None = None
    ) -> None:
        """Publish the current version's weights (once per version) and then report it to the
        buffer, with the duty cycle when there is one (not before the first step: the operator would
        read a learner that has not started as a starved one).

        Only the copy of the parameters happens here (the next step donates them); converting,
        writing and reporting run on the outbox's thread, newest version wins."""
        version = self.version
        if publisher is not None and self._copied_version < version:
            copy = self.trainer.policy_copy()
            with self._unpublished_lock:
                self._unpublished, self._copied_version = (version, copy), version

        def publish_and_report() -> None:
            # The newest copy, not necessarily this call's: if publishing fell behind training,
            # actors get the latest weights rather than a backlog of older ones.
            unpublished = self._unpublished
            if unpublished is not None and getattr(publisher, "latest_version", -1) < unpublished[0]:
                assert publisher is not None
                publisher.publish(unpublished[0], self.flat_weights(unpublished[1]))
            with self._unpublished_lock:  # unless a newer copy arrived meanwhile
                if self._unpublished is unpublished:
                    self._unpublished = None  # do not hold a second copy of the weights once published
            if source is not None and self._reported_version != version:
                if duty_cycle is None:
                    source.set_policy_version(version)
                else:
                    source.set_policy_version(version, duty_cycle=duty_cycle)
                self._reported_version = version

        outbox.send(publish_and_report)
