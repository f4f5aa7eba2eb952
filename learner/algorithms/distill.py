"""On-policy distillation: the student samples, the teacher scores, the student moves toward it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from stoker.learner.algorithms.config import Array, Divergence
from stoker.learner.algorithms.ops import check_rank, check_same_shape, exp_log_ratio


def distill_loss(
    logprobs: Array,
    teacher_logprobs: Array,
    behaviour_logprobs: Array,
    behaviour_known: Array,
    weights: Array,
    importance_cap: float,
    *,
    divergence: Divergence = "reverse_kl",
    beta: float = 0.5,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token reverse KL(pi_student || pi_teacher) on the student's own samples, as a policy
    gradient whose per-token advantage is the teacher's log-ratio on the sampled token:

        A_t = log pi_T(y_t) - log pi_S(y_t)                       (no gradient)
        l_t = - w_t * A_t * log pi_S(y_t),    w_t = min(pi_S(y_t) / mu(y_t), cap)
        L   = sum_t weights_t * l_t

    For y_t ~ pi_S the gradient of l_t is an unbiased sample of the gradient of
    KL_t = sum_y pi_S(y) (log pi_S(y) - log pi_T(y)) (the score-function identity; E[grad log pi] = 0);
    ``w_t`` corrects tokens sampled by an older student ``mu`` (truncated at ``cap``; 1 where the
    sampler's log-prob is unknown). Stats: ``reverse_kl`` (sum of weights_t * (log pi_S - log pi_T),
    the per-token estimate) and ``is_*`` sums as the RL losses report them.

    ``divergence="jsd"``: generalized JSD_beta(T||S) = beta KL(T||M) + (1-beta) KL(S||M),
    M = beta pi_T + (1-beta) pi_S, whose exact gradient is (1-beta) E_{y~S}[log(S/M)(y) grad log S(y)],
    so only the advantage changes: A_t = (1-beta) (log M(y_t) - log pi_S(y_t)). Sampled-token, not
    full-vocabulary: the teacher is scored on the sampled tokens only (no [T, V] teacher logits), as
    in the reverse-KL path. Stat ``jsd``: the unbiased per-token estimate
    beta (T/S)(y) log(T/M)(y) + (1-beta) log(S/M)(y). JSD_beta/beta -> KL(T||S) as beta -> 0, and
    JSD_beta/(1-beta) -> KL(S||T) (this advantage / (1-beta) -> the reverse-KL one) as beta -> 1.
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(
        logprobs=logprobs, teacher_logprobs=teacher_logprobs, behaviour_logprobs=behaviour_logprobs,
        behaviour_known=behaviour_known, weights=weights,
    )
    logp = jnp.asarray(logprobs)
    w = jnp.asarray(weights)
    on = w > 0
    student = jax.lax.stop_gradient(logp)
    teacher = jax.lax.stop_gradient(jnp.asarray(teacher_logprobs))
    log_ratio = teacher - student  # the reverse-KL advantage
    extra: dict[str, jax.Array] = {}
    if divergence == "reverse_kl":
        advantage = log_ratio
    elif divergence == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta {beta}; expected 0 < beta < 1")
        log_mix = jnp.logaddexp(math.log(beta) + teacher, math.log1p(-beta) + student)
        advantage = (1.0 - beta) * (log_mix - student)
        jsd = beta * exp_log_ratio(log_ratio) * (teacher - log_mix) + (1.0 - beta) * (student - log_mix)
        extra["jsd"] = jnp.sum(w * jsd)
    else:
        raise ValueError(f"divergence {divergence!r}; expected reverse_kl or jsd")
    known = on & (jnp.asarray(behaviour_known) > 0)
    rho = exp_log_ratio(jnp.where(known, student - jnp.asarray(behaviour_logprobs), 0.0))
    is_w = jnp.where(known, jnp.minimum(rho, importance_cap), 1.0)
    loss = -jnp.sum(w * is_w * advantage * logp)
    stats = {
        "reverse_kl": jnp.sum(w * -log_ratio),
        "pg_loss": loss,
        "is_weight_sum": jnp.sum(jnp.where(known, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(known, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(known & (rho > importance_cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(known.astype(jnp.float32)),
        **extra,
    }
    return loss, stats
