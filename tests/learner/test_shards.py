"""Sharded weights in one process: the format's guarantees (exact bytes, checksums, versions,
pruning, the token), through both transports. Several processes: ``test_shard_publish.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher
from stoker.model.hf import load_hf, to_hf
from stoker.model.model import init_model
from stoker.weights.channel import WeightsCorrupt, WeightsError, WeightsNotFound, WeightSubscriber
from stoker.spec import TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[ShardedPublisher]:
    with ShardedPublisher(
        directory=str(tmp_path / "weights"), address="127.0.0.1:0", auth_token="secret", processes=Processes(),
        block_bytes=256,
    ) as pub:
        yield pub


def sources(tmp_path: Path, publisher: ShardedPublisher) -> list[WeightSubscriber]:
    return [
        WeightSubscriber(directory=tmp_path / "weights"),
        WeightSubscriber(address=f"127.0.0.1:{publisher.port}", auth_token="secret"),
    ]


def test_both_transports_serve_the_published_version_bit_exact_and_load_it_into_a_model(
    tmp_path: Path, publisher: ShardedPublisher
) -> None:
    model = init_model(CONFIG, 3, jnp.bfloat16)
    want = to_hf(model)
    manifest = publisher.publish(1, model)
    assert manifest is not None and manifest.nbytes == sum(a.nbytes for a in want.values())
    for subscriber in sources(tmp_path, publisher):
        with subscriber:
            info = subscriber.latest()
            assert info is not None and info.version == 1 and info.sharded
            weights = subscriber.fetch(1)
            assert set(weights) == set(want)
            for name, array in want.items():
                assert weights[name].dtype == array.dtype and weights[name].tobytes() == array.tobytes(), name
            target = init_model(CONFIG, 4, jnp.bfloat16)
            load_hf(target, subscriber.fetch(1))
            for name, array in to_hf(target).items():
                assert array.tobytes() == want[name].tobytes(), name
    with WeightSubscriber(address=f"127.0.0.1:{publisher.port}", auth_token="secret") as fresh:  # no Latest first
        assert fresh.fetch(1)["model.norm.weight"].tobytes() == want["model.norm.weight"].tobytes()
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(1, model)


def test_a_damaged_shard_is_refused_and_the_model_keeps_its_weights(tmp_path: Path, publisher: ShardedPublisher) -> None:
    publisher.publish(1, init_model(CONFIG, 3, jnp.bfloat16))
    shard = next((tmp_path / "weights").glob("shards-000000000001-*/p00000/model.layers.0.mlp.down_proj.weight@0"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    target = init_model(CONFIG, 4, jnp.bfloat16)
    before = to_hf(target)
    with WeightSubscriber(directory=tmp_path / "weights") as subscriber, pytest.raises(WeightsCorrupt, match="crc32"):
        load_hf(target, subscriber.fetch(1))
    for name, array in to_hf(target).items():
        assert array.tobytes() == before[name].tobytes(), name  # nothing was half-loaded


def test_old_versions_are_pruned_from_both_transports(tmp_path: Path, publisher: ShardedPublisher) -> None:
    for version in (1, 2, 3):
        publisher.publish(version, init_model(CONFIG, version, jnp.bfloat16))
    assert len([p for p in (tmp_path / "weights").glob("shards-*") if p.is_dir()]) == 2
    for subscriber in sources(tmp_path, publisher):
        with subscriber:
            assert subscriber.latest_version() == 3
            with pytest.raises(WeightsNotFound):
                subscriber.fetch(1)["model.norm.weight"]
            assert subscriber.fetch(2)["model.norm.weight"].tobytes() == to_hf(init_model(CONFIG, 2, jnp.bfloat16))["model.norm.weight"].tobytes()


def test_peer_serving_refuses_a_wrong_token(publisher: ShardedPublisher) -> None:
    publisher.publish(1, init_model(CONFIG, 3, jnp.bfloat16))
    with WeightSubscriber(address=f"127.0.0.1:{publisher.port}", auth_token="wrong") as subscriber:
        with pytest.raises(WeightsError, match="token"):
            subscriber.latest()


def test_a_reader_reads_only_the_rows_it_asks_for(tmp_path: Path, publisher: ShardedPublisher) -> None:
    model = init_model(CONFIG, 3, jnp.bfloat16)
    publisher.publish(1, model)
    want = to_hf(model)["model.layers.0.mlp.down_proj.weight"]  # [64, 128] bf16: one 256-byte row a block
    with WeightSubscriber(directory=tmp_path / "weights") as subscriber:
        weights = subscriber.fetch(1)
        tensor = weights.manifest.tensors["model.layers.0.mlp.down_proj.weight"]
        part = weights.read_box(tensor, ((10, 20), (0, 128)))
        assert np.array_equal(part.view(np.uint16), want[10:20].view(np.uint16))
        assert weights.stats.bytes_read == 10 * 128 * 2


@pytest.mark.slow
def test_the_learner_loop_publishes_sharded_versions_and_reports_each_after_its_commit(tmp_path: Path, xla_cache: Path) -> None:
    from stoker.learner.loop import Learner

    from tests.learner.bandit import ScriptedBuffer, settings

    class Reporting(ScriptedBuffer):
        def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
            with WeightSubscriber(directory=tmp_path / "weights") as sub:  # never a version not yet committed
                assert sub.latest_version() == version
            super().set_policy_version(version, duty_cycle)

    buffer = Reporting()
    learner = Learner(settings(tmp_path, learner={"publishIntervalSteps": 2}))
    buffer.learner_ref.append(learner)
    with ShardedPublisher(directory=str(tmp_path / "weights"), processes=Processes()) as publisher:
        assert learner.run(buffer, publisher, max_steps=4) == 4
    learner.close()
    assert buffer.versions[0] == 0 and buffer.versions[-1] == 4 and buffer.versions == sorted(set(buffer.versions))
    with WeightSubscriber(directory=tmp_path / "weights") as sub:
        published = sub.fetch(4)
        trained = learner.flat_weights()
        assert set(published) == set(trained)
        for name, array in trained.items():
            assert published[name].tobytes() == array.tobytes(), name


def test_colocated_weights_move_device_to_device_into_the_samplers_model() -> None:
    from stoker.weights.shards import DeviceWeights

    source = init_model(CONFIG, 3, jnp.float32)  # the learner's float32 copy; the sampler's model is bfloat16
    weights = DeviceWeights(source)
    target = init_model(CONFIG, 4, jnp.bfloat16)
    load_hf(target, weights)
    want = {k: v.astype(jnp.bfloat16) for k, v in to_hf(source).items()}
    for name, array in to_hf(target).items():
        assert array.dtype == want[name].dtype and array.tobytes() == want[name].tobytes(), name
    assert weights["model.layers.0.mlp.down_proj.weight"].tobytes() == to_hf(source)["model.layers.0.mlp.down_proj.weight"].tobytes()


@pytest.mark.slow
def test_a_publish_slower_than_many_steps_never_holds_up_training(tmp_path: Path, xla_cache: Path) -> None:
    """The learner keeps stepping while a sharded publish runs (on the outbox's thread); the
    versions trained meanwhile are skipped, not queued, and the last one is published."""
    import time

    from stoker.learner.loop import Learner

    from tests.learner.bandit import ScriptedBuffer, settings

    learner = Learner(settings(tmp_path, learner={"publishIntervalSteps": 1}))
    buffer = ScriptedBuffer()
    buffer.learner_ref.append(learner)
    during: dict[str, int] = {}

    class Slow(ShardedPublisher):
        published: list[int] = []

        def publish(self, version: int, model: object) -> object:
            if not self.published:  # the first (version 0) lasts until the learner is 4 steps further
                deadline = time.monotonic() + 60
                while learner.version < version + 4 and time.monotonic() < deadline:
                    time.sleep(0.01)
                during["steps"] = learner.version - version
            self.published.append(version)
            return super().publish(version, model)

    with Slow(directory=str(tmp_path / "weights"), processes=Processes()) as publisher:
        assert learner.run(buffer, publisher, max_steps=7) == 7
    learner.close()
    # Trained on while version 0 was publishing (a publish blocking the step would freeze
    # learner.version until the deadline: 0 steps).
    assert during["steps"] >= 4, during
    # The versions trained during it were skipped, not published late; the last was published.
    assert Slow.published[0] == 0 and Slow.published[-1] == 7, Slow.published
    assert not set(range(1, 4)) & set(Slow.published), Slow.published
    with WeightSubscriber(directory=tmp_path / "weights") as sub:
        assert sub.latest_version() == 7
