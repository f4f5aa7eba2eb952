"""On-policy distillation: the per-token reverse KL and its gradient against the equation, the
teacher scoring the student's tokens inside the train step, and a teacher of another tokenizer
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from stoker.learner import sharding, train
from stoker.learner.algorithms import LossConfig, distill_loss
from stoker.learner.settings import LearnerSettings
from stoker.learner.packing import TrainSequence, pack, rows_for_buckets
from stoker.learner.teacher import TeacherError, load_teacher
from stoker.model.hf import save_checkpoint
from stoker.model.logprobs import token_logprobs
from stoker.model.model import init_model
from stoker.spec import RLJobSpec, TransformerConfig

pytestmark = pytest.mark.usefixtures("xla_cache")

V = 6


def per_token_loss(z: jax.Array, y: jax.Array, teacher: jax.Array, mu: jax.Array, known: jax.Array, w: jax.Array,
                   cap: float = 2.0, **divergence: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    logp = jnp.take_along_axis(jax.nn.log_softmax(z), y[..., None], -1)[..., 0]
    t = jnp.take_along_axis(teacher, y[..., None], -1)[..., 0]
    return distill_loss(logp, t, mu, known, w, cap, **divergence)


@pytest.mark.parametrize("jit", [False, True])
def test_reverse_kl_and_its_gradient_per_token(jit: bool) -> None:
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(1, 4, V)), jnp.float32)  # the student's logits at 4 positions
    teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(1, 4, V)), jnp.float32))
    y = jnp.asarray([[0, 3, 5, 2]], jnp.int32)
    w = jnp.asarray([[0.25, 0.25, 0.0, 0.5]], jnp.float32)
    zeros = jnp.zeros((1, 4), jnp.float32)
    grad_fn = jax.grad(lambda z: per_token_loss(z, y, teacher, zeros, zeros, w)[0])
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    grad = np.asarray(grad_fn(z))
    p = np.asarray(jax.nn.softmax(z))
    log_s = np.log(p)
    onehot = np.eye(V)[np.asarray(y)]
    t_y = np.take_along_axis(np.asarray(teacher), np.asarray(y)[..., None], -1)[..., 0]
    s_y = np.take_along_axis(log_s, np.asarray(y)[..., None], -1)[..., 0]
    # d l_t / d z_t = -w_t (log pi_T(y_t) - log pi_S(y_t)) (onehot(y_t) - softmax(z_t))
    expected = -(np.asarray(w) * (t_y - s_y))[..., None] * (onehot - p)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    _, stats = per_token_loss(z, y, teacher, zeros, zeros, w)
    assert float(stats["reverse_kl"]) == pytest.approx(float((np.asarray(w) * (s_y - t_y)).sum()), rel=1e-5)

    # Over the student's own samples the per-token gradient is the reverse KL's exact gradient:
    # sum_y pi_S(y) grad l(y) = grad_z sum_y pi_S(y) (log pi_S(y) - log pi_T(y)) at every position.
    def exact_kl(z: jax.Array) -> jax.Array:
        log_pi = jax.nn.log_softmax(z)
        return jnp.sum(jnp.exp(log_pi) * (log_pi - teacher))

    exact = np.asarray(jax.grad(exact_kl)(z))
    expectation = np.zeros_like(exact)
    ones = jnp.ones((1, 4), jnp.float32)
    for token in range(V):
        every = jnp.full((1, 4), token, jnp.int32)
        g = np.asarray(jax.grad(lambda z: per_token_loss(z, every, teacher, zeros, zeros, ones)[0])(z))
        expectation += p[..., token : token + 1] * g
    np.testing.assert_allclose(expectation, exact, rtol=1e-4, atol=1e-6)


def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_jsd(log_t: np.ndarray, z: np.ndarray, beta: float) -> np.ndarray:
    """JSD_beta(T||S) = beta KL(T||M) + (1-beta) KL(S||M), M = beta T + (1-beta) S, per position."""
    t, s = np.exp(log_t), np.exp(np_log_softmax(z))
    m = beta * t + (1 - beta) * s
    return beta * (t * np.log(t / m)).sum(-1) + (1 - beta) * (s * np.log(s / m)).sum(-1)


def np_grad(f: Any, z: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of sum(f(z)) in float64."""
    grad = np.zeros_like(z)
    for index in np.ndindex(z.shape):
        step = np.zeros_like(z)
        step[index] = h
        grad[index] = (f(z + step).sum() - f(z - step).sum()) / (2 * h)
    return grad


def expected_over_samples(z: jax.Array, teacher: jax.Array, **divergence: Any) -> tuple[np.ndarray, np.ndarray]:
    """sum_y pi_S(y) (grad l(y), jsd stat(y)) at every position: the estimator's expectation."""
    p = np.asarray(jax.nn.softmax(z), np.float64)
    shape = z.shape[:-1]
    zeros, ones = jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32)
    grad, value = np.zeros(z.shape), np.zeros(shape)
    for token in range(z.shape[-1]):
        every = jnp.full(shape, token, jnp.int32)
        g = jax.grad(lambda z: per_token_loss(z, every, teacher, zeros, zeros, ones, **divergence)[0])(z)
        grad += p[..., token : token + 1] * np.asarray(g)
        per_position = [  # the stat of one position at a time (it is a sum over positions)
            float(per_token_loss(z, every, teacher, zeros, zeros, jnp.asarray(np.eye(shape[-1])[None, i], jnp.float32),
                                 **divergence)[1].get("jsd", 0.0)) for i in range(shape[-1])
        ]
        value += p[..., token] * np.asarray(per_position)[None]
    return grad, value


@pytest.mark.parametrize("jit", [False, True])
def test_generalized_jsd_loss_and_gradient_per_token(jit: bool) -> None:
    beta = 0.3
    rng = np.random.default_rng(2)
    z64 = rng.normal(size=(1, 4, V))
    t64 = np_log_softmax(rng.normal(size=(1, 4, V)))
    z, teacher = jnp.asarray(z64, jnp.float32), jnp.asarray(t64, jnp.float32)
    y = np.asarray([[0, 3, 5, 2]])
    w = np.asarray([[0.25, 0.25, 0.0, 0.5]])
    zeros = jnp.zeros((1, 4), jnp.float32)

    def loss_and_grad(z: jax.Array) -> tuple[tuple[jax.Array, dict[str, jax.Array]], jax.Array]:
        return jax.value_and_grad(
            lambda z: per_token_loss(z, jnp.asarray(y), teacher, zeros, zeros, jnp.asarray(w, jnp.float32),
                                     divergence="jsd", beta=beta), has_aux=True)(z)

    fn = jax.jit(loss_and_grad) if jit else loss_and_grad
    (loss, stats), grad = fn(z)
    log_s = np_log_softmax(z64)
    s_y = np.take_along_axis(log_s, y[..., None], -1)[..., 0]
    t_y = np.take_along_axis(t64, y[..., None], -1)[..., 0]
    log_m = np.log(beta * np.exp(t_y) + (1 - beta) * np.exp(s_y))
    advantage = (1 - beta) * (log_m - s_y)
    # l_t = -w_t A_t log pi_S(y_t); d l_t / d z_t = -w_t A_t (onehot(y_t) - softmax(z_t))
    assert float(loss) == pytest.approx(float(-(w * advantage * s_y).sum()), rel=1e-5)
    expected = -(w * advantage)[..., None] * (np.eye(V)[y] - np.exp(log_s))
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-6)
    jsd_y = beta * np.exp(t_y - s_y) * (t_y - log_m) + (1 - beta) * (s_y - log_m)
    assert float(stats["jsd"]) == pytest.approx(float((w * jsd_y).sum()), rel=1e-5)
    assert float(stats["reverse_kl"]) == pytest.approx(float((w * (s_y - t_y)).sum()), rel=1e-5)

    # Over the student's samples: the gradient is JSD_beta's exact gradient, the stat its value.
    grad_mean, value_mean = expected_over_samples(z, teacher, divergence="jsd", beta=beta)
    np.testing.assert_allclose(grad_mean, np_grad(lambda z: np_jsd(t64, z, beta), z64), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(value_mean, np_jsd(t64, z64, beta), rtol=1e-4, atol=1e-7)


def test_generalized_jsd_tends_to_forward_kl_and_to_reverse_kl() -> None:
    rng = np.random.default_rng(3)
    z64 = rng.normal(size=(1, 3, V))
    t64 = np_log_softmax(rng.normal(size=(1, 3, V)))
    z, teacher = jnp.asarray(z64, jnp.float32), jnp.asarray(t64, jnp.float32)
    log_s = np_log_softmax(z64)
    forward_kl = (np.exp(t64) * (t64 - log_s)).sum(-1)
    reverse_kl = (np.exp(log_s) * (log_s - t64)).sum(-1)

    # beta -> 0: JSD_beta / beta -> KL(T||S), whose gradient in the logits is softmax(z) - pi_T.
    small = 1e-3
    grad, value = expected_over_samples(z, teacher, divergence="jsd", beta=small)
    np.testing.assert_allclose(grad / small, np.exp(log_s) - np.exp(t64), rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(value / small, forward_kl, rtol=2e-2)

    # beta -> 1: JSD_beta / (1-beta) -> KL(S||T), and each sampled token's gradient / (1-beta) ->
    # the reverse-KL path's gradient of that token.
    small = 1e-3
    grad, value = expected_over_samples(z, teacher, divergence="jsd", beta=1 - small)
    rkl_grad, _ = expected_over_samples(z, teacher)
    np.testing.assert_allclose(grad / small, rkl_grad, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(value / small, reverse_kl, rtol=2e-2)
    y = jnp.asarray([[1, 4, 0]], jnp.int32)
    ones, zeros = jnp.ones((1, 3), jnp.float32), jnp.zeros((1, 3), jnp.float32)
    token_jsd = jax.grad(lambda z: per_token_loss(z, y, teacher, zeros, zeros, ones, divergence="jsd", beta=1 - small)[0])(z)
    token_rkl = jax.grad(lambda z: per_token_loss(z, y, teacher, zeros, zeros, ones)[0])(z)
    np.testing.assert_allclose(np.asarray(token_jsd) / small, np.asarray(token_rkl), rtol=2e-2, atol=2e-3)


def test_jsd_beta_is_bounded_in_the_spec_and_reaches_the_loss() -> None:
    for beta in (0.0, 1.0):
        with pytest.raises(ValueError, match="beta"):
            RLJobSpec.model_validate({"algorithm": {"name": "distill", "teacher": {
                "checkpoint": "/m/t", "divergence": "jsd", "beta": beta}}})
    spec = RLJobSpec.model_validate({"algorithm": {"name": "distill", "teacher": {
        "checkpoint": "/m/t", "divergence": "jsd", "beta": 0.2}}})
    loss = LearnerSettings.from_spec(spec).loss
    assert (loss.divergence, loss.jsd_beta) == ("jsd", 0.2)
    assert RLJobSpec.model_validate({"algorithm": {"name": "distill", "teacher": {"checkpoint": "/m/t"}}}
                                    ).algorithm.teacher.divergence == "reverse_kl"  # type: ignore[union-attr]


def test_stale_tokens_are_importance_weighted() -> None:
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(size=(1, 3, V)), jnp.float32)
    teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(1, 3, V)), jnp.float32))
    y = jnp.asarray([[1, 2, 4]], jnp.int32)
    w = jnp.full((1, 3), 1 / 3, jnp.float32)
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(z)), np.asarray(y)[..., None], -1)[..., 0]
    mu = jnp.asarray(logp + np.asarray([[0.0, -0.5, 3.0]]), jnp.float32)  # pi/mu = 1, e^0.5, e^-3
    known = jnp.ones((1, 3), jnp.float32)
    zeros = jnp.zeros((1, 3), jnp.float32)
    weighted = np.asarray(jax.grad(lambda z: per_token_loss(z, y, teacher, mu, known, w, cap=1.5)[0])(z))
    plain = np.asarray(jax.grad(lambda z: per_token_loss(z, y, teacher, zeros, zeros, w)[0])(z))
    ratios = np.minimum(np.exp(np.asarray([0.0, 0.5, -3.0])), 1.5)
    np.testing.assert_allclose(weighted, plain * ratios[None, :, None], rtol=1e-5, atol=1e-7)


STUDENT = TransformerConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=32, max_seq_len=32)
TEACHER = STUDENT.model_copy(update={"hidden_size": 32, "num_layers": 2})


@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_the_step_scores_the_students_tokens_under_the_teacher_and_moves_toward_it(divergence: str) -> None:
    beta = 0.5
    teacher = init_model(TEACHER, 7)
    options = train.StepOptions("distill", loss=LossConfig(divergence=divergence, jsd_beta=beta))  # type: ignore[arg-type]
    trainer = train.Trainer(init_model(STUDENT, 0), options, optax.adam(0.05), sharding.make_mesh(), teacher_model=teacher)
    ids = np.asarray([1, 2, 3, 4, 5, 6, 7, 3], np.int32)
    mask = np.asarray([0, 0, 1, 1, 1, 1, 1, 1], np.uint8)
    seq = TrainSequence(ids, mask, np.zeros(8, np.float32), np.full(8, -1, np.int32), behaviour_known=False)
    micros = pack([[seq]], (8, 16), rows_for_buckets((8, 16), 64))
    train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")

    def logprobs(model: object) -> np.ndarray:
        logits = model(jnp.asarray(ids[None]), jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32))  # type: ignore[operator]
        return np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(ids[None, 1:])))[0]

    teacher_lp = logprobs(teacher)
    trained = mask[1:] > 0
    student_lp = logprobs(trainer.policy_model())
    before = float(np.mean((student_lp - teacher_lp)[trained]))
    first = trainer.step(micros, 0)
    assert first["reverse_kl"] == pytest.approx(before, rel=1e-4, abs=1e-5)  # the teacher scored these tokens
    metric = "reverse_kl"
    if divergence == "jsd":  # the step's jsd is the per-token estimate from the two models' log-probs
        metric = "jsd"
        log_m = np.logaddexp(np.log(beta) + teacher_lp, np.log1p(-beta) + student_lp)
        estimate = beta * np.exp(teacher_lp - student_lp) * (teacher_lp - log_m) + (1 - beta) * (student_lp - log_m)
        assert first["jsd"] == pytest.approx(float(np.mean(estimate[trained])), rel=1e-4, abs=1e-5)
    for version in range(1, 15):
        last = trainer.step(micros, version)
    assert abs(last[metric]) < 0.5 * abs(first[metric])


def write_checkpoint(path: Path, config: TransformerConfig, vocab: list[str] | None) -> Path:
    save_checkpoint(init_model(config, 3), path)
    if vocab is not None:
        tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": vocab[1]}))
    return path


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    words = ["<unk>", "<eot>", "a", "b", "c", "d", "e", "f"]
    student = write_checkpoint(tmp_path / "student", STUDENT, words)
    spec = RLJobSpec.model_validate({"model": {"checkpoint": str(student)}, "algorithm": {"name": "distill",
                                     "teacher": {"checkpoint": str(student)}}})
    same = write_checkpoint(tmp_path / "same", TEACHER, words)
    assert load_teacher(spec, str(same), jnp.float32, 8).config.hidden_size == 32
    other = write_checkpoint(tmp_path / "other", TEACHER, [*words[:6], "g", "h"])
    with pytest.raises(TeacherError) as refused:
        load_teacher(spec, str(other), jnp.float32, 8)
    message = str(refused.value)
    assert "\n" not in message and "tokenizer differs from the student's" in message and str(other) in message
    wider = write_checkpoint(tmp_path / "wider", TEACHER.model_copy(update={"vocab_size": 16}), None)
    with pytest.raises(TeacherError, match="vocab_size 16, the student's 8"):
        load_teacher(spec, str(wider), jnp.float32, 8)
