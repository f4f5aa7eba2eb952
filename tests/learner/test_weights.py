"""The weight channel: publish versions, subscribers see the newest and get the exact bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.model import init_model
from stoker.weights.channel import (
    WeightPublisher,
    WeightsCorrupt,
    WeightsError,
    WeightsNotFound,
    WeightSubscriber,
    WeightsUnavailable,
    flatten_params,
    load_flat,
)
from stoker.spec import TransformerConfig


def params(seed: int) -> dict[str, np.ndarray]:
    return flatten_params(init_model(TransformerConfig(), seed=seed))


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[WeightPublisher]:
    # Small chunks so even the tiny model streams as many messages.
    with WeightPublisher(directory=tmp_path / "weights", address="127.0.0.1:0", keep=2, chunk_bytes=16_384) as pub:
        yield pub


def subscribers(pub: WeightPublisher, tmp_path: Path) -> list[WeightSubscriber]:
    return [
        WeightSubscriber(address=f"127.0.0.1:{pub.port}", timeout_s=10),
        WeightSubscriber(directory=tmp_path / "weights"),
    ]


def test_flatten_and_load_round_trip() -> None:
    source, target = init_model(TransformerConfig(), seed=1), init_model(TransformerConfig(), seed=2)
    load_flat(target, flatten_params(source))
    assert_bit_exact(flatten_params(target), flatten_params(source))


def test_subscribers_see_the_newest_version_bit_exactly(publisher: WeightPublisher, tmp_path: Path) -> None:
    subs = subscribers(publisher, tmp_path)
    for sub in subs:
        assert sub.latest_version() == -1 and sub.fetch_latest() is None
    v1, v2 = params(1), params(2)
    publisher.publish(1, v1)
    info = publisher.publish(2, v2)
    assert info.size_bytes > 16_384 * 4  # really several chunks
    for sub in subs:
        assert sub.latest_version() == 2
        assert_bit_exact(sub.fetch(2), v2)
        assert_bit_exact(sub.fetch(1), v1)  # still retained (keep=2)
        latest = sub.fetch_latest()
        assert latest is not None and latest[0] == 2
    publisher.publish(3, params(3))
    for sub in subs:
        with pytest.raises(WeightsNotFound):
            sub.fetch(1)
        assert sub.latest_version() == 3
        sub.close()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "LATEST.json",
        "weights-000000000002.json",
        "weights-000000000002.safetensors",
        "weights-000000000003.json",
        "weights-000000000003.safetensors",
    ]


def test_bfloat16_weights_travel_unchanged(publisher: WeightPublisher, tmp_path: Path) -> None:
    flat = flatten_params(init_model(TransformerConfig(), seed=4, dtype=jnp.bfloat16))
    publisher.publish(7, flat)
    for sub in subscribers(publisher, tmp_path):
        assert_bit_exact(sub.fetch(7), flat)
        sub.close()


def test_versions_must_increase(publisher: WeightPublisher) -> None:
    publisher.publish(5, params(0))
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(5, params(0))


def test_corrupted_or_truncated_files_are_detected(tmp_path: Path) -> None:
    directory = tmp_path / "w"
    with WeightPublisher(directory=directory) as pub:
        pub.publish(1, params(1))
    sub = WeightSubscriber(directory=directory)
    blob = directory / "weights-000000000001.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(WeightsCorrupt, match="sha256"):
        sub.fetch(1)
    blob.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(WeightsCorrupt, match="bytes, expected"):
        sub.fetch(1)
    (directory / "LATEST.json").write_text("{")
    with pytest.raises(WeightsCorrupt, match="not valid JSON"):
        sub.latest_version()
    with pytest.raises(WeightsNotFound):
        sub.fetch(9)


def test_manifest_is_written_after_the_blob(tmp_path: Path) -> None:
    """A reader that sees a version in LATEST.json can always read a complete blob for it."""
    directory = tmp_path / "w"
    with WeightPublisher(directory=directory) as pub:
        pub.publish(1, params(1))
    latest = json.loads((directory / "LATEST.json").read_text())
    assert latest["policy_version"] == 1
    assert (directory / latest["file"]).stat().st_size == latest["size_bytes"]
    assert not list(directory.glob(".*tmp"))


def test_bearer_token_is_enforced(tmp_path: Path) -> None:
    with WeightPublisher(address="127.0.0.1:0", auth_token="s3cret") as pub:
        pub.publish(1, params(1))
        with WeightSubscriber(address=f"127.0.0.1:{pub.port}", timeout_s=10) as anonymous:
            with pytest.raises(WeightsError, match="token"):
                anonymous.latest_version()
        with WeightSubscriber(address=f"127.0.0.1:{pub.port}", auth_token="s3cret", timeout_s=10) as sub:
            assert sub.latest_version() == 1
            assert_bit_exact(sub.fetch(1), params(1))


def test_unreachable_publisher_is_retryable() -> None:
    with WeightPublisher(address="127.0.0.1:0") as pub:
        port = pub.port
    with WeightSubscriber(address=f"127.0.0.1:{port}", timeout_s=1) as sub:
        with pytest.raises(WeightsUnavailable):
            sub.latest_version()


def test_constructor_misuse_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="directory, an address"):
        WeightPublisher()
    with pytest.raises(ValueError, match="exactly one"):
        WeightSubscriber(address="127.0.0.1:1", directory=tmp_path)


def test_a_restarted_publisher_replaces_a_rolled_back_history(tmp_path: Path) -> None:
    """After a learner restarts from an older checkpoint, versions it never reached this run vanish."""
    directory = tmp_path / "w"
    with WeightPublisher(directory=directory, keep=3) as first:
        for version in (1, 2, 3):
            first.publish(version, params(version))
    with WeightPublisher(directory=directory, keep=2) as second:
        second.publish(2, params(20))
        sub = WeightSubscriber(directory=directory)
        assert sub.latest_version() == 2
        assert_bit_exact(sub.fetch(2), params(20))
        with pytest.raises(WeightsNotFound):
            sub.fetch(3)
        assert_bit_exact(sub.fetch(1), params(1))
