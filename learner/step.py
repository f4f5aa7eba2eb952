"""What the train step computes: its options (static, part of the compiled program), the per-shard
loss it differentiates, and the loss weights that make the sum over micro-batches the batch's mean.

The loss runs under ``shard_map`` (``Trainer._loss`` in ``stoker.learner.train``): every packed
sequence lies inside one row and every row inside one shard, so each shard reduces its own rows
and one ``psum`` over ``fsdp`` combines them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from stoker.learner import algorithms, lora, sharding
from stoker.learner.algorithms import LossConfig
from stoker.learner.packing import FIELDS, MicroBatch
from stoker.model.attention_kernels import Implementation
from stoker.model.model import RematPolicy
from stoker.model.moe import RouterStats, load_balancing_loss

ALGORITHMS = ("grpo", "ppo", "gspo", "dpo", "sft", "distill")
# Batch arrays the device needs (sequence_index stays on the host).
DEVICE_FIELDS = (
    "tokens", "targets", "positions", "segment_ids", "weights", "behaviour_logprobs", "behaviour_known",
    "versions", "advantages", "rewards", "pair_slot", "pair_sign", "stuck",
)


def batch_to_device(micro: MicroBatch, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """The device arrays of a micro-batch, rows split over fsdp."""
    spec = sharding.batch_sharding(mesh)
    return {name: jax.device_put(micro.arrays[name], spec) for name in DEVICE_FIELDS}


def abstract_batch(rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A [rows, length] micro-batch's device arrays as shapes (to compile ahead of time)."""
    return {name: jax.ShapeDtypeStruct((rows, length), FIELDS.get(name, np.dtype(np.float32))) for name in DEVICE_FIELDS}


@dataclass(frozen=True)
class StepOptions:
    """What the train step computes; static (part of the compiled program)."""

    algorithm: str = "grpo"
    loss: LossConfig = LossConfig()
    temperature: float = 1.0  # the actors' sampling temperature: mu is the tempered policy
    # Constrained decoding (spec.actors.sampling.allowedTokens): the policy is the model restricted
    # to these tokens, exactly as the sampler restricts it.
    allowed_token_ids: tuple[int, ...] | None = None
    # Top-k and min-p truncation (spec.actors.sampling.topK/minP): mu is the truncated, renormalised policy.
    top_k: int = 0
    min_p: float = 0.0
    # Per-layer rematerialisation (spec.model.remat): what the backward recomputes instead of storing.
    remat: RematPolicy = "full"
    # The attention kernel (spec.model.attention after attention_kernels.select_attention).
    attention: Implementation = "blockwise"
    # spec.model.lora: train low-rank adapters on a frozen base (stoker.learner.lora).
    lora: lora.LoraConfig | None = None
    # spec.learner.mesh.sequenceSharding: the residual stream's tokens split over tp between layers.
    sequence_sharding: bool = False
    # spec.learner.mesh.expertCapacityFactor: a mixture of experts' tokens per expert (None: no drops).
    expert_capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}; expected one of {', '.join(ALGORITHMS)}")

    @property
    def needs_reference(self) -> bool:
        return self.algorithm == "dpo" or self.loss.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        return self.algorithm == "distill"

    @property
    def needs_value(self) -> bool:
        return self.algorithm == "ppo"



def per_shard_loss(
    options: StepOptions,
    row_axes: str | tuple[str, ...],
    logp: jax.Array,
    extras: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    scalars: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and summed stats of this shard's rows, then combined over the ``row_axes`` the rows
    split over (psum / pmax)."""
    cfg = options.loss
    weights = batch["weights"]
    mask = (weights > 0).astype(jnp.float32)
    rows, length = logp.shape
    row_base = jnp.arange(rows, dtype=jnp.int32)[:, None] * length
    # Row-local ids are unique within the shard, which is all the segment sums need.
    sequence_ids = jnp.maximum(row_base + batch["segment_ids"] - 1, 0)
    old = batch["behaviour_logprobs"] if cfg.clips_against_behaviour(options.algorithm) else jax.lax.stop_gradient(logp)
    ref = extras.get("ref_logprobs")
    entropy = extras.get("entropy")
    lag = scalars["version"] - batch["versions"]

    def total(value: jax.Array) -> jax.Array:
        return jax.lax.psum(value, row_axes)

    if options.algorithm == "grpo":
        loss, stats = algorithms.grpo_loss(
            logp, old, batch["behaviour_logprobs"], batch["advantages"], weights, cfg,
            ref_logprobs=ref, entropy=entropy, stuck=batch["stuck"], log_not_taken=extras["log_not_taken"],
            lag=lag, total=total, sequence_ids=sequence_ids,
        )
    elif options.algorithm == "gspo":
        loss, stats = algorithms.gspo_loss(
            logp, old, batch["behaviour_logprobs"], batch["advantages"], weights, sequence_ids, cfg,
            ref_logprobs=ref, entropy=entropy, stuck=batch["stuck"], log_not_taken=extras["log_not_taken"],
        )
    elif options.algorithm == "sft":
        loss, stats = algorithms.sft_loss(logp, weights)
    elif options.algorithm == "distill":
        loss, stats = algorithms.distill_loss(
            logp, extras["teacher_logprobs"], batch["behaviour_logprobs"], batch["behaviour_known"], weights,
            cfg.importance_cap, divergence=cfg.divergence, beta=cfg.jsd_beta,
        )
    elif options.algorithm == "ppo":
        values = extras["values"]
        advantages, returns = algorithms.gae(
            batch["rewards"], values, mask, batch["segment_ids"], cfg.gamma, cfg.gae_lambda
        )
        loss, stats = algorithms.ppo_loss(
            logp, old, batch["behaviour_logprobs"], advantages, values, returns, weights, cfg,
            ref_logprobs=ref, entropy=entropy, lag=lag, total=total, sequence_ids=sequence_ids,
        )
        stats["advantage_sum"] = jnp.sum(mask * advantages)
        stats["value_sum"] = jnp.sum(mask * jax.lax.stop_gradient(values))
    else:
        assert ref is not None
        pair_ids = row_base + batch["pair_slot"]
        loss, stats = algorithms.dpo_loss(
            logp, ref, old, batch["behaviour_logprobs"], batch["behaviour_known"], mask, pair_ids,
            batch["pair_sign"], cfg, num_pairs=scalars["num_pairs"],
        )
    if options.algorithm in ("grpo", "gspo", "ppo"):
        known = mask * batch["behaviour_known"]
        stats.update(algorithms.behaviour_ratio_stats(logp - batch["behaviour_logprobs"], known))
    stats.update(
        algorithms.sampler_trainer_logprob_stats(
            logp, batch["behaviour_logprobs"], batch["versions"], mask * batch["behaviour_known"], scalars["version"]
        )
    )
    stats["trained_tokens"] = jnp.sum(mask)
    stats["loss"] = loss
    combined = {
        key: (jax.lax.pmax(value, row_axes) if key in algorithms.MAX_STATS else jax.lax.psum(value, row_axes))
        for key, value in stats.items()
    }
    return combined["loss"], combined


def add_router_loss(
    loss: jax.Array, stats: dict[str, jax.Array], routing: RouterStats, coef: float, share: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A mixture of experts' micro-batch: ``coef * share * load_balancing_loss(routing)`` added to
    the loss (``share``: the micro-batch's part of the batch's objective, the sum of its token
    weights, so the micro-batches add up to the batch's loss with coef times their mean aux loss),
    and the routing's sums added to the stats (``finalize_stats`` reports the batch's aux loss and
    expert load from them). ``coef`` 0: reported only."""
    stats = {**stats, "moe_tokens": routing.tokens, "moe_dropped": routing.dropped}
    for e in range(routing.load.shape[0]):
        stats[f"moe_load_{e}"] = routing.load[e]
        stats[f"moe_prob_{e}"] = jax.lax.stop_gradient(routing.probs[e])
    if coef > 0:
        loss = loss + coef * share * load_balancing_loss(routing)
    return loss, stats


def assign_weights(micros: list[MicroBatch], trainable: list[np.ndarray], mode: str) -> None:
    """Set each micro-batch's ``weights`` so that the weighted sum over all of them is the batch's
    token-mean or sequence-mean (see ``algorithms.aggregation_weights``). ``trainable`` is each
    micro-batch's final 0/1 mask (model tokens that are not stale)."""
    if mode == "token-mean":
        total = max(sum(float(m.sum()) for m in trainable), 1.0)
        for micro, m in zip(micros, trainable, strict=True):
            micro.arrays["weights"] = (m / total).astype(np.float32)
        return
    if mode != "sequence-mean":
        raise ValueError(f"aggregation {mode!r}; expected 'token-mean' or 'sequence-mean'")
    size = 1 + max(int(micro.arrays["sequence_index"].max()) for micro in micros)
    counts = np.zeros(size, np.float64)
    for micro, m in zip(micros, trainable, strict=True):
        idx = micro.arrays["sequence_index"]
        np.add.at(counts, idx[idx >= 0], m[idx >= 0])
    num_sequences = max(int((counts > 0).sum()), 1)
    for micro, m in zip(micros, trainable, strict=True):
        idx = np.maximum(micro.arrays["sequence_index"], 0)
        per_token = np.maximum(counts[idx], 1.0)
        micro.arrays["weights"] = np.where(m > 0, m / (per_token * num_sequences), 0.0).astype(np.float32)


