"""Supervised fine-tuning: the masked cross-entropy of the data's own next tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stoker.learner.algorithms.config import Array
from stoker.learner.algorithms.ops import check_rank, check_same_shape


def sft_loss(logprobs: Array, weights: Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked cross-entropy (negative log-likelihood) of the targets:

        L = - sum_t weights_t * log pi_theta(y_t | y_<t)

    ``weights`` are the aggregation weights (``aggregation_weights``: the trained tokens' mask
    normalised over the batch, so token-mean gives the mean NLL per trained token). Stats:
    ``nll_sum`` (the unweighted NLL summed over trained tokens) and ``nll_tokens``.
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(logprobs=logprobs, weights=weights)
    logp = jnp.asarray(logprobs)
    w = jnp.asarray(weights)
    on = (w > 0).astype(jnp.float32)
    loss = -jnp.sum(w * logp)
    stats = {
        "nll_sum": -jnp.sum(on * jax.lax.stop_gradient(logp)),
        "nll_tokens": jnp.sum(on),
    }
    return loss, stats
