"""A sampled batch turned into what one update trains on: advantages, packable items, metrics.

Host-side preparation of one update: episodes -> advantages (GRPO/GSPO group-relative; PPO's GAE
runs on the device) or DPO pairs -> first-fit-decreasing packing into bucket shapes -> tokens past
``buffer.maxStaleness`` masked out -> aggregation weights over the whole batch -> ``Trainer.step``.

Flat GRPO/GSPO groups: a *solved* one (at its task's best reward so far) is left out; a *stuck*
one (below it) trains by unlikelihood with ``stuck_advantages``. Why, and the runs that showed it:
docs/architecture.md, "Flat groups: solved and stuck".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stoker.learner import algorithms
from stoker.learner.packing import TrainSequence
from stoker.trajectory import Episode
from stoker.v1 import trajectory_pb2

TRUNCATED = trajectory_pb2.EPISODE_STATUS_TRUNCATED
FAILED = (trajectory_pb2.EPISODE_STATUS_FAILED, trajectory_pb2.EPISODE_STATUS_TIMEOUT)



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
    # A non-finite reward is a failed episode (actors already report it so): it would turn its
    # group's advantages and its task's best reward into NaN for good.
    return (
        episode.ok
        and math.isfinite(episode.reward)
        and episode.num_tokens > 1
        and bool(np.asarray(episode.loss_mask).any())
    )


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
            if not math.isfinite(value):
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    out = {f"episode_{key}": sums[key] / counts[key] for key in sums if key != "success"}
    if episodes:
        out["success_rate"] = sums.get("success", 0.0) / len(episodes)
    return out


def generation_figures(episodes: Sequence[Episode], now: float | None = None) -> dict[str, float]:
    """What the batch's episodes generated, whether or not they train: ``sampled_tokens`` (model
    tokens of every episode; ``trained_tokens`` leaves out the groups without signal), the mean
    completion length per episode and per model turn, and the share of truncated episodes. With
    the episodes' clock times, the loop's latency: ``group_seconds``, a group's first episode's
    start to its last one's end, and ``group_wait_seconds``, that end to ``now`` (the batch's
    training), each the mean over groups. (Actor clocks: skew between hosts shows in the wait.)"""
    if not episodes:
        return {}
    timing = group_timing(episodes, time.time() if now is None else now)
    sampled = [int(np.asarray(e.loss_mask).sum()) for e in episodes]
    turns = sum(int(e.num_turns) for e in episodes)
    truncated = sum(int(e.status) == TRUNCATED for e in episodes)
    return {
        "sampled_tokens": float(sum(sampled)),
        "completion_tokens_mean": sum(sampled) / len(episodes),
        "turn_tokens_mean": sum(sampled) / turns if turns else 0.0,
        "turns_mean": turns / len(episodes),
        "truncation_rate": truncated / len(episodes),
        "failed_episodes": float(sum(int(e.status) in FAILED for e in episodes)),
        **timing,
    }


def group_timing(episodes: Sequence[Episode], now: float) -> dict[str, float]:
    """``generation_figures``' latency terms; none when an episode carries no clock times."""
    spans: dict[str, tuple[float, float]] = {}
    for e in episodes:
        if e.started_unix <= 0 or e.finished_unix <= 0:
            return {}
        first, last = spans.get(e.group_id, (e.started_unix, e.finished_unix))
        spans[e.group_id] = (min(first, e.started_unix), max(last, e.finished_unix))
    return {
        "group_seconds": float(np.mean([last - first for first, last in spans.values()])),
        "group_wait_seconds": float(np.mean([now - last for _, last in spans.values()])),
    }


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
    everything = [e for g in groups for e in g.episodes]
    total = sum(len(g.episodes) for g in groups)
    kept = sum(len(t) for t in trainable)
    rewards = [float(e.reward) for t in trainable for e in t]
    prepared = Prepared(
        [], rewards, total, total - kept, masked_groups=sum(bool(g.masked) for g in groups),
        episode_metrics={**episode_metric_means(everything), **generation_figures(everything)},
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
    elif algorithm in ("ppo", "distill"):  # every trainable episode; distillation needs no reward
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
    """A dataset file (DPO pairs, SFT conversations) that cannot be read; the message names the line
    and field."""


def dataset_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON)`` for every non-blank line of a JSONL dataset file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not JSON: {exc.msg}") from exc


def load_dpo_pairs(path: str | Path) -> list[list[TrainSequence]]:
    """Chosen/rejected pairs from a JSONL file, one pair per line::

        {"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}

    Token ids as the policy's tokenizer produces them; the prompt is shared and never trains.
    Each pair becomes two sequences (prompt + response) with no sampler log-probs, so its
    importance weight is 1."""
    pairs: list[list[TrainSequence]] = []
    for number, record in dataset_records(path):
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
