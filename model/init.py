"""Random initialisation of a model as one compiled program that takes the seed's key.

Compiled once per (module, config, dtype, placement), not once per seed, and the values are the
same placed or not (an eager init fuses differently and differs in the last bit). Used for the
policy (``stoker.model.model.init_model``) and PPO's critic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.spec import TransformerConfig


def init_module(
    module: Callable[..., nnx.Module], config: TransformerConfig, seed: int, dtype: Any = jnp.float32,
    placement: Callable[[tuple[int, ...]], jax.sharding.Sharding] | None = None,
) -> Any:
    """``module(config, rngs=nnx.Rngs(params=seed), dtype=dtype)`` built by one compiled program
    that takes the seed's key as its argument (``init_model``; PPO's critic). The key is
    ``jax.random.key(seed)``, as ``nnx.Rngs`` makes it from an int, so the values are those of a
    program with the seed written into it, bit for bit."""
    dtype = jnp.dtype(dtype)
    graphdef, abstract = _abstract_module(module, config, dtype)
    shardings = None if placement is None else tuple(placement(tuple(a.shape)) for a in jax.tree.leaves(abstract))
    state = _init_program(module, config, dtype, shardings)(jax.random.key(seed))
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=32)  # a process builds a few shapes; bounded all the same
def _abstract_module(module: Callable[..., nnx.Module], config: TransformerConfig, dtype: jnp.dtype) -> tuple[Any, Any]:
    """The module's graph and its parameters' shapes (no seed changes either)."""
    return nnx.split(nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(params=0), dtype=dtype)))


@functools.lru_cache(maxsize=32)  # a process builds a few shapes; bounded all the same
def _init_program(
    module: Callable[..., nnx.Module], config: TransformerConfig, dtype: jnp.dtype,
    shardings: tuple[jax.sharding.Sharding, ...] | None,
) -> Callable[[jax.Array], Any]:
    """The jitted key -> parameter state of ``module``; ``shardings``: its leaves' out_shardings
    in ``jax.tree.leaves`` order (a tuple, so that the cache can key on it)."""
    _, abstract = _abstract_module(module, config, dtype)
    placed = {} if shardings is None else {"out_shardings": jax.tree.unflatten(jax.tree.structure(abstract), shardings)}
    return jax.jit(lambda key: nnx.state(module(config, rngs=nnx.Rngs(params=key), dtype=dtype)), **placed)
