"""Every malformed trajectory is refused with the field at fault; the batch validator agrees with
the per-trajectory one on every input."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker.buffer.validate as validate_module
from stoker.buffer.settings import BufferSettings
from stoker.buffer.validate import Invalid, TrajectoryMeta, validate, validate_batch
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode, to_proto
from stoker.v1 import trajectory_pb2

SETTINGS = BufferSettings(group_size=2, max_trajectory_tokens=64, max_id_length=16, max_metrics=2)
Mutation = Callable[[trajectory_pb2.Trajectory], None]


def good() -> trajectory_pb2.Trajectory:
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1], np.uint8)
    episode = Episode(
        episode_id="e1",
        group_id="g1",
        group_size=2,
        task_id="t",
        token_ids=np.arange(8, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.25, 0).astype(np.float32),
        policy_versions=np.where(mask == 1, 3, -1).astype(np.int32),
    )
    return to_proto(episode)


def set_array(name: str, values: np.ndarray) -> Mutation:
    def mutate(message: trajectory_pb2.Trajectory) -> None:
        setattr(message, name, values.tobytes())

    return mutate


def set_field(name: str, value: object) -> Mutation:
    def mutate(message: trajectory_pb2.Trajectory) -> None:
        setattr(message, name, value)

    return mutate


def empty(message: trajectory_pb2.Trajectory) -> None:
    for name in ("token_ids", "loss_mask", "logprobs", "policy_versions"):
        setattr(message, name, b"")
    message.num_tokens = 0


def many_metrics(message: trajectory_pb2.Trajectory) -> None:
    message.metrics.update({"a": 1.0, "b": 2.0, "c": 3.0})


LOGPROBS = np.where(good_mask := np.array([0, 0, 1, 1, 1, 0, 1, 1], np.uint8), -0.25, 0).astype(np.float32)

# (case, mutation, field named in the error)
MALFORMED: list[tuple[str, Mutation, str]] = [
    ("token ids shorter than num_tokens", set_array("token_ids", np.arange(7, dtype=np.int32)), "token_ids"),
    ("loss mask longer", set_array("loss_mask", np.ones(9, np.uint8)), "loss_mask"),
    ("log-probs of the wrong dtype", set_array("logprobs", LOGPROBS.astype(np.float64)), "logprobs"),
    ("versions shorter", set_array("policy_versions", np.zeros(3, np.int32)), "policy_versions"),
    ("no tokens", empty, "num_tokens"),
    ("NaN log-prob", set_array("logprobs", np.where(good_mask == 1, np.nan, 0).astype(np.float32)), "logprobs"),
    ("infinite log-prob", set_array("logprobs", np.full(8, -np.inf, np.float32)), "logprobs"),
    ("NaN log-prob on an environment token", set_array("logprobs", np.where(good_mask == 1, -0.25, np.nan).astype(np.float32)), "logprobs"),
    ("infinite log-prob on an environment token", set_array("logprobs", np.where(good_mask == 1, -0.25, np.inf).astype(np.float32)), "logprobs"),
    ("-inf log-prob on a model token", set_array("logprobs", np.where(good_mask == 1, -np.inf, 0).astype(np.float32)), "logprobs"),
    ("positive log-prob", set_array("logprobs", np.where(good_mask == 1, 0.5, 0).astype(np.float32)), "logprobs"),
    ("mask value 2", set_array("loss_mask", np.full(8, 2, np.uint8)), "loss_mask"),
    ("no model tokens", set_array("loss_mask", np.zeros(8, np.uint8)), "loss_mask"),
    ("negative version on a model token", set_array("policy_versions", np.full(8, -1, np.int32)), "policy_versions"),
    ("unspecified status", set_field("status", trajectory_pb2.EPISODE_STATUS_UNSPECIFIED), "status"),
    ("group size 0", set_field("group_size", 0), "group_size"),
    ("group size other than the buffer's", set_field("group_size", 3), "group_size"),
    ("no episode id", set_field("episode_id", ""), "episode_id"),
    ("no group id", set_field("group_id", ""), "group_id"),
    ("episode id too long", set_field("episode_id", "x" * 17), "episode_id"),
    ("too many tokens", set_field("num_tokens", 65), "num_tokens"),
    ("NaN reward", set_field("reward", float("nan")), "reward"),
    ("too many metrics", many_metrics, "metrics"),
]


@pytest.mark.parametrize(("case", "mutate", "field"), MALFORMED, ids=[c for c, _, _ in MALFORMED])
def test_malformed_trajectory_names_its_field(case: str, mutate: Mutation, field: str) -> None:
    message = good()
    mutate(message)
    with pytest.raises(Invalid) as caught:
        validate(message.SerializeToString(), SETTINGS)
    assert caught.value.field == field, f"{case}: {caught.value}"
    assert caught.value.message  # a reason a user can act on


@pytest.mark.parametrize(("case", "mutate", "field"), MALFORMED, ids=[c for c, _, _ in MALFORMED])
def test_batch_validation_refuses_the_same_field_and_keeps_the_neighbour(case: str, mutate: Mutation, field: str) -> None:
    bad, neighbour = good(), good()
    mutate(bad)
    neighbour.episode_id = "e2"
    kept, refused = validate_batch([neighbour.SerializeToString(), bad.SerializeToString()], SETTINGS)
    assert isinstance(kept, TrajectoryMeta)
    assert isinstance(refused, Invalid) and refused.field == field, f"{case}: {refused}"


def test_garbage_bytes_are_not_a_trajectory() -> None:
    with pytest.raises(Invalid) as caught:
        validate(b"\xff\xff\xff", SETTINGS)
    assert caught.value.field == "trajectory"


def test_failed_episode_without_tokens_is_valid() -> None:
    message = good()
    empty(message)
    message.status = trajectory_pb2.EPISODE_STATUS_FAILED
    meta = validate(message.SerializeToString(), SETTINGS)
    assert not meta.ok and meta.oldest_version == -1


def test_metadata_of_a_valid_trajectory() -> None:
    meta = validate(good().SerializeToString(), SETTINGS)
    assert meta == TrajectoryMeta("e1", "g1", 2, "", True, 3, 8)


MUTATIONS = [m for _, m, _ in MALFORMED]


BATCHES = st.lists(st.tuples(st.integers(0, len(MUTATIONS)), st.integers(1, 20), st.integers(0, 5)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(BATCHES)
def test_batch_validation_agrees_with_per_item_validation(items: list[tuple[int, int, int]]) -> None:
    check_agreement(items)


@settings(max_examples=60, deadline=None)
@given(BATCHES)
def test_batch_validation_agrees_under_roomy_limits_too(items: list[tuple[int, int, int]]) -> None:
    """Limits loose enough that the batch path vouches for ids and maps by the message's size alone."""
    check_agreement(items, BufferSettings(group_size=2, max_trajectory_tokens=64))


@settings(max_examples=60, deadline=None)
@given(BATCHES)
def test_zero_copy_validation_of_long_trajectories_agrees_too(items: list[tuple[int, int, int]]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validate_module, "LONG_TOKENS", 1)  # every trajectory takes the long path
        check_agreement(items)


def check_agreement(items: list[tuple[int, int, int]], limits: BufferSettings = SETTINGS) -> None:
    raws: list[bytes] = []
    for choice, tokens, version in items:
        mask = np.zeros(tokens, np.uint8)
        mask[tokens // 2 :] = 1
        episode = Episode(
            episode_id=f"e{len(raws)}",
            group_id="g",
            group_size=2,
            task_id="t",
            token_ids=np.arange(tokens, dtype=np.int32),
            loss_mask=mask,
            logprobs=np.where(mask == 1, -1.0, 0).astype(np.float32),
            policy_versions=np.where(mask == 1, version, -1).astype(np.int32),
        )
        message = trajectory_pb2.Trajectory.FromString(encode_trajectory(episode))
        if choice < len(MUTATIONS):
            MUTATIONS[choice](message)
        raws.append(message.SerializeToString())

    def one(raw: bytes) -> TrajectoryMeta | tuple[str, str]:
        try:
            return validate(raw, limits)
        except Invalid as exc:
            return exc.field, exc.message

    batch = [r if isinstance(r, TrajectoryMeta) else (r.field, r.message) for r in validate_batch(raws, limits)]
    assert batch == [one(raw) for raw in raws]
