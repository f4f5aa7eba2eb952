"""Long rows: chunked log-probs and blockwise attention keep the gradient step's memory down and
its gradients equal to the dense computation's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stoker.learner import train
from stoker.model import attention, logprobs
from stoker.model.model import Transformer, init_model
from stoker.learner.sharding import make_mesh
from stoker.spec import TransformerConfig

CFG = TransformerConfig(vocab_size=512, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, max_seq_len=1024)


def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks and chunks small enough to split a tiny model's rows (16 tokens each at 128)."""
    monkeypatch.setattr(attention, "BLOCK_SCORE_ELEMENTS", 4 * 16 * 128)
    monkeypatch.setattr(logprobs, "CHUNK_LOGIT_ELEMENTS", 16 * CFG.vocab_size)


def _dense_loss(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
    """The computation before chunking: full [B, T, V] logits, one attention block, no remat."""
    logits = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    logp = logprobs.token_logprobs(logits, batch["targets"])
    ent = logprobs.token_entropy(logits)
    return jnp.sum(batch["weights"] * (logp + 0.1 * ent))


def _chunked_loss(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
    hidden = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"], remat="full")
    stats = logprobs.token_stats(hidden, model.output_head(), batch["targets"], entropy=True)
    assert stats.entropy is not None
    return jnp.sum(batch["weights"] * (stats.logprobs + 0.1 * stats.entropy))


def _batch(t: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    seg = np.ones((1, t), np.int32)
    seg[0, t // 3 :] = 2  # two packed sequences
    seg[0, t - 5 :] = 0  # and padding
    pos = np.concatenate([np.arange(t // 3), np.arange(t - t // 3)])[None].astype(np.int32)
    return {
        "tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (1, t)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, CFG.vocab_size, (1, t)), jnp.int32),
        "positions": jnp.asarray(pos),
        "segment_ids": jnp.asarray(seg),
        "weights": jnp.asarray((seg > 0) / (seg > 0).sum(), jnp.float32),
    }


def _grads(loss: Any, model: Transformer, batch: dict[str, jax.Array], jit: bool) -> Any:
    graphdef, state = nnx.split(model)
    fn = jax.grad(lambda s: loss(nnx.merge(graphdef, s), batch))
    return (jax.jit(fn) if jit else fn)(state)


def test_chunked_remat_gradients_equal_the_dense_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jitted only: eager runs of the same primitives are covered by test_families' forwards."""
    _small_chunks(monkeypatch)
    model = init_model(CFG, seed=0)
    batch = _batch(128)
    want = _grads(_dense_loss, model, batch, jit=True)
    got = _grads(_chunked_loss, model, batch, jit=True)
    assert logprobs.chunk_tokens(1, 128, CFG.vocab_size) == 16 and attention.query_block(1, 4, 128, 128) == 16
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def _temp_bytes(loss: Any, t: int) -> int:
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch(t).items()}
    lowered = jax.jit(jax.grad(lambda s, b: loss(nnx.merge(graphdef, s), b))).lower(state, batch)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def test_the_gradient_step_never_holds_the_full_logits_or_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 512 tokens the dense step's temporaries are dominated by the [T, V] logits and the
    [H, T, T] scores of every layer; chunked they are a few chunks' and blocks' worth."""
    _small_chunks(monkeypatch)
    dense, chunked = _temp_bytes(_dense_loss, 512), _temp_bytes(_chunked_loss, 512)
    assert chunked < dense / 2, (chunked, dense)  # measured 3.2 MB against 7.2 MB


def test_trainer_reports_memory_of_an_abstract_model() -> None:
    """No weights are allocated: the Trainer over nnx.eval_shape compiles and reports
    (benchmarks/learner_memory.py reads the 0.5B figures this way)."""
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    trainer = train.Trainer(model, train.StepOptions(), optax.adam(1e-3), make_mesh(devices=jax.devices()[:1]))
    assert trainer.abstract and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainer.params))
    assert trainer.memory_analysis(1, 128).temp_size_in_bytes > 0
