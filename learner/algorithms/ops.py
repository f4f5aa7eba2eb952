"""Array helpers of the objectives: shape checks, segment sums, the clamped exp of a log-ratio."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stoker.learner.algorithms.config import LOG_RATIO_LIMIT, Array


def check_same_shape(**arrays: Array) -> tuple[int, ...]:
    """All arrays share one shape; a ValueError naming the odd one out otherwise."""
    items = list(arrays.items())
    first_name, first = items[0]
    shape = tuple(np.shape(first))
    for name, value in items[1:]:
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}; expected {shape} like {first_name}")
    return shape


def check_rank(name: str, value: Array, rank: int) -> None:
    if np.ndim(value) != rank:
        raise ValueError(f"{name} has rank {np.ndim(value)} (shape {np.shape(value)}); expected rank {rank}")


def array_module(*arrays: Array) -> Any:
    """numpy for host arrays, jax.numpy for device arrays and tracers."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def segment_sum(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Sums per segment id; ids index a table as large as the input, so any id < size is valid."""
    return jax.ops.segment_sum(values.reshape(-1), segment_ids.reshape(-1), num_segments=values.size)


def gather_segments(table: jax.Array, segment_ids: jax.Array) -> jax.Array:
    return table[segment_ids.reshape(-1)].reshape(segment_ids.shape)


def exp_log_ratio(log_ratio: Array) -> jax.Array:
    """exp(clip(log_ratio, -L, L)), L = ``LOG_RATIO_LIMIT``: finite values and gradients everywhere
    (the gradient is 0 where the clamp binds)."""
    return jnp.exp(jnp.clip(jnp.asarray(log_ratio), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
