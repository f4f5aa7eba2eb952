"""Parameter trees on the device: floating-point casts, abstract (allocation-free) copies, fresh buffers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def fresh_copy(x: jax.Array, *, dtype: Any) -> jax.Array:
    """``x`` in a new buffer, floating point as ``dtype`` (traced inside ``Trainer._copy``)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
    return jnp.copy(x)


def host_scalar(value: float, dtype: Any) -> np.ndarray:
    """A step scalar as a host array: ``jnp.asarray`` of a Python number compiles a small
    convert program per dtype; a NumPy array goes to the device with the step's arguments."""
    return np.asarray(value, dtype)


def float_dtype(tree: Any) -> Any:
    """The dtype of the first floating-point leaf (the model's compute dtype)."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.dtype
    return jnp.float32


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating-point leaves as ``dtype`` (a no-op for leaves already in it); abstract leaves too."""

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def abstract_placed(tree: Any, shardings: Any) -> Any:
    """Shapes and dtypes of ``tree`` placed as ``shardings``, allocating nothing."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
