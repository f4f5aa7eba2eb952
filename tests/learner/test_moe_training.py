"""A mixture of experts in training: the router's load-balancing loss (Switch Transformer,
arXiv:2101.03961, eq. 4, as Hugging Face's router_aux_loss_coef weights it) against its equation,
the forward's routing sums against a per-token reference, and the learner's metrics."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stoker.learner.algorithms import finalize_stats
from stoker.learner.loop import Learner
from stoker.learner.metrics import MetricsSink
from stoker.learner.step import add_router_loss
from stoker.learner.testing import TINY_ARCHITECTURE
from stoker.model.hf import load_checkpoint
from stoker.model.moe import RouterStats, load_balancing_loss, route, router_stats
from tests.learner.bandit import bandit_groups, settings, with_reward_spread
from tests.learner.test_moe import FAMILIES, IDS, random_tensors, reference_logits, write_checkpoint

pytestmark = pytest.mark.usefixtures("xla_cache")


def numpy_aux_loss(probs: np.ndarray, k: int, valid: np.ndarray) -> float:
    """E * sum_e f_e P_e over the valid tokens, probs [N, E]: f_e the fraction of tokens whose
    top k includes e, P_e the mean probability of e."""
    rows = probs[valid]
    experts = probs.shape[1]
    chosen = np.zeros_like(rows)
    for i, p in enumerate(rows):
        chosen[i, np.argsort(-p)[:k]] = 1.0
    return float(experts * np.sum(chosen.mean(0) * rows.mean(0)))


@pytest.mark.parametrize("jit", [False, True])
def test_load_balancing_loss_follows_the_equation(jit: bool) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, (3, 7, 5)).astype(np.float32)  # [B, T, E]
    valid = rng.random((3, 7)) > 0.3

    def aux(logits: jax.Array, valid: jax.Array) -> jax.Array:
        return load_balancing_loss(router_stats(route(logits, 2, normalise=True), valid))

    got = (jax.jit(aux) if jit else aux)(jnp.asarray(logits), jnp.asarray(valid))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(float(got), numpy_aux_loss(probs.reshape(-1, 5), 2, valid.reshape(-1)), rtol=1e-5)
    # A router that spreads every token evenly over the experts scores exactly k.
    even = router_stats(route(jnp.zeros((4, 5)), 2, normalise=True), jnp.ones(4, bool))
    assert float(load_balancing_loss(RouterStats(jnp.full(5, 8 / 5), even.probs, even.tokens, even.dropped))) == pytest.approx(2.0)
    # The gradient reaches the router's probabilities only (the top-k choice is a constant).
    grad = jax.grad(lambda z: aux(z, jnp.asarray(valid)))(jnp.asarray(logits))
    assert np.all(np.isfinite(grad)) and np.any(grad != 0) and np.all(np.asarray(grad)[~valid] == 0)


def test_the_forwards_routing_sums_match_a_per_token_reference(tmp_path: Path) -> None:
    """Padding (segment id 0) is left out; every sparse layer's tokens are pooled."""
    hf = FAMILIES["qwen3_moe-step2"]
    flat = random_tensors(hf, seed=4)
    model = load_checkpoint(write_checkpoint(tmp_path, hf, flat))
    trace: list[tuple[np.ndarray, list[int]]] = []
    reference_logits(flat, hf, IDS, trace=trace)
    t, pad = len(IDS), 3
    ids = jnp.asarray([IDS + [0] * pad], jnp.int32)
    segments = jnp.asarray([[1] * t + [0] * pad], jnp.int32)
    positions = jnp.arange(t + pad, dtype=jnp.int32)[None]
    graphdef, state = nnx.split(model)
    _, stats = jax.jit(lambda s: nnx.merge(graphdef, s).hidden_states_and_routing(ids, positions, segments))(state)
    load = np.zeros(6)
    for _, top in trace:
        load[top] += 1
    assert float(stats.tokens) == len(trace) == 2 * t  # two sparse layers, the real tokens only
    np.testing.assert_array_equal(np.asarray(stats.load), load)
    np.testing.assert_allclose(np.asarray(stats.probs), sum(p for p, _ in trace), atol=1e-5)


def test_the_router_loss_joins_the_loss_and_the_metrics() -> None:
    routing = router_stats(route(jnp.asarray([[3.0, 0.0, 0.0], [2.0, 1.0, 0.0]]), 1, normalise=False), jnp.ones(2, bool))
    aux = float(load_balancing_loss(routing))
    loss, stats = add_router_loss(jnp.asarray(1.5), {"loss": jnp.asarray(1.5)}, routing, 0.1, jnp.asarray(0.5))
    assert float(loss) == pytest.approx(1.5 + 0.1 * 0.5 * aux)
    unchanged, _ = add_router_loss(jnp.asarray(1.5), {}, routing, 0.0, jnp.asarray(0.5))
    assert float(unchanged) == 1.5
    metrics = finalize_stats({k: float(v) for k, v in stats.items()})
    assert metrics["moe_aux_loss"] == pytest.approx(aux)
    assert (metrics["moe_expert_load_max"], metrics["moe_expert_load_min"]) == (1.0, 0.0)  # both chose expert 0


def test_a_moe_learner_trains_and_reports_the_router_loss() -> None:
    arch = TINY_ARCHITECTURE.model_copy(update={
        "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01, "output_router_logits": True,
    })
    learner = Learner(settings(model={"architecture": arch}))
    assert learner.trainer.router_aux_coef == 0.01
    out = learner.train_on(with_reward_spread(bandit_groups(learner, np.random.default_rng(0))))
    assert out["trained"] and np.isfinite(out["loss"])
    assert out["moe_aux_loss"] > 0 and 0.0 <= out["moe_expert_load_min"] <= 0.25 <= out["moe_expert_load_max"] <= 1.0
    assert abs(out["tito_logprob_diff_mean"]) < 1e-4  # the sampler's log-probs: the same routing
    assert out["moe_dropped_fraction"] == 0.0  # no capacity: every token reaches its experts
    # What a cluster's Prometheus scrapes.
    logger = MetricsSink(None)
    logger.record(out)
    scraped = {m.name: m.samples[0].value for m in logger.registry.collect() if m.samples}
    assert scraped["stoker_learner_moe_aux_loss"] == pytest.approx(out["moe_aux_loss"])
    assert scraped["stoker_learner_moe_expert_load_max"] == pytest.approx(out["moe_expert_load_max"])
