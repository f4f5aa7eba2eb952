"""Gemma samples and trains consistently: the sampler's recorded log-probs (prefill, then cached
decode steps past the sliding window) equal the trainer's chunked, rematerialised ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.model.hf import to_hf
from stoker.model.logprobs import token_stats
from stoker.model.model import Transformer, init_model
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig

GEMMA2_LIKE = TransformerConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
    tie_embeddings=True, mlp_activation="gelu-tanh", norm_unit_offset=True, sandwich_norms=True,
    embedding_scale=True, query_pre_attn_scalar=8, attn_logit_softcap=5.0, final_logit_softcap=3.0,
    sliding_window=4, global_layer_every=2,
)


def _trainer_logprobs(model: Transformer, seq: list[int], temperature: float) -> np.ndarray:
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state: nnx.State, ids: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        t = ids.shape[1]
        hidden = m.hidden_states(ids, jnp.arange(t)[None], jnp.ones((1, t), jnp.int32), remat="full")
        return token_stats(hidden[:, :-1], m.output_head(), ids[:, 1:], temperature=temperature, chunk=4).logprobs

    return np.asarray(run(state, jnp.asarray([seq], jnp.int32)))[0]


def test_gemma_sampler_logprobs_equal_the_trainers() -> None:
    model = init_model(GEMMA2_LIKE, seed=0)
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "weight":  # Gemma's norms scale by (1 + w): w = 0 would hide the offset
            var.set_value(jnp.asarray(rng.normal(0.0, 0.3, var.get_value().shape), jnp.float32))
    sampler = Sampler(GEMMA2_LIKE, SamplingSpec(temperature=0.7, top_p=1.0), seed=0, buckets=(16,),
                      params=to_hf(model), min_batch=2)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    for prompt, gen in zip(prompts, sampler.generate(prompts, max_new_tokens=7), strict=True):
        assert len(gen.token_ids) == 7
        want = _trainer_logprobs(model, prompt + gen.token_ids, 0.7)[len(prompt) - 1 :]
        np.testing.assert_allclose(gen.logprobs, want, atol=1e-4)
