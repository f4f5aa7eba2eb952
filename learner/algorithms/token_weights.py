"""Per-token weights and selections beside the loss: aggregation weights, truncated importance
weights against the behaviour policy, stale tokens, and the sampler/trainer log-prob check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stoker.learner.algorithms.config import Aggregation, Array
from stoker.learner.algorithms.ops import array_module, check_rank, check_same_shape, exp_log_ratio


def aggregation_weights(mask: Array, sequence_ids: Array, mode: Aggregation) -> Array:
    """Per-token weights that turn a per-token loss into its aggregate by a weighted sum.

    token-mean:     w_t = m_t / sum_t' m_t'                   (every trained token counts once)
    sequence-mean:  w_t = m_t / (|S| * sum_{t' in s(t)} m_t')  (every sequence counts once; |S| the
                    number of sequences with at least one trained token)

    ``mask`` is 0/1 (float or bool), shape [B, T]. The weights sum to 1 (or 0 when nothing trains).
    Works on numpy arrays (the learner's host side) and jax arrays alike.
    """
    check_rank("mask", mask, 2)
    check_same_shape(mask=mask, sequence_ids=sequence_ids)
    xp = array_module(mask, sequence_ids)
    m = xp.asarray(mask, dtype=xp.float32)
    if mode == "token-mean":
        return m / xp.maximum(m.sum(), 1.0)
    if mode != "sequence-mean":
        raise ValueError(f"aggregation {mode!r}; expected 'token-mean' or 'sequence-mean'")
    ids = xp.asarray(sequence_ids).reshape(-1)
    flat = m.reshape(-1)
    counts: Array = (
        np.bincount(ids, weights=flat, minlength=flat.size).astype(np.float32)
        if xp is np
        else jax.ops.segment_sum(flat, ids, num_segments=flat.size)
    )
    num_sequences = xp.maximum((counts > 0).sum(), 1)
    per_token = counts[ids].reshape(m.shape)
    return xp.where(m > 0, m / (xp.maximum(per_token, 1.0) * num_sequences), 0.0).astype(xp.float32)


def truncated_importance_weights(
    old_logprobs: Array, behaviour_logprobs: Array, mask: Array, cap: float, enabled: bool = True
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token truncated importance weights against the behaviour (sampling) policy.

        rho_t = pi_old(y_t) / mu(y_t) = exp(log pi_old - log mu),   w_t = min(rho_t, cap)

    (IMPALA's truncated rho, Espeholt et al. 2018). No gradient flows through ``w``. Returns the
    weights (1 off the mask, or everywhere when ``enabled`` is False) and sums for the metrics:
    ``is_weight_sum`` / ``is_weight_max`` of the untruncated rho, ``is_clipped`` (tokens whose rho
    exceeded the cap), ``is_tokens``.
    """
    check_same_shape(old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    on = jnp.asarray(mask) > 0
    log_rho = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(old_logprobs)) - jnp.asarray(behaviour_logprobs), 0.0)
    rho = exp_log_ratio(log_rho)
    weights = jnp.minimum(rho, cap) if enabled else jnp.ones_like(rho)
    stats = {
        "is_weight_sum": jnp.sum(jnp.where(on, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(on, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(on & (rho > cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(on.astype(jnp.float32)),
    }
    return jax.lax.stop_gradient(jnp.where(on, weights, 1.0)), stats


def sampler_trainer_logprob_stats(
    trainer_logprobs: Array, behaviour_logprobs: Array, versions: Array, mask: Array, trainer_version: Array
) -> dict[str, jax.Array]:
    """The TiTO consistency check: trainer minus sampler log-probs on same-version tokens.

    On tokens the actor sampled with exactly the parameters the trainer holds (``versions ==
    trainer_version``), both sides compute log pi(y_t) of the same token with the same weights, so
    ``d_t = log pi_trainer - log mu`` should be ~0; a mean or spread away from 0 means token-in /
    token-out drifted (re-tokenisation, a chat template mismatch, a sampler temperature not
    accounted for). Returns sums (``tito_sum``, ``tito_sumsq``, ``tito_tokens``) for the mean and
    std.
    """
    check_same_shape(trainer_logprobs=trainer_logprobs, behaviour_logprobs=behaviour_logprobs, versions=versions, mask=mask)
    same = (jnp.asarray(mask) > 0) & (jnp.asarray(versions) == trainer_version)
    diff = jnp.where(same, jax.lax.stop_gradient(jnp.asarray(trainer_logprobs)) - jnp.asarray(behaviour_logprobs), 0.0)
    return {"tito_sum": diff.sum(), "tito_sumsq": (diff**2).sum(), "tito_tokens": same.sum().astype(jnp.float32)}


def stale_tokens(versions: Array, mask: Array, current_version: int, max_staleness: int) -> Array:
    """Model tokens sampled more than ``max_staleness`` versions before ``current_version``.

    The learner zeroes these out of the loss weights before anything else, so data past
    ``buffer.maxStaleness`` never reaches the loss. Works on numpy and jax arrays.
    """
    check_same_shape(versions=versions, mask=mask)
    return (mask > 0) & ((current_version - versions) > max_staleness)
