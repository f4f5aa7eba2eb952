"""Loss statistics: sums and counts per micro-batch, combined, then turned into the reported metrics."""

from __future__ import annotations

import numpy as np

# Stats combined by maximum rather than sum (across micro-batches and shards).
MAX_STATS = frozenset({"is_weight_max", "staleness_max", "behaviour_log_w_abs_max"})


def combine_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Add two micro-batches' stats (maxima take the max)."""
    out = dict(a)
    for key, value in b.items():
        if key in out:
            out[key] = max(out[key], value) if key in MAX_STATS else out[key] + value
        else:
            out[key] = value
    return out


def finalize_stats(sums: dict[str, float]) -> dict[str, float]:
    """Turn summed stats into the reported metrics (means, fractions, std)."""
    out: dict[str, float] = {}
    for key in ("pg_loss", "value_loss", "kl", "entropy", "loss", "reverse_kl", "jsd"):
        if key in sums:
            out[key] = float(sums[key])
    tokens = sums.get("is_tokens", 0.0)
    if tokens:
        out["is_weight_mean"] = sums["is_weight_sum"] / tokens
        out["is_weight_max"] = float(sums["is_weight_max"])
        out["is_clipped_fraction"] = sums["is_clipped"] / tokens
    n_behaviour = sums.get("behaviour_tokens", 0.0)
    if n_behaviour:  # pi_theta / mu on the trained tokens: how off-policy the batch is
        out["behaviour_ess"] = sums["behaviour_w_sum"] ** 2 / max(sums["behaviour_w_sumsq"], 1e-30) / n_behaviour
        out["behaviour_log_w_m2"] = sums["behaviour_log_w_sumsq"] / n_behaviour
        out["behaviour_log_w_abs_max"] = float(sums["behaviour_log_w_abs_max"])
    if "episode_w_sum" in sums and sums.get("trained_tokens"):  # offPolicyCorrection episode
        out["episode_weight_mean"] = sums["episode_w_sum"] / sums["trained_tokens"]
        out["episode_weight_capped_fraction"] = sums["episode_w_capped"] / sums["trained_tokens"]
    if sums.get("m2_masked") is not None and sums.get("trained_tokens"):
        out["m2_masked_fraction"] = sums["m2_masked"] / sums["trained_tokens"]
    if "ratio_clipped" in sums and sums.get("trained_tokens"):
        out["ratio_clipped_fraction"] = sums["ratio_clipped"] / sums["trained_tokens"]
    n = sums.get("tito_tokens", 0.0)
    if n:
        mean = sums["tito_sum"] / n
        out["tito_logprob_diff_mean"] = mean
        out["tito_logprob_diff_std"] = float(np.sqrt(max(sums["tito_sumsq"] / n - mean**2, 0.0)))
        out["tito_tokens"] = n
    if sums.get("nll_tokens"):
        out["nll"] = sums["nll_sum"] / sums["nll_tokens"]
    if sums.get("moe_tokens"):  # a mixture of experts: the batch's load-balancing loss and expert load
        experts = sum(1 for key in sums if key.startswith("moe_load_"))
        load = np.array([sums[f"moe_load_{e}"] for e in range(experts)]) / sums["moe_tokens"]
        probs = np.array([sums[f"moe_prob_{e}"] for e in range(experts)]) / sums["moe_tokens"]
        out["moe_aux_loss"] = float(experts * np.sum(load * probs))  # Switch's E * sum_e f_e P_e
        share = load / max(float(load.sum()), 1e-12)  # each expert's part of the routed tokens
        out["moe_expert_load_max"], out["moe_expert_load_min"] = float(share.max()), float(share.min())
        # (token, choice) pairs an expert's capacity turned away (learner.mesh.expertCapacityFactor).
        out["moe_dropped_fraction"] = float(sums.get("moe_dropped", 0.0)) / max(float(load.sum() * sums["moe_tokens"]), 1.0)
    if sums.get("dpo_pairs"):
        out["dpo_accuracy"] = sums["dpo_accuracy_sum"] / sums["dpo_pairs"]
        out["dpo_margin_mean"] = sums["dpo_margin_sum"] / sums["dpo_pairs"]
    return out
