"""Packing into bucket shapes: placement, alignment to targets, few shapes, little padding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.learner import packing
from stoker.learner.packing import TrainSequence

REPO = Path(__file__).resolve().parents[2]


def seq(n: int, start: int = 10, **kw: object) -> TrainSequence:
    ids = np.arange(start, start + n, dtype=np.int32)
    mask = np.zeros(n, np.uint8)
    mask[n // 2 :] = 1
    return TrainSequence(
        ids, mask, np.where(mask, -0.5, 0.0).astype(np.float32), np.where(mask, 3, -1).astype(np.int32), **kw  # type: ignore[arg-type]
    )


def test_rows_per_bucket_are_powers_of_two_and_divisible() -> None:
    assert packing.rows_for_buckets([128, 256, 512], 1024) == {128: 8, 256: 4, 512: 2}
    assert packing.rows_for_buckets([128, 256, 512], 1024, multiple=4) == {128: 8, 256: 4, 512: 4}


def test_first_fit_decreasing_plan() -> None:
    plans = packing.plan([5, 9, 3, 4, 7], [8, 16], {8: 2, 16: 2})
    assert len(plans) == 1
    micro = plans[0]
    assert micro.bucket_len == 16 and micro.rows == 2
    by_item = {p.item: (p.row, p.offset) for p in micro.placements}
    # Longest first: 9 -> row 0; 7 -> row 0 (fits 7 of 7 left); 5 -> row 1; 4 -> row 1; 3 -> row 1.
    assert by_item == {1: (0, 0), 4: (0, 9), 0: (1, 0), 3: (1, 5), 2: (1, 9)}


def test_overflow_goes_to_a_smaller_bucket() -> None:
    plans = packing.plan([16, 16, 3, 2], [8, 16], {8: 1, 16: 2})
    assert [(p.bucket_len, len(p.placements)) for p in plans] == [(16, 2), (8, 2)]
    with pytest.raises(ValueError, match="largest bucket"):
        packing.plan([17], [8, 16], {8: 1, 16: 1})


def test_packed_arrays_are_aligned_to_targets() -> None:
    a, b = seq(4, start=10), seq(3, start=20, advantage=2.0, reward=1.5)
    (micro,) = packing.pack([[a], [b]], [8], {8: 1})
    arr = micro.arrays
    np.testing.assert_array_equal(arr["tokens"][0], [10, 11, 12, 13, 20, 21, 22, 0])
    np.testing.assert_array_equal(arr["segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(arr["positions"][0], [0, 1, 2, 3, 0, 1, 2, 0])
    # Position t predicts token t+1 of the same sequence; the last token of each predicts nothing.
    np.testing.assert_array_equal(arr["targets"][0], [11, 12, 13, 0, 21, 22, 0, 0])
    # a's mask [0,0,1,1] -> targets 12, 13 train; b's [0,1,1] -> targets 21, 22 train.
    np.testing.assert_array_equal(arr["mask"][0], [0, 1, 1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(arr["versions"][0], [-1, 3, 3, -1, 3, 3, -1, -1])
    np.testing.assert_allclose(arr["behaviour_logprobs"][0], [0, -0.5, -0.5, 0, -0.5, -0.5, 0, 0])
    np.testing.assert_allclose(arr["advantages"][0, 4:7], 2.0)
    # The reward sits on the last model target of b.
    np.testing.assert_allclose(arr["rewards"][0], [0, 0, 0, 0, 0, 1.5, 0, 0])
    assert micro.real_tokens == 7 and packing.padding_waste([micro]) == pytest.approx(1 / 8)


def test_dpo_pair_shares_a_row() -> None:
    chosen, rejected = seq(3, pair_sign=1), seq(3, pair_sign=-1)
    (micro,) = packing.pack([[seq(6)], [chosen, rejected]], [8], {8: 2})
    arr = micro.arrays
    row = int(np.flatnonzero((arr["pair_sign"] != 0).any(axis=1))[0])
    np.testing.assert_array_equal(arr["pair_sign"][row, :6], [1, 1, 1, -1, -1, -1])
    np.testing.assert_array_equal(arr["segment_ids"][row, :6], [1, 1, 1, 2, 2, 2])


def test_random_batches_use_few_shapes_and_less_padding_than_naive() -> None:
    rng = np.random.default_rng(0)
    buckets = [64, 128, 256]
    rows = packing.rows_for_buckets(buckets, 1024)
    shapes: set[tuple[int, int]] = set()
    naive_shapes: set[tuple[int, int]] = set()
    packed_waste, naive_waste = [], []
    for _ in range(200):
        lengths = np.minimum(rng.geometric(1 / 30, size=int(rng.integers(4, 24))) + 2, 256)
        items = [[seq(int(n))] for n in lengths]
        micros = packing.pack(items, buckets, rows)
        shapes.update(m.shape for m in micros)
        assert sorted(i for m in micros for i in m.sequences) == list(range(len(items)))
        packed_waste.append(packing.padding_waste(micros))
        naive = packing.pad_to_longest([i[0] for i in items])
        naive_shapes.add(naive.shape)
        naive_waste.append(packing.padding_waste([naive]))
    assert shapes <= {(rows[b], b) for b in buckets}
    assert len(naive_shapes) > 20
    assert np.mean(packed_waste) < np.mean(naive_waste)


def test_truncate_keeps_the_prefix() -> None:
    s = packing.truncate(seq(10, advantage=1.0), 4)
    assert len(s) == 4 and s.advantage == 1.0
    np.testing.assert_array_equal(s.token_ids, [10, 11, 12, 13])


def _spec(buckets: list[int], microbatch: int | None = None, **architecture: int) -> Any:
    from stoker.manifest import load_job

    spec = load_job(REPO / "examples" / "frozenlake.yaml").spec
    learner = spec.learner.model_copy(update={"sequence_buckets": buckets, "microbatch_tokens": microbatch})
    model = spec.model.model_copy(update={"architecture": spec.model.architecture.model_copy(update=architecture)})
    return spec.model_copy(update={"learner": learner, "model": model})


def test_microbatch_default_takes_a_small_models_batch_in_one_call_on_an_accelerator() -> None:
    tiny = _spec([128, 256])  # the FrozenLake example: 4 groups x 8 episodes of up to 256 tokens
    assert packing.microbatch_tokens(tiny, "cpu") == 4 * 256
    assert packing.microbatch_tokens(tiny, "tpu") == 4 * 8 * 256
    # A Qwen2.5-0.5B-shaped model: its activations keep the CPU's micro-batch.
    qwen = _spec([2048], vocab_size=151936, hidden_size=896, num_layers=24, intermediate_size=4864)
    assert packing.microbatch_tokens(qwen, "tpu") == 4 * 2048
    # What the manifest says wins everywhere.
    assert packing.microbatch_tokens(_spec([128, 256], microbatch=512), "tpu") == 512
