"""Expert parallelism (``stoker.model.expert_parallel``): the experts split over the mesh's ``ep``
axis, tokens sent to them by all-to-all. A layout only: the experts' output, the loss and the
gradients equal the single-device computation's; with a capacity, exactly the pairs past it are
dropped. On 8 host devices, in a subprocess (JAX fixes its device count when it starts)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.learner.test_sharding import SEQUENCES
from tests.host_devices import run_on_host_devices

ROUTED = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from stoker.learner import sharding
    from stoker.model.expert_parallel import routed_experts
    from stoker.model.moe import route

    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    E, K, D, F = 8, 2, 16, 12
    x = rng.normal(size=(8, 6, D)).astype(np.float32)
    kernels = tuple(rng.normal(0, 0.3, size=(E, D, F)).astype(np.float32) for _ in range(3))
    router = rng.normal(size=(D, E)).astype(np.float32)
    valid = rng.random((8, 6)) > 0.2
    routing = route(jnp.asarray(x) @ router, K, normalise=True)
    index, weight = np.asarray(routing.top_experts), np.asarray(routing.top_gates)

    def reference(x, index, weight, valid, kernels, capacity=None, devices=1):
        # The equation, token by token in float64; with a capacity, each device's (token, choice)
        # pairs in token order, the first `capacity` of each expert kept.
        g, u, d = (np.asarray(k, np.float64) for k in kernels)
        out = np.zeros(x.shape, np.float64)
        dropped = 0
        for part in np.split(np.arange(x.shape[0]), devices):
            taken = np.zeros(E, int)
            for b in part:
                for t in range(x.shape[1]):
                    if not valid[b, t]:
                        continue
                    for j in range(K):
                        e = index[b, t, j]
                        taken[e] += 1
                        if capacity is not None and taken[e] > capacity:
                            dropped += 1
                            continue
                        h = x[b, t].astype(np.float64)
                        a = h @ g[e]
                        act = a / (1 + np.exp(-a)) * (h @ u[e])
                        out[b, t] += weight[b, t, j] * (d[e] @ act)
        return out, dropped

    def loss(x, kernels, layout):
        out, dropped = routed_experts(x, jnp.asarray(index), jnp.asarray(weight), jnp.asarray(valid), kernels, layout)
        return jnp.sum(jnp.where(jnp.asarray(valid)[..., None], out, 0.0) ** 2), (out, dropped)

    results = {}
    want, _ = reference(x, index, weight, valid, kernels)
    for name, (fsdp, ep, tp, factor) in {"ep8": (1, 8, 1, None), "fsdp2_ep2_tp2": (2, 2, 2, None),
                                         "ep4_tp2": (1, 4, 2, None), "ep1_capacity": (8, 1, 1, 0.5),
                                         "ep4_capacity": (2, 4, 1, 0.5)}.items():
        mesh = sharding.make_mesh(fsdp, tp, ep=ep)
        layout = sharding.expert_layout(mesh, E, factor)
        for jit in (True, False) if name == "fsdp2_ep2_tp2" else (True,):  # eager once: it is slow
            fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
            (_, (out, dropped)), grads = (jax.jit(fn, static_argnums=2) if jit else fn)(jnp.asarray(x), kernels, layout)
            devices = fsdp * ep
            capacity = None if factor is None else int(np.ceil(factor * K * (8 // devices) * 6 / E))
            ref, ref_dropped = reference(x, index, weight, valid, kernels, capacity, devices)
            results[f"{name}_{'jit' if jit else 'eager'}"] = {
                "error": float(np.max(np.abs(np.where(valid[..., None], np.asarray(out) - ref, 0)))),
                "dropped": float(dropped), "ref_dropped": ref_dropped,
                "grads": [np.asarray(g, np.float64).ravel()[:64].tolist() for g in (grads[0], *grads[1])],
            }
    # The dense computation's gradients: what every layout must reproduce.
    def dense_loss(x, kernels):
        g, u, d = kernels
        gates = jnp.asarray(routing.gates)
        act = jax.nn.silu(jnp.einsum("...d,edf->...ef", x, g)) * jnp.einsum("...d,edf->...ef", x, u)
        out = jnp.einsum("...ef,edf->...d", act * gates[..., None], d)
        return jnp.sum(jnp.where(jnp.asarray(valid)[..., None], out, 0.0) ** 2)
    gx, gk = jax.grad(dense_loss, argnums=(0, 1))(jnp.asarray(x), kernels)
    results["dense_grads"] = [np.asarray(g, np.float64).ravel()[:64].tolist() for g in (gx, *gk)]
    json.dump(results, sys.stdout)
    """
)

TRAINING = SEQUENCES + textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from stoker.learner import packing, sharding, train
    from stoker.learner.algorithms import LossConfig, finalize_stats
    from stoker.model.model import init_model
    from stoker.spec import TransformerConfig

    assert jax.device_count() == 8
    # Every layer sparse: 8 experts of width 64, top-2, the router's loss trained on.
    cfg = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, max_seq_len=64, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64, output_router_logits=True, router_aux_loss_coef=0.01)
    seqs = random_sequences(12, 4, 30)
    out = {}
    for name, (fsdp, ep, tp, devices, factor) in {
        "single": (1, 1, 1, jax.devices()[:1], None), "fsdp2_ep2_tp2": (2, 2, 2, None, None),
        "ep4_capacity": (2, 4, 1, None, 0.5),
    }.items():
        mesh = sharding.make_mesh(fsdp, tp, devices, ep=ep)
        rows = packing.rows_for_buckets([32, 64], 256, sharding.data_parallel_size(mesh) * 2)
        micros = packing.pack([[s] for s in seqs], [32, 64], rows)
        train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
        options = train.StepOptions("grpo", LossConfig(kl_coef=0.05), expert_capacity_factor=factor)
        trainer = train.Trainer(init_model(cfg, 0), options, train.make_optimizer(1e-2, 1.0), mesh)
        stats = [finalize_stats(trainer.step(micros, 0)) for _ in range(2)]
        leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.params)]
        experts = trainer.params["policy"]["layers"][0]["mlp"]["experts"]["gate_proj"][...]
        out[name] = {"loss": [s["loss"] for s in stats], "params": [float(np.sum(x * x)) for x in leaves],
                     "aux": [s["moe_aux_loss"] for s in stats], "dropped": [s["moe_dropped_fraction"] for s in stats],
                     "experts_spec": str(experts.sharding.spec),
                     "largest_expert_shard": max(s.data.size for s in experts.addressable_shards),
                     "expert_size": int(experts.size)}
    json.dump(out, sys.stdout)
    """
)


def test_routed_experts_compute_the_equation_on_every_layout_and_drop_exactly_the_pairs_past_capacity() -> None:
    results = run_on_host_devices(ROUTED, timeout=240)
    dense = results.pop("dense_grads")
    for name, r in results.items():
        assert r["error"] < 1e-4, (name, r["error"])
        # No capacity: nothing dropped; with one, exactly the pairs the per-device reference drops.
        assert r["dropped"] == r["ref_dropped"], name
        if "capacity" in name:
            assert r["dropped"] > 0, name
        else:
            assert r["dropped"] == 0, name
            for got, want in zip(r["grads"], dense, strict=True):  # d/dx and d/d(gate, up, down)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_an_expert_parallel_step_trains_exactly_as_one_device() -> None:
    out = run_on_host_devices(TRAINING, timeout=400)
    single = out["single"]
    for name in ("fsdp2_ep2_tp2",):
        other = out[name]
        np.testing.assert_allclose(other["loss"], single["loss"], rtol=2e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(other["aux"], single["aux"], rtol=2e-4, err_msg=name)
        np.testing.assert_allclose(other["params"], single["params"], rtol=2e-4, err_msg=name)
        assert other["dropped"] == [0.0, 0.0]
    # The experts really are split: E over ep, width over tp, hidden over fsdp.
    assert out["fsdp2_ep2_tp2"]["experts_spec"] in ("P('ep', 'fsdp', 'tp')", "PartitionSpec('ep', 'fsdp', 'tp')")
    assert out["fsdp2_ep2_tp2"]["largest_expert_shard"] == out["fsdp2_ep2_tp2"]["expert_size"] // 8
    assert out["ep4_capacity"]["experts_spec"] in ("P('ep', 'fsdp', None)", "PartitionSpec('ep', 'fsdp', None)")
    # A capacity of half an even share drops tokens, reports it, and still trains (finite, moving loss).
    capped = out["ep4_capacity"]
    assert all(0 < d < 1 for d in capped["dropped"])
    assert all(np.isfinite(capped["loss"])) and capped["params"] != single["params"]
