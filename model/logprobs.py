"""Per-token log-probabilities and entropies from the policy's logits.

``token_stats`` is what the trainer uses: it turns final hidden states into log-probs (and entropy,
and log(1 - p) where asked) a sequence chunk at a time under ``jax.checkpoint``, so the float32
[T, vocab] logits of a whole row never exist at once -- at 8k tokens and Qwen2.5's 151936-token
vocabulary they alone would be 4.6 GiB, and their softmax and gradient as much again each. The
backward recomputes each chunk's logits from its hidden states. The helpers below it take logits
that already exist (the sampler's [B, V] rows, tests).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from stoker.model.selection import weighted_threshold

# Float32 logits one chunk may hold: 2^26 * 4 B = 256 MiB (at vocab 151936, 441 tokens).
CHUNK_LOGIT_ELEMENTS = 1 << 26
# Stands in for -inf: keeps softmax, logsumexp and their gradients free of NaNs.
_IMPOSSIBLE = -1e9


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma 2's final-logit soft-capping); identity for ``None``."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def restrict_logits(logits: jax.Array, allowed_token_ids: tuple[int, ...] | None) -> jax.Array:
    """Logits with every token outside ``allowed_token_ids`` made impossible (constrained decoding).

    The sampler and the trainer both call this, so the distribution tokens are sampled from and
    the one the trainer scores them under are the same. ``None`` allows every token."""
    if allowed_token_ids is None:
        return logits
    allowed = jnp.zeros((logits.shape[-1],), jnp.bool_).at[jnp.asarray(allowed_token_ids)].set(True)
    return jnp.where(allowed, logits, jnp.asarray(_IMPOSSIBLE, logits.dtype))


def truncation_mask(z: jax.Array, top_k: jax.Array | int, min_p: jax.Array | float) -> jax.Array:
    """The tokens top-k and min-p keep, from tempered logits ``z`` [..., V] (bool [..., V]): the
    ``top_k`` most likely (ties with the k-th kept; 0 keeps all) whose probability is at least
    ``min_p`` times the most likely token's (0 keeps all). Both may be runtime values.

    The sampler draws from softmax(z) renormalised over these tokens and records that log-prob;
    the trainer applies the same mask (docs/architecture.md, "Sampler log-probs")."""
    if isinstance(top_k, int) and top_k <= 0:
        keep = jnp.ones(z.shape, jnp.bool_)
    else:  # the k-th largest by weighing, not by a sort (stoker.model.selection)
        k = jnp.asarray(top_k, jnp.float32)
        keep = jnp.where(k > 0, z >= weighted_threshold(z, k), True)
    p = jnp.asarray(min_p, jnp.float32)
    # p_v >= min_p * p_max  <=>  z_v - z_max >= log(min_p)
    floor = jnp.max(z, axis=-1, keepdims=True) + jnp.log(jnp.maximum(p, 1e-30))
    return keep & jnp.where(p > 0, z >= floor, True)


def truncate_logits(logits: jax.Array, temperature: float, top_k: int, min_p: float, keep: jax.Array | None = None) -> jax.Array:
    """``logits`` with the tokens top-k and min-p drop (judged at ``temperature``) made impossible;
    ``keep`` (bool [..., V]) are kept whatever they say. Unchanged when both are off."""
    if top_k <= 0 and min_p <= 0:
        return logits
    mask = truncation_mask(logits.astype(jnp.float32) / temperature, top_k, min_p)
    if keep is not None:
        mask = mask | keep
    return jnp.where(mask, logits, jnp.asarray(_IMPOSSIBLE, logits.dtype))


def token_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature) gathered at ``targets``: [B, T, V], [B, T] -> [B, T] float32.

    log p(y) = z_y / tau - logsumexp(z / tau). ``targets`` are the next tokens, so the usual call is
    ``token_logprobs(logits[:, :-1], token_ids[:, 1:])``. With the sampler's temperature this is
    exactly what the sampler recorded for the same ids (see ``stoker.rollout.sampling``)."""
    z = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def token_log_not_taken(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """log(1 - p(y)) for the ``targets`` y, from the logits: [B, T, V], [B, T] -> [B, T] float32.

    Computed as logsumexp over the other tokens minus logsumexp over all, which stays exact (and
    its gradient finite) when p(y) rounds to 1 in float32 -- where ``log(-expm1(log p))`` is -inf.
    """
    z = logits.astype(jnp.float32) / temperature
    taken = jax.nn.one_hot(targets, z.shape[-1], dtype=jnp.bool_)
    # A large finite value rather than -inf keeps logsumexp's gradient free of NaNs.
    others = jax.nn.logsumexp(jnp.where(taken, jnp.asarray(-1e30, jnp.float32), z), axis=-1)
    return others - jax.nn.logsumexp(z, axis=-1)


def token_entropy(logits: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """H = -sum_v p_v log p_v of softmax(logits / temperature): [..., V] -> [...] float32."""
    z = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(z) * z, axis=-1)


def sequence_logprobs(
    logits: jax.Array, token_ids: jax.Array, segment_ids: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
    """Log-probs aligned with the tokens, as trajectories store them: [B, T] float32 with

    out[b, t] = log p(token_ids[b, t] | earlier tokens of its segment)

    and 0 where token t opens a segment (nothing predicts it) or is padding."""
    lp = token_logprobs(logits[:, :-1], token_ids[:, 1:], temperature=temperature)
    continues = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    lp = jnp.where(continues, lp, 0.0)
    return jnp.pad(lp, ((0, 0), (1, 0)))


# ------------------------------------------------------------------------------ chunked


class TokenStats(NamedTuple):
    """Per-token [B, T] float32 statistics of the policy at the targets."""

    logprobs: jax.Array
    entropy: jax.Array | None
    log_not_taken: jax.Array | None


class OutputHead(NamedTuple):
    """How final (normed) hidden states become logits: ``h @ weight`` ([D, V], or [V, D] with
    ``tied``, the embedding table), then the soft-cap."""

    weight: jax.Array
    tied: bool
    final_softcap: float | None

    def logits(self, h: jax.Array) -> jax.Array:
        """[..., D] -> float32 [..., V]."""
        spec = "...d,vd->...v" if self.tied else "...d,dv->...v"
        return softcap(jnp.einsum(spec, h, self.weight, preferred_element_type=jnp.float32), self.final_softcap)


def chunk_tokens(rows: int, length: int, vocab: int) -> int:
    """Tokens per chunk: the largest power of two whose float32 logits fit ``CHUNK_LOGIT_ELEMENTS``."""
    chunk = 1
    while chunk * 2 <= length and rows * chunk * 2 * vocab <= CHUNK_LOGIT_ELEMENTS:
        chunk *= 2
    return chunk


def token_stats(
    hidden: jax.Array,
    head: OutputHead,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    allowed_token_ids: tuple[int, ...] | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    entropy: bool = False,
    log_not_taken: bool = False,
    chunk: int | None = None,
) -> TokenStats:
    """Log-probs of ``targets`` [B, T] (and optionally entropy and log(1 - p)) from the normed
    final hidden states [B, T, D], ``chunk`` tokens of every row at a time (default
    ``chunk_tokens``), under the sampling distribution: restricted to ``allowed_token_ids`` and
    truncated by ``top_k``/``min_p`` as the sampler does. Equal to the same functions on the full logits."""
    b, t, _ = hidden.shape
    vocab = head.weight.shape[0] if head.tied else head.weight.shape[1]
    chunk = chunk or chunk_tokens(b, t, vocab)

    def stats(h: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        z = restrict_logits(head.logits(h), allowed_token_ids)
        # The distribution the sampler drew from (top-k, min-p); the token it drew always stays
        # possible, should the trainer's logits put it a rounding error past the cut.
        z = truncate_logits(z, temperature, top_k, min_p, keep=jax.nn.one_hot(y, z.shape[-1], dtype=jnp.bool_))
        lp = token_logprobs(z, y, temperature=temperature)
        ent = token_entropy(z, temperature=temperature) if entropy else jnp.zeros_like(lp)
        lnt = token_log_not_taken(z, y, temperature=temperature) if log_not_taken else jnp.zeros_like(lp)
        return lp, ent, lnt

    if t <= chunk:
        lp, ent, lnt = stats(hidden, targets)
    else:
        pad = -t % chunk
        n = (t + pad) // chunk

        def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

        def merge(x: jax.Array) -> jax.Array:
            return jnp.moveaxis(x, 0, 1).reshape(b, t + pad)[:, :t]

        lp, ent, lnt = (merge(x) for x in jax.lax.map(jax.checkpoint(lambda a: stats(*a)), (split(hidden), split(targets))))
    return TokenStats(lp, ent if entropy else None, lnt if log_not_taken else None)
