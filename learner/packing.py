"""Pack variable-length sequences into a few fixed ``[rows, bucket_len]`` shapes.

XLA compiles one program per input shape, so the learner never feeds it the natural ragged batch.
Every micro-batch is ``[rows(L), L]`` for a bucket length ``L`` from ``learner.sequenceBuckets``,
and ``rows(L)`` is fixed per bucket (``rows_for_buckets``), so a whole run compiles the train step
at most once per bucket. Sequences are placed first-fit-decreasing (longest first, each into the
first row with room), several per row; ``segment_ids`` (1, 2, ... per row, 0 = padding) keep them
from attending to each other and ``positions`` restart at 0 for each.

All per-token arrays are aligned to the *targets*: position ``t`` of a row holds the next token
``targets[t]`` that the logits at ``t`` predict, and that token's loss mask, sampler log-prob,
policy version, advantage. A sequence's first token is never a target (nothing predicts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from stoker.spec import RLJobSpec, TransformerConfig


@dataclass
class TrainSequence:
    """One sequence to train on: an episode, or one response of a DPO pair."""

    token_ids: np.ndarray  # int32[n]
    loss_mask: np.ndarray  # uint8/bool[n]: 1 = sampled by the model (trains)
    logprobs: np.ndarray  # float32[n]: the sampler's log-probs (0 where unknown)
    versions: np.ndarray  # int32[n]: policy version per sampled token, -1 elsewhere
    advantage: float = 0.0  # episode-level advantage (GRPO/GSPO), broadcast to its tokens
    reward: float = 0.0  # final reward, credited at the last model token (PPO)
    behaviour_known: bool = True  # False for dataset DPO pairs: no sampler log-probs
    pair_sign: int = 0  # DPO: +1 chosen, -1 rejected
    stuck: bool = False  # GRPO/GSPO: from a stuck flat group, pushed off its tokens (learner/loop.py)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


# Arrays of a micro-batch: name -> dtype. Everything is [rows, bucket_len].
FIELDS: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),  # model inputs
    "targets": np.dtype(np.int32),  # the next token, predicted at this position
    "positions": np.dtype(np.int32),
    "segment_ids": np.dtype(np.int32),  # 1.. per row, 0 = padding
    "sequence_index": np.dtype(np.int32),  # index into the batch's sequence list, -1 = padding
    "mask": np.dtype(np.float32),  # 1 where the target was sampled by the model
    "behaviour_logprobs": np.dtype(np.float32),
    "behaviour_known": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
    "advantages": np.dtype(np.float32),
    "rewards": np.dtype(np.float32),
    "pair_slot": np.dtype(np.int32),  # DPO: row-local pair index
    "pair_sign": np.dtype(np.float32),
    "stuck": np.dtype(np.float32),  # 1 on the tokens of a stuck group's sequences
}


@dataclass
class MicroBatch:
    """One fixed-shape micro-batch (numpy, host side)."""

    arrays: dict[str, np.ndarray]
    sequences: list[int] = field(default_factory=list)  # indices of the sequences it holds

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.arrays["tokens"].shape
        return int(rows), int(length)

    @property
    def real_tokens(self) -> int:
        return int((self.arrays["segment_ids"] > 0).sum())

    @property
    def total_tokens(self) -> int:
        rows, length = self.shape
        return rows * length


@dataclass(frozen=True)
class Placement:
    item: int
    row: int
    offset: int


@dataclass(frozen=True)
class MicroPlan:
    bucket_len: int
    rows: int
    placements: tuple[Placement, ...]


# An accelerator runs each micro-batch as its own calls (a launch and a host round trip each): the
# FrozenLake learner on a v5e took 58 ms a step in 7 micro-batches of 1,024 tokens and 15 ms in one
# (benchmarks/README.md, "Compiles in the loop"). So where the activations are small the whole
# batch goes in one; this is what a micro-batch's activations may take.
ACCELERATOR_MICROBATCH_BYTES = 1 << 30


def microbatch_tokens(spec: RLJobSpec, platform: str, config: TransformerConfig | None = None) -> int:
    """Tokens per packed micro-batch: ``learner.microbatchTokens``, else 4 x the longest bucket on
    the CPU (cache-sized calls), and on an accelerator (``platform`` "tpu", "gpu") up to the whole
    batch while a rough activation estimate -- each layer's input, one layer's temporaries and the
    logits, in float32 -- stays within ``ACCELERATOR_MICROBATCH_BYTES``. ``config``: the model's
    (a checkpoint's own), else the spec's architecture."""
    if spec.learner.microbatch_tokens:
        return spec.learner.microbatch_tokens
    longest = max(spec.learner.sequence_buckets)
    least = 4 * longest
    if platform == "cpu":
        return least
    c = config or spec.model.architecture
    per_token = 4 * (c.num_layers * c.hidden_size + 4 * (c.hidden_size + c.intermediate_size) + c.vocab_size)
    fits = ACCELERATOR_MICROBATCH_BYTES // per_token
    whole = 1 << max(0, spec.learner.batch_groups * spec.buffer.group_size * longest - 1).bit_length()
    return max(least, min(1 << (fits.bit_length() - 1) if fits else 0, whole))


def rows_for_buckets(buckets: Sequence[int], tokens_per_microbatch: int, multiple: int = 1) -> dict[int, int]:
    """Rows per bucket: the largest power of two with ``rows * L <= tokens_per_microbatch``,
    at least ``multiple`` (the data-parallel size, which must divide the rows) and a multiple of it.
    """
    out: dict[int, int] = {}
    for length in buckets:
        rows = 1
        while rows * 2 * length <= tokens_per_microbatch:
            rows *= 2
        rows = max(rows, multiple)
        out[length] = -(-rows // multiple) * multiple
    return out


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``length`` tokens, or None if none does."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return None


def plan(lengths: Sequence[int], buckets: Sequence[int], rows: dict[int, int]) -> list[MicroPlan]:
    """First-fit-decreasing assignment of items (by length) to micro-batch rows.

    Each micro-batch takes the smallest bucket that holds the longest item still unplaced, then
    fills its rows first-fit with every remaining item, longest first; what does not fit goes on
    to the next micro-batch. Every item must fit the largest bucket (see ``truncate``).
    """
    longest = max(buckets)
    for index, length in enumerate(lengths):
        if length > longest or length < 1:
            raise ValueError(f"item {index} has {length} tokens; expected 1..{longest} (the largest bucket)")
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[MicroPlan] = []
    while remaining:
        bucket = bucket_for(lengths[remaining[0]], buckets)
        assert bucket is not None
        free = [bucket] * rows[bucket]
        placements: list[Placement] = []
        leftover: list[int] = []
        for item in remaining:
            for row, room in enumerate(free):
                if lengths[item] <= room:
                    placements.append(Placement(item, row, bucket - room))
                    free[row] = room - lengths[item]
                    break
            else:
                leftover.append(item)
        plans.append(MicroPlan(bucket, rows[bucket], tuple(placements)))
        remaining = leftover
    return plans


def truncate(sequence: TrainSequence, max_len: int) -> TrainSequence:
    """Keep the first ``max_len`` tokens (the tail's targets are lost; counted by the caller)."""
    if len(sequence) <= max_len:
        return sequence
    return TrainSequence(
        token_ids=sequence.token_ids[:max_len],
        loss_mask=sequence.loss_mask[:max_len],
        logprobs=sequence.logprobs[:max_len],
        versions=sequence.versions[:max_len],
        advantage=sequence.advantage,
        reward=sequence.reward,
        behaviour_known=sequence.behaviour_known,
        pair_sign=sequence.pair_sign,
        stuck=sequence.stuck,
    )


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
    arrays = {name: np.zeros((rows, length), dtype) for name, dtype in FIELDS.items()}
    arrays["sequence_index"].fill(-1)
    arrays["versions"].fill(-1)
    return arrays


def _write(arrays: dict[str, np.ndarray], seq: TrainSequence, index: int, row: int, start: int, segment: int) -> None:
    n = len(seq)
    end = start + n
    sl = slice(start, end)
    arrays["tokens"][row, sl] = seq.token_ids
    arrays["positions"][row, sl] = np.arange(n, dtype=np.int32)
    arrays["segment_ids"][row, sl] = segment
    arrays["sequence_index"][row, sl] = index
    # Target alignment: position t predicts token t+1 of the same sequence.
    arrays["targets"][row, start : end - 1] = seq.token_ids[1:]
    mask = np.asarray(seq.loss_mask[1:], np.float32)
    arrays["mask"][row, start : end - 1] = mask
    arrays["behaviour_logprobs"][row, start : end - 1] = np.where(mask > 0, seq.logprobs[1:], 0.0)
    arrays["behaviour_known"][row, start : end - 1] = mask * float(seq.behaviour_known)
    arrays["versions"][row, start : end - 1] = np.where(mask > 0, seq.versions[1:], -1)
    arrays["advantages"][row, sl] = seq.advantage
    model_positions = np.flatnonzero(mask)
    if model_positions.size:
        arrays["rewards"][row, start + model_positions[-1]] = seq.reward
    arrays["pair_sign"][row, sl] = seq.pair_sign
    arrays["stuck"][row, sl] = float(seq.stuck)


def pack(items: Sequence[Sequence[TrainSequence]], buckets: Sequence[int], rows: dict[int, int]) -> list[MicroBatch]:
    """Pack items (each one or more sequences that must share a row, e.g. a DPO pair) into
    fixed-shape micro-batches. Sequence indices count over all items' sequences in order."""
    flat_index: list[list[int]] = []
    counter = 0
    for item in items:
        flat_index.append(list(range(counter, counter + len(item))))
        counter += len(item)
    lengths = [sum(len(s) for s in item) for item in items]
    batches: list[MicroBatch] = []
    for micro in plan(lengths, buckets, rows):
        arrays = _empty(micro.rows, micro.bucket_len)
        next_segment = [1] * micro.rows
        pairs_in_row = [0] * micro.rows
        held: list[int] = []
        for placement in micro.placements:
            offset = placement.offset
            row = placement.row
            has_pair = any(s.pair_sign for s in items[placement.item])
            for seq, index in zip(items[placement.item], flat_index[placement.item], strict=True):
                _write(arrays, seq, index, row, offset, next_segment[row])
                if has_pair:
                    arrays["pair_slot"][row, offset : offset + len(seq)] = pairs_in_row[row]
                next_segment[row] += 1
                offset += len(seq)
                held.append(index)
            pairs_in_row[row] += int(has_pair)
        batches.append(MicroBatch(arrays, held))
    return batches


def pad_to_longest(sequences: Sequence[TrainSequence]) -> MicroBatch:
    """The naive baseline: one sequence per row, every row padded to the longest sequence.

    Its shape changes with every batch's longest sequence, so XLA recompiles often (see
    benchmarks/learner_throughput.py)."""
    longest = max(len(s) for s in sequences)
    arrays = _empty(len(sequences), longest)
    for index, seq in enumerate(sequences):
        _write(arrays, seq, index, index, 0, 1)
    return MicroBatch(arrays, list(range(len(sequences))))


def padding_waste(batches: Sequence[MicroBatch]) -> float:
    """Pad tokens / all tokens over the micro-batches."""
    total = sum(b.total_tokens for b in batches)
    return 1.0 - sum(b.real_tokens for b in batches) / total if total else 0.0
