"""Sharded training on 8 CPU devices agrees with one device; mesh and layout rules.

JAX fixes its device count when it starts, and other tests in this process already started it
with one CPU device, so the 8-device comparison runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is imported.
"""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stoker.learner import sharding
from tests.host_devices import run_on_host_devices

# Shared by the subprocess scripts below: random token rows with a loss mask, log-probs and advantages.
SEQUENCES = textwrap.dedent(
    """
    import numpy as np
    from stoker.learner import packing

    def random_sequences(count, shortest, longest):
        rng = np.random.default_rng(0)
        seqs = []
        for _ in range(count):
            n = int(rng.integers(shortest, longest))
            ids = rng.integers(0, 256, n).astype(np.int32)
            mask = (rng.random(n) < 0.6).astype(np.uint8)
            seqs.append(packing.TrainSequence(ids, mask, np.where(mask, -5.0, 0).astype(np.float32),
                                              np.where(mask, 0, -1).astype(np.int32),
                                              advantage=float(rng.normal()), reward=float(rng.random())))
        return seqs
    """
)

SCRIPT = SEQUENCES + textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from stoker.learner import packing, sharding, train
    from stoker.learner.algorithms import LossConfig
    from stoker.model.model import init_model
    from flax import nnx
    from stoker.spec import TransformerConfig

    assert jax.device_count() == 8, jax.devices()
    cfg = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, max_seq_len=64)
    seqs = random_sequences(12, 4, 30)
    out = {}
    # PPO exercises everything that could split wrongly: the value network, GAE's scan, the KL
    # reference, the shard_map'd loss and sequence-level sums.
    for algo in ("ppo",):
        results = {}
        for name, (fsdp, tp, devices) in {"single": (1, 1, jax.devices()[:1]), "fsdp4_tp2": (4, 2, None)}.items():
            mesh = sharding.make_mesh(fsdp, tp, devices)
            rows = packing.rows_for_buckets([32, 64], 256, sharding.data_parallel_size(mesh) * 2)
            micros = packing.pack([[s] for s in seqs], [32, 64], rows)
            train.assign_weights(micros, [m.arrays["mask"] for m in micros], "sequence-mean")
            value = train.ValueNetwork(cfg, rngs=nnx.Rngs(params=1)) if algo == "ppo" else None
            trainer = train.Trainer(init_model(cfg, 0), train.StepOptions(algo, LossConfig(kl_coef=0.05)),
                                    train.make_optimizer(1e-2, 1.0), mesh, value_model=value)
            stats = [trainer.step(micros, 0) for _ in range(2)]
            leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.params)]
            emb = trainer.params["policy"]["embed_tokens"]["embedding"][...]
            results[name] = {"loss": [s["loss"] for s in stats], "params": [float(np.sum(x * x)) for x in leaves],
                             "first": leaves[0].ravel()[:16].tolist(), "spec": str(emb.sharding.spec),
                             "shards": len(emb.addressable_shards), "microbatches": len(micros)}
        out[algo] = results
    json.dump(out, sys.stdout)
    """
)

@pytest.mark.slow
def test_sharded_steps_match_single_device() -> None:
    out = run_on_host_devices(SCRIPT)
    for algo, results in out.items():
        single = results["single"]
        for name in ("fsdp4_tp2",):
            other = results[name]
            np.testing.assert_allclose(other["loss"], single["loss"], rtol=2e-4, atol=1e-6, err_msg=f"{algo} {name}")
            np.testing.assert_allclose(other["params"], single["params"], rtol=2e-4, err_msg=f"{algo} {name}")
            np.testing.assert_allclose(other["first"], single["first"], rtol=2e-3, atol=1e-6, err_msg=f"{algo} {name}")
        # The parameters really were split: the embedding lives in pieces on 8 devices.
        assert results["fsdp4_tp2"]["spec"] in ("P('fsdp', 'tp')", "PartitionSpec('fsdp', 'tp')")
        assert results["fsdp4_tp2"]["shards"] == 8


VALUE_INIT = textwrap.dedent(
    """
    import functools, json, sys
    import jax, numpy as np
    from flax import nnx
    from stoker.learner import sharding, train
    from stoker.spec import TransformerConfig
    # big enough (>= MIN_SHARDED_SIZE elements) that the embedding and the MLP are split
    cfg = TransformerConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=256)
    mesh = sharding.make_mesh(4, 2)
    placed = train.init_value_network(cfg, 7, placement=functools.partial(sharding.param_sharding, mesh=mesh))
    unplaced = train.init_value_network(cfg, 7)
    eager = train.ValueNetwork(cfg, rngs=nnx.Rngs(params=7))
    out = []
    for (path, p), (_, u), (_, e) in zip(*(nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (placed, unplaced, eager)), strict=True):
        p, u, e = p.get_value(), u.get_value(), e.get_value()
        out.append({
            "name": "/".join(map(str, path)), "exact": np.asarray(p).tobytes() == np.asarray(u).tobytes(),
            "eager_close": bool(np.allclose(np.asarray(p), np.asarray(e), rtol=1e-6, atol=1e-6)),
            "training_sharding": p.sharding.is_equivalent_to(sharding.param_sharding(p.shape, mesh), p.ndim),
            "largest_shard": max(s.data.size for s in p.addressable_shards), "size": int(p.size),
        })
    json.dump(out, sys.stdout)
    """
)


def test_the_value_network_is_initialised_in_its_training_sharding_with_the_unplaced_values() -> None:
    params = run_on_host_devices(VALUE_INIT, timeout=120)
    assert len(params) >= 5
    for param in params:
        assert param["exact"] and param["training_sharding"] and param["eager_close"], param
    embedding = next(p for p in params if "embed_tokens" in p["name"])
    assert embedding["largest_shard"] == embedding["size"] // 8  # split over fsdp x tp: no device holds it whole


def test_mesh_shape_resolution() -> None:
    assert sharding.mesh_shape(8, -1, 2) == (4, 1, 2)
    assert sharding.mesh_shape(8, 8, 1) == (8, 1, 1)
    assert sharding.mesh_shape(8, -1, 2, ep=2) == (2, 2, 2)
    with pytest.raises(ValueError, match="learner.mesh.tp=3 does not divide"):
        sharding.mesh_shape(8, -1, 3)
    with pytest.raises(ValueError, match="tp=2 x ep=8 does not divide"):
        sharding.mesh_shape(8, -1, 2, ep=8)
    with pytest.raises(ValueError, match="fsdp=2 x ep=1 x tp=2 = 4"):
        sharding.mesh_shape(8, 2, 2)


def test_param_spec_rules() -> None:
    devices = np.asarray(jax.devices()[:1] * 1)
    mesh = jax.sharding.Mesh(devices.reshape(1, 1, 1), (sharding.FSDP, sharding.EP, sharding.TP))
    assert sharding.param_spec((1024, 1024), mesh) == P(None, None)  # one device: nothing to split

    class FakeMesh:
        shape = {sharding.FSDP: 4, sharding.EP: 1, sharding.TP: 2}

    fake = FakeMesh()
    assert sharding.param_spec((256, 512), fake) == P("fsdp", "tp")  # type: ignore[arg-type]
    assert sharding.param_spec((8192, 3), fake) == P("tp", None)  # type: ignore[arg-type]
    assert sharding.param_spec((8192, 3, 4), fake) == P("fsdp", None, "tp")  # type: ignore[arg-type]
    assert sharding.param_spec((512,), fake) == P(None)  # type: ignore[arg-type]
    assert sharding.param_spec((8, 8), fake) == P(None, None)  # type: ignore[arg-type]

    class ExpertMesh:
        shape = {sharding.FSDP: 2, sharding.EP: 4, sharding.TP: 2}

    experts = ExpertMesh()
    # An expert stack [E, hidden, width]: E over ep, the width over tp, hidden over fsdp.
    assert sharding.param_spec((8, 256, 96), experts) == P("ep", "fsdp", "tp")  # type: ignore[arg-type]
    # Everything else: ZeRO over fsdp x ep (both are data parallel outside the experts).
    assert sharding.param_spec((256, 512), experts) == P(("fsdp", "ep"), "tp")  # type: ignore[arg-type]
    # 4 rows: not 8-way, so over fsdp alone; 3 rows: not at all.
    assert sharding.param_spec((4, 4096), experts) == P("fsdp", "tp")  # type: ignore[arg-type]
    assert sharding.param_spec((3, 8192), experts) == P(None, "tp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ep=4 does not divide the model's 6 experts"):
        sharding.param_spec((6, 256, 96), experts)  # type: ignore[arg-type]


LAYOUT = SEQUENCES + textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from stoker.learner import packing, sharding, step, train
    from stoker.model.model import init_model
    from stoker.model.training_layout import TrainingLayout, training_layout
    from stoker.spec import TransformerConfig

    # Three layers: the layer loop (a scan over stacked parameters) runs, with remat full.
    cfg = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, max_seq_len=64)
    seqs = random_sequences(8, 8, 60)
    out = {}
    for name, (fsdp, tp, devices, seq) in {"single": (1, 1, jax.devices()[:1], False),
                                           "fsdp2_tp4_seq": (2, 4, None, True)}.items():
        mesh = sharding.make_mesh(fsdp, tp, devices)
        micros = packing.pack([[s] for s in seqs], [64], {64: 4})
        train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
        trainer = train.Trainer(init_model(cfg, 0), train.StepOptions("grpo", sequence_sharding=seq),
                                train.make_optimizer(1e-2, 1.0), mesh)
        scalars = {"version": jnp.int32(0), "num_pairs": jnp.float32(1), "micro": jnp.int32(0)}
        batch = step.batch_to_device(micros[0], mesh)
        grads, stats = trainer._grad(trainer.params, trainer.frozen, batch, scalars)
        # The residual stream as the layer loop saw it: split over tp when asked.
        hlo = trainer._grad.lower(trainer.params, trainer.frozen, batch, scalars).as_text()
        # Eagerly, outside jit, the same layout gives the same hidden states.
        model = trainer.policy_model()
        layout = TrainingLayout(lambda shape: sharding.stacked_sharding(shape, mesh),
                                sharding.residual_sharding(mesh) if seq else None)
        with training_layout(layout):
            hidden = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"], remat="full")
        out[name] = {"loss": float(stats["loss"]),
                     "grads": [np.asarray(g, np.float64).ravel().tolist() for g in jax.tree.leaves(grads)],
                     "hidden": np.asarray(hidden, np.float64).ravel()[::97].tolist(),
                     "residual_split": 'sharding_constraint' in hlo and '[{"fsdp"}, {"tp"}, {}]' in hlo}
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~270 s on two loaded cores
def test_sequence_sharding_and_stacked_layer_layout_leave_loss_and_gradients_unchanged() -> None:
    out = run_on_host_devices(LAYOUT, timeout=600)
    single, split = out["single"], out["fsdp2_tp4_seq"]
    assert split["residual_split"] and not single["residual_split"]
    # float32 throughout: only the reduction order differs between the layouts.
    np.testing.assert_allclose(split["loss"], single["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(split["grads"], single["grads"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(split["hidden"], single["hidden"], rtol=1e-5, atol=1e-5)
