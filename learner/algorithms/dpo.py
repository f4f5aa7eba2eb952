"""Direct preference optimisation over chosen/rejected pairs packed as two sequences each."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stoker.learner.algorithms.config import Array, LossConfig
from stoker.learner.algorithms.ops import check_rank, check_same_shape, exp_log_ratio, segment_sum


def dpo_loss(
    logprobs: Array,
    ref_logprobs: Array,
    old_logprobs: Array,
    behaviour_logprobs: Array,
    behaviour_known: Array,
    mask: Array,
    pair_ids: Array,
    pair_sign: Array,
    config: LossConfig,
    *,
    num_pairs: Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO (Rafailov et al. 2023, eq. 7) over chosen/rejected pairs packed as two sequences each.

        h_p = beta * [ (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) ]
        L   = (1/P) sum_p - w_p * log sigmoid(h_p)

    log pi(y) sums the masked (response) tokens of a sequence. ``pair_ids`` gives each token its
    pair, ``pair_sign`` +1 on the chosen and -1 on the rejected sequence (0 on padding). ``w_p`` is
    the truncated geometric-mean IS weight of the pair's tokens,
    ``min(exp(mean_t log(pi_old / mu)), cap)``, over the tokens whose sampler log-prob is known
    (``behaviour_known``; a dataset pair has none, so its weight is 1). ``num_pairs`` is the
    normaliser P (the whole batch's pair count under gradient accumulation; this micro-batch's when
    None).
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(
        logprobs=logprobs, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour_logprobs, behaviour_known=behaviour_known, mask=mask,
        pair_ids=pair_ids, pair_sign=pair_sign,
    )
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    ids = jnp.asarray(pair_ids)
    sign = jnp.asarray(pair_sign, jnp.float32)
    log_ratio = jnp.asarray(logprobs) - jax.lax.stop_gradient(jnp.asarray(ref_logprobs))
    margin = config.dpo_beta * segment_sum(m * sign * log_ratio, ids)
    has_chosen = segment_sum(m * (sign > 0), ids) > 0
    has_rejected = segment_sum(m * (sign < 0), ids) > 0
    present = has_chosen & has_rejected
    known = m * (jnp.asarray(behaviour_known) > 0)
    log_rho_tok = known * (jax.lax.stop_gradient(jnp.asarray(old_logprobs)) - jnp.asarray(behaviour_logprobs))
    log_rho = segment_sum(log_rho_tok, ids) / jnp.maximum(segment_sum(known, ids), 1.0)
    rho = exp_log_ratio(jax.lax.stop_gradient(log_rho))
    is_w = jnp.minimum(rho, config.importance_cap) if config.importance_correction else jnp.ones_like(rho)
    count = jnp.sum(present.astype(jnp.float32))
    denom = jnp.maximum(count if num_pairs is None else jnp.asarray(num_pairs, jnp.float32), 1.0)
    per_pair = jnp.where(present, -is_w * jax.nn.log_sigmoid(margin), 0.0)
    loss = jnp.sum(per_pair) / denom
    known_pairs = present & (segment_sum(known, ids) > 0)
    stats = {
        "pg_loss": loss,
        "dpo_accuracy_sum": jnp.sum(jnp.where(present & (margin > 0), 1.0, 0.0)),
        "dpo_margin_sum": jnp.sum(jnp.where(present, jax.lax.stop_gradient(margin), 0.0)),
        "dpo_pairs": count,
        "is_weight_sum": jnp.sum(jnp.where(known_pairs, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(known_pairs, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(known_pairs & (rho > config.importance_cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(known_pairs.astype(jnp.float32)),
    }
    return loss, stats
