"""The buffer's hand-rolled protobuf framing agrees byte for byte with the protobuf runtime."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.buffer.wire import (
    WireError,
    encode_put_request,
    encode_sample_response,
    encode_trajectory,
    encode_varint,
    read_varint,
    split_fields,
    split_put_request,
)
from stoker.trajectory import Episode, from_proto, to_proto
from stoker.v1 import buffer_pb2, trajectory_pb2


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_varint_round_trip(value: int) -> None:
    decoded, end = read_varint(encode_varint(value), 0)
    assert decoded == value % (1 << 64)
    assert end == len(encode_varint(value))


def test_varints_past_64_bits_are_malformed() -> None:
    """A 10-byte varint carries 70 bits: a value no uint64/int64 field holds is refused as the
    wire error it is (a PutStream sequence of 2^64 used to end the stream with INTERNAL)."""
    top = encode_varint(2**64 - 1)
    assert read_varint(top, 0) == (2**64 - 1, 10)
    for too_big in (top[:9] + bytes([0x02]), b"\x80" * 9 + b"\x7f", b"\xff" * 10 + b"\x01"):
        with pytest.raises(WireError, match="varint"):
            read_varint(too_big, 0)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    reward=st.floats(-10, 10, width=32),
    episode_id=st.text(max_size=12),
    metrics=st.dictionaries(st.text(max_size=5), st.floats(-1e6, 1e6), max_size=3),
    status=st.sampled_from([1, 2, 3, 4]),
)
def test_encode_trajectory_matches_the_protobuf_runtime(
    tokens: int, reward: float, episode_id: str, metrics: dict[str, float], status: int
) -> None:
    rng = np.random.default_rng(tokens)
    episode = Episode(
        episode_id=episode_id,
        group_id="g",
        group_size=3,
        task_id="t",
        token_ids=rng.integers(-5, 1 << 20, tokens).astype(np.int32),
        loss_mask=rng.integers(0, 2, tokens).astype(np.uint8),
        logprobs=-rng.random(tokens).astype(np.float32),
        policy_versions=rng.integers(-1, 9, tokens).astype(np.int32),
        reward=reward,
        turn_rewards=[0.5, reward],
        status=status,
        metrics=metrics,
    )
    fast = trajectory_pb2.Trajectory.FromString(encode_trajectory(episode))
    assert fast == to_proto(episode)
    decoded = from_proto(fast)
    np.testing.assert_array_equal(decoded.policy_versions, episode.policy_versions)


def test_split_put_request_returns_each_trajectory_unchanged() -> None:
    items = [trajectory_pb2.Trajectory(episode_id=f"e{i}", num_tokens=i).SerializeToString() for i in range(3)]
    data = buffer_pb2.PutRequest(client_id="actor-7", trajectories=[trajectory_pb2.Trajectory.FromString(b) for b in items]).SerializeToString()
    client_id, views = split_put_request(data)
    assert client_id == "actor-7"
    assert [bytes(v) for v in views] == items
    assert encode_put_request("actor-7", items) == data


@pytest.mark.parametrize("data", [b"\x12\x05abc", b"\x12", b"\x0a\xff", b"\x00\x01", b"\x13"])
def test_malformed_put_request_is_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        split_put_request(data)


def test_sample_response_assembled_from_stored_bytes_parses() -> None:
    a = trajectory_pb2.Trajectory(episode_id="a").SerializeToString()
    b = trajectory_pb2.Trajectory(episode_id="b").SerializeToString()
    data = encode_sample_response("batch-1", [("g1", [a, memoryview(b)], False), ("g2", [b], True)], -3)
    response = buffer_pb2.SampleResponse.FromString(data)
    assert response.batch_id == "batch-1"
    assert response.policy_version == -3
    assert [(g.group_id, g.masked, [t.episode_id for t in g.trajectories]) for g in response.groups] == [
        ("g1", False, ["a", "b"]),
        ("g2", True, ["b"]),
    ]


def test_split_fields_returns_the_arrays_as_views_and_the_rest_as_a_message_without_them() -> None:
    episode = Episode(
        episode_id="e", group_id="g", group_size=2, task_id="t",
        token_ids=np.arange(5, dtype=np.int32), loss_mask=np.array([0, 1, 1, 0, 1], np.uint8),
        logprobs=np.full(5, -0.5, np.float32), policy_versions=np.full(5, 3, np.int32),
        reward=0.5, metrics={"steps": 3.0},
    )  # fmt: skip
    raw = encode_trajectory(episode)
    arrays, rest = split_fields(raw, frozenset({7, 10}))  # token_ids, policy_versions
    assert np.array_equal(np.frombuffer(arrays[7], np.int32), episode.token_ids)
    assert np.array_equal(np.frombuffer(arrays[10], np.int32), episode.policy_versions)
    expected = to_proto(episode)
    expected.ClearField("token_ids")
    expected.ClearField("policy_versions")
    assert trajectory_pb2.Trajectory.FromString(rest) == expected
    # a repeated bytes field: the last occurrence wins, as when the runtime parses it
    twice = raw + b"\x3a\x04\x01\x00\x00\x00"  # field 7 again: one token id
    assert bytes(split_fields(twice, frozenset({7}))[0][7]) == b"\x01\x00\x00\x00"
