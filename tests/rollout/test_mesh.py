"""The sampler over a tensor-parallel mesh of 4 CPU devices agrees with one device.

JAX fixes its device count when it starts, and other tests in this process started it with one
CPU device, so the comparison runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is imported.
"""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest

from stoker.rollout.mesh import MeshError, default_tp, parse_mesh, rollout_mesh
from stoker.spec import TransformerConfig
from tests.host_devices import run_on_host_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from stoker.model.hf import to_hf
    from stoker.model.model import init_model
    from stoker.rollout.mesh import rollout_mesh
    from stoker.rollout.sampling import Sampler
    from stoker.spec import SamplingSpec, TransformerConfig
    from flax import nnx

    assert jax.device_count() == 8, jax.devices()
    cfg = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
                            intermediate_size=64, max_seq_len=32)
    out = {}
    for tp in (1, 4):
        # Pinned sessions, as the rollout engine runs them: they keep version 0 across the swap.
        sampler = Sampler(cfg, SamplingSpec(temperature=1.0, top_p=0.9), seed=3, buckets=(16, 32), min_batch=2,
                          session_rows=2, pin_sessions=True, mesh=None if tp == 1 else rollout_mesh(cfg, tp))
        calls = [sampler.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6)]
        for turn in range(2):
            if turn == 1:  # new weights keep their layout and compile nothing
                sampler.load_weights(to_hf(init_model(cfg, seed=9)), version=1)
            calls.append(sampler.generate([[1, 2, 3] * (turn + 1), [9, 8] * (turn + 1)], max_new_tokens=5,
                                          sessions=["a", "b"]))
        calls.append(sampler.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6))  # version 1
        state = sampler._state
        # The model object holds the placed arrays too: no whole copy stays on one device.
        model_devices = {len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(sampler._model))}
        spec = lambda x: str(getattr(x.sharding, "spec", None))  # one device: no spec
        out[tp] = {
            "tokens": [g.token_ids for call in calls for g in call],
            "logprobs": [g.logprobs for call in calls for g in call],
            "versions": [g.version for call in calls for g in call],
            "model_devices": sorted(model_devices),
            "compiles": sampler.compile_count,
            "q_proj": spec(state["layers"][0]["self_attn"]["q_proj"]["kernel"][...]),
            "down_proj": spec(state["layers"][0]["mlp"]["down_proj"]["kernel"][...]),
            "q_shards": len(state["layers"][0]["self_attn"]["q_proj"]["kernel"][...].addressable_shards),
            "cache": spec(sampler._store[0].keys),
        }
    # A checkpoint's arrays, at start and as new weights, go from the host straight to their
    # chips: none lands whole on one device first (a model split over chips may not fit one).
    import jax.numpy as jnp
    landed = []
    def spying(real):
        def call(*args, **kwargs):
            value = real(*args, **kwargs)
            landed.extend(len(leaf.sharding.device_set) for leaf in jax.tree.leaves(value))
            return value
        return call
    first, later = to_hf(init_model(cfg, seed=5)), to_hf(init_model(cfg, seed=9))
    real = jax.device_put, jnp.asarray
    jax.device_put, jnp.asarray = spying(jax.device_put), spying(jnp.asarray)
    loaded = Sampler(cfg, SamplingSpec(), seed=3, buckets=(16, 32), params=first,
                     session_rows=2, pin_sessions=True, mesh=rollout_mesh(cfg, 4))
    loaded.load_weights(later, version=1)
    jax.device_put, jnp.asarray = real
    out["landed"] = sorted(set(landed))
    out["loaded_logprobs"] = loaded.generate([[1, 2, 3]], max_new_tokens=4, sessions=["a"])[0].logprobs
    json.dump(out, sys.stdout)
    """
)


def assert_same_samples(mesh: dict, single: dict) -> None:
    """Same seed, same draws: over a mesh the partial sums are only added in another order."""
    assert mesh["tokens"] == single["tokens"]
    for a, b in zip(mesh["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sampling_over_a_tensor_parallel_mesh_matches_one_device() -> None:
    out = run_on_host_devices(SCRIPT)
    single, mesh = out["1"], out["4"]
    assert_same_samples(mesh, single)
    assert mesh["versions"] == single["versions"] == [0] * 6 + [1] * 2
    assert mesh["compiles"] == single["compiles"] == 2  # stateless + session program, not per layout
    assert out["landed"] == [4] and len(out["loaded_logprobs"]) == 4
    assert (mesh["q_proj"], mesh["down_proj"], mesh["cache"]) == (
        "P(None, 'tp')", "P('tp', None)", "P(None, None, 'tp')",
    )
    assert mesh["q_shards"] == 4 and mesh["model_devices"] == [4]
    assert single["q_shards"] == 1 and single["model_devices"] == [1]


MOE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from stoker.rollout.mesh import rollout_mesh
    from stoker.rollout.sampling import Sampler
    from stoker.spec import SamplingSpec, TransformerConfig

    cfg = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                            intermediate_size=64, max_seq_len=32, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=24)
    out = {}
    for tp in (1, 4):
        sampler = Sampler(cfg, SamplingSpec(temperature=1.0), seed=3, buckets=(16, 32), min_batch=2,
                          mesh=None if tp == 1 else rollout_mesh(cfg, tp))
        calls = sampler.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6)
        experts = sampler._state["layers"][0]["mlp"]["experts"]["down_proj"][...]
        out[tp] = {"tokens": [g.token_ids for g in calls], "logprobs": [g.logprobs for g in calls],
                   "spec": str(getattr(experts.sharding, "spec", None)), "shards": len(experts.addressable_shards)}
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.slow
def test_a_mixture_of_experts_samples_alike_with_its_experts_split_over_the_mesh() -> None:
    out = run_on_host_devices(MOE_SCRIPT)
    single, mesh = out["1"], out["4"]
    assert_same_samples(mesh, single)
    assert mesh["spec"] == "P('tp', None, None)" and mesh["shards"] == 4  # two whole experts per chip


CFG = TransformerConfig(vocab_size=32, hidden_size=36, num_layers=1, num_heads=6, num_kv_heads=2,
                        intermediate_size=64, max_seq_len=32)


def test_mesh_flag_and_defaults() -> None:
    assert parse_mesh("tp=4") == 4
    for bad in ("tp=0", "dp=2", "tp", "tp=x"):
        with pytest.raises(MeshError, match="expected tp=N"):
            parse_mesh(bad)
    cpu = jax.local_devices()
    assert default_tp(CFG, cpu) == 1  # extra CPU devices are the same cores
    with pytest.raises(MeshError, match="only 1 cpu device"):
        rollout_mesh(CFG, 2, cpu)
    fake_gpus = [type("Chip", (), {"platform": "gpu"})()] * 8
    assert default_tp(CFG, fake_gpus) == 6  # the most chips that divide the 6 heads
