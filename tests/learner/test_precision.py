"""The learner's stored precisions (spec.learner.optimizerStateDtype, spec.learner.weightDtype):
Adam with moments stored in bfloat16 against the equations (Kingma & Ba 2015, Algorithm 1) in
numpy float64, jit and eager; bfloat16 master weights rounded once per update; both tracking the
float32 run on a tiny model, which still learns; checkpoints, publish and PPO's critic with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from stoker.learner.checkpoint import flatten
from stoker.learner.loop import Learner
from stoker.learner.optimizer import B1, B2, EPS, OptimizerConfig, make_optimizer, scale_by_adam_stored
from tests.learner.bandit import GOOD, bandit_groups, next_token_probs, settings, with_reward_spread

pytestmark = pytest.mark.usefixtures("xla_cache")
BF16 = ml_dtypes.bfloat16
# The stored precisions as a job writes them (spec layers for ``settings``).
BF16_WEIGHTS = {"learner": {"weightDtype": "bfloat16"}}
BF16_STATE = {"learner": {"optimizerStateDtype": "bfloat16"}}
BF16_STORED = {"learner": {"weightDtype": "bfloat16", "optimizerStateDtype": "bfloat16"}}
STEPS = 6


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return (lambda f: jax.jit(f)) if request.param else (lambda f: f)


def gradients(step: int) -> dict[str, np.ndarray]:
    """Gradients spread over five decades, signs mixed, a new draw each step."""
    rng = np.random.default_rng(step)
    scale = 10.0 ** rng.uniform(-4, 1, size=(3, 5))
    return {"w": (rng.standard_normal((3, 5)) * scale).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}


def adam_reference(
    m: np.ndarray, v: np.ndarray, g: np.ndarray, t: int, m_size: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Kingma & Ba's update at step t (from 1), in float64: new m, new v, m_hat / (sqrt(v_hat) + eps),
    and the size of the terms that make m and the direction (``m_size``: the previous m's, |m|
    when None). m cancels where g changes sign; float32 is exact to its resolution of the terms
    summed, not of their difference."""
    m0, v, g = (np.asarray(x, np.float64) for x in (m, v, g))
    m = B1 * m0 + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    denominator = np.sqrt(v / (1 - B2**t)) + EPS
    size = B1 * (np.abs(m0) if m_size is None else m_size) + (1 - B1) * np.abs(g)
    return m, v, (m / (1 - B1**t)) / denominator, size, (size / (1 - B1**t)) / denominator


def assert_close(got: Any, want: np.ndarray, size: np.ndarray, rtol: float = 1e-6) -> None:
    """|got - want| <= rtol x the size of the terms that made ``want``."""
    error = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(error <= rtol * size), f"max error / size {np.max(error / size):.3g} > {rtol}"


def test_float32_stored_adam_follows_the_equations_and_optax(maybe_jit: Any) -> None:
    adam = scale_by_adam_stored(jnp.float32)
    state = adam.init(jax.tree.map(jnp.zeros_like, gradients(0)))
    optax_state = optax.scale_by_adam().init(jax.tree.map(jnp.zeros_like, gradients(0)))
    update, optax_update = maybe_jit(adam.update), maybe_jit(optax.scale_by_adam().update)
    m = {k: np.zeros_like(x, np.float64) for k, x in gradients(0).items()}
    v = {k: np.zeros_like(x, np.float64) for k, x in gradients(0).items()}
    m_size = {k: np.zeros_like(x, np.float64) for k, x in gradients(0).items()}
    for t in range(1, STEPS + 1):
        g = gradients(t)
        direction, state = update(g, state)
        optax_direction, optax_state = optax_update(g, optax_state)
        assert int(state.count) == t
        for k in g:
            m[k], v[k], expected, m_size[k], size = adam_reference(m[k], v[k], g[k], t, m_size[k])
            assert_close(direction[k], expected, size)
            assert_close(state.mu[k], m[k], m_size[k])
            assert_close(state.nu[k], v[k], v[k])  # a sum of positive terms: plain rtol
            # optax's float32 1 - b2^t loses ~1e-5 relative to cancellation at small t (0.999^t in float32).
            np.testing.assert_allclose(np.asarray(direction[k]), np.asarray(optax_direction[k]), rtol=2e-5)
            assert state.mu[k].dtype == state.nu[k].dtype == jnp.float32


def test_bfloat16_stored_adam_rounds_the_float32_update_of_its_upcast_state(maybe_jit: Any) -> None:
    """Every step: the stored m and v are exactly the bfloat16 rounding of b1 m + (1 - b1) g and
    b2 v + (1 - b2) g^2 computed in float32 from the stored state upcast; the direction comes from
    those float32 moments before rounding (float64 equations, rtol 1e-6)."""
    adam = scale_by_adam_stored(jnp.bfloat16)
    state = adam.init(gradients(0))
    update = maybe_jit(adam.update)
    for t in range(1, STEPS + 1):
        g = gradients(t)
        stored_m = {k: np.asarray(x).astype(np.float32) for k, x in state.mu.items()}
        stored_v = {k: np.asarray(x).astype(np.float32) for k, x in state.nu.items()}
        direction, state = update(g, state)
        for k in g:
            assert state.mu[k].dtype == state.nu[k].dtype == jnp.bfloat16, k
            m32 = np.float32(B1) * stored_m[k] + np.float32(1 - B1) * g[k]  # float32 arithmetic
            v32 = np.float32(B2) * stored_v[k] + np.float32(1 - B2) * np.square(g[k])
            np.testing.assert_array_equal(np.asarray(state.mu[k]), m32.astype(BF16))
            np.testing.assert_array_equal(np.asarray(state.nu[k]), v32.astype(BF16))
            _, _, expected, _, size = adam_reference(stored_m[k], stored_v[k], g[k], t)
            assert_close(direction[k], expected, size)


@pytest.mark.parametrize("config", [OptimizerConfig(), OptimizerConfig("cosine", 2, 10, 0.0, 0.1)], ids=["adam", "adamw"])
def test_bfloat16_state_keeps_the_float32_state_tree(config: OptimizerConfig) -> None:
    """The same names in the same places (checkpoints restore across the two), half the bytes;
    float32 state stays optax's own Adam/AdamW, value for value."""
    params = {"kernel": jnp.ones((4, 3)), "scale": jnp.ones(3)}
    f32 = make_optimizer(1e-3, 1.0, config)
    bf16 = make_optimizer(1e-3, 1.0, OptimizerConfig(**{**config.__dict__, "state_dtype": "bfloat16"}))
    names32, tree32 = flatten(f32.init(params))
    names16, tree16 = flatten(bf16.init(params))
    assert tree32 == tree16 and list(names32) == list(names16)
    moments = [k for k in names32 if ".mu." in k or ".nu." in k]
    assert len(moments) == 4
    assert all(names32[k].dtype == jnp.float32 and names16[k].dtype == jnp.bfloat16 for k in moments)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)) if config.schedule == "constant" else None
    if reference is not None:
        g = {"kernel": jnp.full((4, 3), 0.3), "scale": jnp.full((3,), -0.2)}
        ours, _ = f32.update(g, f32.init(params), params)
        theirs, _ = reference.update(g, reference.init(params), params)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_bfloat16_weights_take_the_float32_update_rounded_once() -> None:
    """One apply on bfloat16 master weights: new w = bf16(float32(w) + u), u the float32 update of
    the same optimizer on the gradients upcast (here with bfloat16 Adam state too)."""
    learner = Learner(settings(None, BF16_STORED))
    trainer = learner.trainer
    params = trainer.params
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(3)
    grads = jax.tree.unflatten(treedef, [jnp.asarray(rng.standard_normal(x.shape) * 0.1, jnp.bfloat16) for x in leaves])
    before = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), params)
    state = jax.tree.map(jnp.copy, trainer.opt_state)
    updates, _ = jax.jit(trainer.optimizer.update)(jax.tree.map(lambda g: g.astype(jnp.float32), grads), state,
                                                    jax.tree.map(jnp.copy, params))
    exact_norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
    new_params, new_state, norm, finite = trainer._apply(params, trainer.opt_state, grads)
    assert bool(finite)
    # The gradient norm (which the clip divides by, and the metrics report) summed in float32.
    assert exact_norm > 1.0 and float(norm) == pytest.approx(exact_norm, rel=1e-5)
    for p, u, got in zip(jax.tree.leaves(before), jax.tree.leaves(updates), jax.tree.leaves(new_params), strict=True):
        assert u.dtype == jnp.float32 and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), (p + np.asarray(u)).astype(BF16))
    assert all(x.dtype == jnp.bfloat16 for k, x in flatten(new_state)[0].items() if ".mu." in k or ".nu." in k)
    learner.close()


def _run(steps: int, *layers: dict[str, Any], tmp_path: Path | None = None) -> tuple[list[float], Learner]:
    """GRPO on the bandit (reward 1 for GOOD), the same batches for every precision: groups drawn
    from one uniform policy, trained without off-policy correction (so the step does not stop at
    the clip around the uniform sampler). Returns -log pi(GOOD) before and after each update."""
    learner = Learner(settings(tmp_path, {"algorithm": {"offPolicyCorrection": "none"}}, *layers))
    rng = np.random.default_rng(11)
    uniform = np.full(8, 1 / 8)
    regret = [-float(np.log(next_token_probs(learner)[GOOD]))]
    for _ in range(steps):
        learner.train_on(bandit_groups(learner, rng, groups=4, probs=uniform))
        regret.append(-float(np.log(next_token_probs(learner)[GOOD])))
    return regret, learner


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [BF16_WEIGHTS, BF16_STATE, {**BF16_STORED, "model": {"dtype": "bfloat16"}}],
    ids=["bf16-weights", "bf16-adam-state", "all-bf16"],
)
def test_stored_precisions_track_the_float32_run_and_still_learn(changes: dict[str, Any]) -> None:
    """Over 6 GRPO updates at lr 0.01, -log pi(GOOD) stays within 0.02 nats of the run with float32
    weights and Adam state (in the same compute dtype) after every update, and falls by more than
    1 nat: the stored precisions change the trajectory by rounding only (measured: at most 0.0066
    nats for bfloat16 weights, 1e-4 for bfloat16 Adam state, 0.0033 for both under bfloat16 compute)."""
    rate = {"algorithm": {"learningRate": 0.01}}
    reference, reference_learner = _run(6, rate, {"model": changes.get("model", {"dtype": "float32"})})
    regret, learner = _run(6, rate, changes)
    np.testing.assert_allclose(regret, reference, atol=0.02)
    assert regret[-1] < regret[0] - 1.0 and reference[-1] < reference[0] - 1.0
    assert all(b < a for a, b in zip(regret, regret[1:]))
    reference_learner.close()
    learner.close()


def test_bfloat16_checkpoints_restore_and_float32_ones_restore_rounded(tmp_path: Path) -> None:
    """A bfloat16 learner resumes its own checkpoint bit for bit (weights and Adam state), and a
    float32 checkpoint restores into it as the rounding of its arrays."""
    _, first = _run(2, BF16_STORED, tmp_path=tmp_path)
    first.save(wait=True)
    saved = flatten((first.trainer.params, first.trainer.opt_state))[0]
    second = Learner(settings(tmp_path, BF16_STORED))
    assert second.resumed and second.steps == 2
    for name, value in flatten((second.trainer.params, second.trainer.opt_state))[0].items():
        assert value.dtype == saved[name].dtype, name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(saved[name]), err_msg=name)
    first.close()
    second.close()

    f32_dir = tmp_path / "f32"
    _, full = _run(2, tmp_path=f32_dir)
    full.save(wait=True)
    saved = flatten((full.trainer.params, full.trainer.opt_state))[0]
    cast = Learner(settings(f32_dir, BF16_STORED))
    assert cast.resumed
    for name, value in flatten((cast.trainer.params, cast.trainer.opt_state))[0].items():
        want = np.asarray(saved[name])
        if want.dtype == np.float32:
            assert value.dtype == jnp.bfloat16, name
            want = want.astype(BF16)
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)
    full.close()
    cast.close()


@pytest.mark.slow
def test_bfloat16_weights_publish_a_copy_and_train_ppos_critic() -> None:
    """PPO with bfloat16 master weights: the critic's weights are bfloat16 too and train; the
    published copy (model.dtype float32 here) is a float32 copy that outlives the next update."""
    learner = Learner(settings(None, BF16_WEIGHTS, algorithm={"name": "ppo"}))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(learner.trainer.params["value"]))
    critic_before = [np.asarray(x) for x in jax.tree.leaves(learner.trainer.params["value"])]
    copy = learner.trainer.policy_copy()
    published = {k: np.asarray(v) for k, v in learner.flat_weights(copy).items()}
    assert all(v.dtype == np.float32 for v in published.values())
    rng = np.random.default_rng(2)
    for _ in range(2):
        learner.train_on(with_reward_spread(bandit_groups(learner, rng)))
    after = learner.flat_weights(copy)
    assert all(np.array_equal(after[k], published[k]) for k in published)
    critic_after = [np.asarray(x) for x in jax.tree.leaves(learner.trainer.params["value"])]
    assert any(not np.array_equal(a, b) for a, b in zip(critic_before, critic_after, strict=True))
    current = learner.flat_weights()
    assert any(not np.array_equal(current[k], published[k]) for k in published)
    learner.close()


def test_lora_with_bfloat16_weights_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="learner.weightDtype: LoRA trains float32 adapters"):
        Learner(settings(None, BF16_WEIGHTS, model={"lora": {"rank": 2, "alpha": 4.0, "targets": ["q_proj"]}}))
