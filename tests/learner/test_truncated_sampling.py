"""Top-k and min-p: tokens come only from the truncated set, the recorded log-prob is the one of the
renormalised distribution they were drawn from, and the trainer reproduces it (TiTO stays exact)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stoker.model.logprobs import OutputHead, token_stats
from stoker.model.model import init_model
from stoker.rollout.sampling import Sampler, sample_token
from stoker.spec import RLJobSpec, SamplingSpec, TransformerConfig

CONFIG = TransformerConfig()
BUCKETS = (16, 32)

pytestmark = pytest.mark.usefixtures("xla_cache")


def kept_and_logprobs(logits: np.ndarray, tau: float, top_k: int, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The equation, in float64: S = the top-k tokens with p_v >= min_p * max p (p = softmax(z/tau));
    log mu(v) = log p_v - log sum_{u in S} p_u on S."""
    z = logits.astype(np.float64) / tau
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.ones_like(p, bool)
    if top_k:
        kth = np.sort(z, -1)[:, -top_k][:, None]
        keep &= z >= kth
    if min_p:
        keep &= p >= min_p * p.max(-1, keepdims=True)
    mass = np.where(keep, p, 0).sum(-1, keepdims=True)
    return keep, np.log(p) - np.log(mass)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("top_k", "min_p"), [(3, 0.0), (0, 0.3), (5, 0.1)])
def test_tokens_come_from_the_truncated_set_with_its_renormalised_logprob(jit: bool, top_k: int, min_p: float) -> None:
    logits = np.asarray(jax.random.normal(jax.random.key(1), (4, 16)) * 2.0, np.float32)
    tau = 0.7
    keep, want = kept_and_logprobs(logits, tau, top_k, min_p)
    draw = jax.jit(sample_token) if jit else sample_token
    counts = np.zeros_like(want)
    for seed in range(60):
        tokens, logprobs = draw(
            jax.random.key(seed), jnp.asarray(logits), jnp.asarray(tau), None, jnp.asarray(top_k), jnp.asarray(min_p)
        )
        tokens = np.asarray(tokens)
        assert keep[np.arange(4), tokens].all(), "a token outside top-k/min-p was drawn"
        np.testing.assert_allclose(np.asarray(logprobs), want[np.arange(4), tokens], rtol=1e-5, atol=1e-5)
        counts[np.arange(4), tokens] += 1
    # The recorded values are a distribution over S: they sum to one there.
    np.testing.assert_allclose(np.where(keep, np.exp(want), 0).sum(-1), 1.0, rtol=1e-9)
    if top_k == 3:
        assert ((counts > 0).sum(-1) > 1).any()  # it samples, it does not just take the argmax


def test_without_truncation_nothing_changes() -> None:
    logits = jnp.asarray(jax.random.normal(jax.random.key(2), (2, 8)), jnp.float32)
    plain = sample_token(jax.random.key(0), logits, jnp.asarray(1.0), None)
    off = sample_token(jax.random.key(0), logits, jnp.asarray(1.0), None, jnp.asarray(0), jnp.asarray(0.0))
    assert np.asarray(plain[0]).tolist() == np.asarray(off[0]).tolist()
    np.testing.assert_allclose(np.asarray(plain[1]), np.asarray(off[1]), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_the_trainers_logprobs_follow_the_same_equation(jit: bool) -> None:
    vocab, tau, top_k, min_p = 16, 0.7, 5, 0.1
    logits = np.asarray(jax.random.normal(jax.random.key(3), (1, 6, vocab)) * 2.0, np.float32)
    keep, want = kept_and_logprobs(logits[0], tau, top_k, min_p)
    targets = np.asarray([[int(np.flatnonzero(row)[-1]) for row in keep]], np.int32)  # one kept token per position
    head = OutputHead(jnp.eye(vocab, dtype=jnp.float32), tied=False, final_softcap=None)  # logits = hidden

    def stats(h: jax.Array, y: jax.Array) -> jax.Array:
        return token_stats(h, head, y, temperature=tau, top_k=top_k, min_p=min_p, entropy=True).logprobs

    got = np.asarray((jax.jit(stats) if jit else stats)(jnp.asarray(logits), jnp.asarray(targets)))[0]
    np.testing.assert_allclose(got, want[np.arange(6), targets[0]], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles a sampler and a training forward
def test_the_trainer_scores_sampled_tokens_as_the_sampler_recorded_them() -> None:
    sampling = SamplingSpec(temperature=0.8, top_k=4, min_p=0.05)
    sampler = Sampler(CONFIG, sampling, seed=0, buckets=BUCKETS, min_batch=2)
    prompts = [[1, 2, 3], [4, 5]]
    gens = sampler.generate(prompts, max_new_tokens=8)
    model = init_model(CONFIG, seed=0)  # the sampler's weights: the learner's version 0
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def score(ids: jax.Array, truncated: bool) -> jax.Array:
        m = nnx.merge(graphdef, state)
        pos = jnp.arange(ids.shape[1])[None]
        hidden = m.hidden_states(ids[:, :-1], pos[:, :-1], jnp.ones_like(ids[:, :-1]))
        k, p = (sampling.top_k, sampling.min_p) if truncated else (0, 0.0)
        return token_stats(hidden, m.output_head(), ids[:, 1:], temperature=sampling.temperature, top_k=k, min_p=p).logprobs

    for prompt, gen in zip(prompts, gens, strict=True):
        ids = jnp.asarray([prompt + gen.token_ids])
        recorded = np.asarray(gen.logprobs)
        trainer = np.asarray(score(ids, True))[0, len(prompt) - 1 :]
        np.testing.assert_allclose(trainer, recorded, atol=1e-5)
        untruncated = np.asarray(score(ids, False))[0, len(prompt) - 1 :]
        assert (untruncated < recorded - 1e-4).any()  # renormalising made them likelier: a real difference


def test_the_spec_carries_top_k_and_min_p_to_both_sides() -> None:
    from stoker.learner.settings import LearnerSettings

    spec = RLJobSpec.model_validate({"actors": {"sampling": {"topK": 20, "minP": 0.05}}})
    settings = LearnerSettings.from_spec(spec)
    assert (settings.top_k, settings.min_p) == (20, 0.05)
    with pytest.raises(ValueError):
        RLJobSpec.model_validate({"actors": {"sampling": {"minP": 1.0}}})
