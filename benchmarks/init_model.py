"""What compiling ``init_model`` once per model shape is worth: ``init_model`` for ``--seeds``
consecutive seeds the old way (the seed written into a fresh jitted program, so every call traces
and compiles again) against the new (one cached program per (config, dtype, placement) that takes
the seed's key as its argument), in one run, on CPU, with the values checked bit-identical.

    nice -n 10 .venv/bin/python benchmarks/init_model.py [--seeds 5]

Reported per config and dtype: the first call's seconds (both compile), the mean of the later
calls, the total over all seeds, and the new / old ratio of each. Each config is a fresh shape
for the new path (nothing cached before its first call).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.model.model import Transformer, init_model
from stoker.spec import TransformerConfig

CONFIGS = {
    "tiny (default)": TransformerConfig(),
    "small 4-layer": TransformerConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                       intermediate_size=256),
}


def old_init(config: TransformerConfig, seed: int, dtype: Any) -> Transformer:
    """``init_model`` before the cut: the seed is a constant of a fresh program."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=seed), dtype=dtype)))
    state = jax.jit(lambda: nnx.state(Transformer(config, rngs=nnx.Rngs(params=seed), dtype=dtype)))()
    model: Transformer = nnx.merge(graphdef, state)
    return model


def timed(init: Callable[[TransformerConfig, int, Any], Transformer], config: TransformerConfig, seeds: range,
          dtype: Any) -> tuple[list[float], list[Transformer]]:
    times, models = [], []
    for seed in seeds:
        start = time.perf_counter()
        model = init(config, seed, dtype)
        jax.block_until_ready(nnx.state(model))
        times.append(time.perf_counter() - start)
        models.append(model)
    return times, models


def same_bits(a: Transformer, b: Transformer) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    seeds = range(args.seeds)
    jax.block_until_ready(jax.random.key(0))  # jax's own start-up, outside both
    print("| config | dtype | old first s | old later s (mean) | old total s | new first s | new later s (mean) "
          "| new total s | new / old total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config in CONFIGS.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            old, old_models = timed(old_init, config, seeds, dtype)
            new, new_models = timed(init_model, config, seeds, dtype)
            assert all(same_bits(a, b) for a, b in zip(old_models, new_models, strict=True)), (name, dtype)
            later = lambda t: statistics.mean(t[1:]) if len(t) > 1 else float("nan")  # noqa: E731
            print(f"| {name} | {jnp.dtype(dtype)} | {old[0]:.3f} | {later(old):.3f} | {sum(old):.2f} | {new[0]:.3f} "
                  f"| {later(new):.4f} | {sum(new):.2f} | {sum(new) / sum(old):.2f} |")


if __name__ == "__main__":
    main()
