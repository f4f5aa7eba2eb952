"""An actor pod that mounts the learner's weights volume (``--weights DIR``) reads each sharded
version from the directory, by slice, into its in-process sampler: bit-exact against the learner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.actor.policy import BatchedSampler
from stoker.weights.channel import make_weight_source
from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher
from stoker.model.hf import to_hf
from stoker.model.model import init_model
from stoker.weights.shards import ShardedWeights
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig

CONFIG = TransformerConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.mark.slow
def test_an_actor_loads_a_sharded_version_from_the_weights_directory_bit_exact(tmp_path: Path) -> None:
    trained = init_model(CONFIG, 5, jnp.float32)  # the learner's version 3
    with ShardedPublisher(directory=str(tmp_path / "weights"), processes=Processes(), block_bytes=512) as publisher:
        publisher.publish(3, trained)
    sampler = Sampler(CONFIG, SamplingSpec(max_new_tokens=2), seed=0, buckets=(32,))  # starts from version 0
    want = to_hf(trained)
    assert any(not np.array_equal(want[n], a) for n, a in to_hf(sampler._model).items())

    async def refresh() -> None:  # what the actor's weight loop does once it sees a newer version
        source = make_weight_source(str(tmp_path / "weights"))  # the pod's --weights /var/lib/stoker/weights
        policy = BatchedSampler(sampler, max_batch=4)
        try:
            latest = source.latest_version()
            assert latest == 3
            flat = source.fetch(latest)
            assert isinstance(flat, ShardedWeights) and flat.stats.bytes_read == 0  # read lazily, by slice
            await policy.load_weights(flat, latest)
            assert flat.stats.bytes_read == flat.manifest.nbytes
        finally:
            await policy.close()
            source.close()

    asyncio.run(refresh())
    got = to_hf(sampler._model)
    assert sampler.version == 3 and got.keys() == want.keys()
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name
