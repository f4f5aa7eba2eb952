"""The learner's optimizer: the spike clip (ZClip) in front of the global-norm clip and Adam."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stoker.learner.train import make_optimizer, spike_clip


def norms_through(clip: optax.GradientTransformation, norms: list[float]) -> list[float]:
    """Feed gradients of the given norms (one fixed direction); return the norms that come out."""
    direction = {"w": jnp.asarray([3.0, 4.0]) / 5.0, "b": jnp.zeros(3)}
    state = clip.init(direction)
    update = jax.jit(clip.update)
    out = []
    for n in norms:
        g, state = update(jax.tree.map(lambda d: d * n, direction), state)  # noqa: B023
        out.append(float(optax.tree.norm(g)))
    return out


def test_a_spike_is_scaled_toward_the_recent_norms_and_the_usual_passes() -> None:
    rng = np.random.default_rng(0)
    usual = list(0.2 + 0.02 * rng.standard_normal(40))  # late training: gradients 5x under a 1.0 clip
    out = norms_through(spike_clip(2.5), usual + [30.0, 0.21, 30.0])
    np.testing.assert_allclose(out[:40], usual, rtol=1e-5)  # nothing usual is touched
    # The spike (z ~ 1500) comes out at about the mean (the further out, the closer), not at 30 (nor
    # at the global clip's 1.0, still 5x the usual step).
    assert 0.18 < out[40] < 0.25
    assert out[41] == pytest.approx(0.21, rel=1e-5)
    assert out[42] < 0.25  # the first spike, clipped, did not raise the bar for the second


def test_the_warm_up_is_never_clipped() -> None:
    out = norms_through(spike_clip(2.5, warmup=25), [1.0] * 10 + [50.0] + [1.0] * 5)
    assert out[10] == pytest.approx(50.0)


def test_make_optimizer_without_spike_z_is_clip_then_adam() -> None:
    params = {"w": jnp.ones(4)}
    grads = {"w": jnp.asarray([10.0, 0.0, 0.0, 0.0])}
    for optimizer in (make_optimizer(0.1, 1.0), make_optimizer(0.1, 1.0, 2.5)):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        # Adam's first step is -lr * sign(g) where g != 0, whatever the clip did to its size.
        np.testing.assert_allclose(np.asarray(updates["w"]), [-0.1, 0.0, 0.0, 0.0], rtol=1e-4)
