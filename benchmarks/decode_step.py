"""Decode step time on the chip, per-row select against one shared slot (issue 52): the real
``Transformer.decode`` of the Qwen2.5-0.5B shape in bfloat16 (random weights), its cache donated
and fed back step after step, as the sampler's loop runs it.

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/decode_step.py 128x2048 128x256

Prints one JSON line per shape and variant: ms per step, tokens/s, and the attainable bound
(weights plus every slot's keys and values read once at 819 GB/s) as a fraction of the step.
``--bytes`` (no TPU needed): compile each for v5e with libtpu here and print XLA's "bytes
accessed" of the step instead.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.model.layers import LayerCache
from stoker.model.model import KVCache, init_model
from stoker.spec import TransformerConfig

QWEN_05B = TransformerConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                             intermediate_size=4864, max_seq_len=8192, rope_theta=1e6, tie_embeddings=True,
                             attention_bias=True)
HBM_BYTES_PER_SECOND = 819e9  # TPU v5e


def seconds_per_step(fn: Any, args: list[Any], steps: int = 12) -> float:
    for i in range(steps + 2):
        if i == 2:
            jax.block_until_ready(args)
            start = time.perf_counter()
        logits, args[1] = fn(*args)
    jax.block_until_ready(logits)
    return (time.perf_counter() - start) / steps


def main() -> None:
    compile_only = "--bytes" in sys.argv
    shapes = [tuple(int(n) for n in a.split("x")) for a in sys.argv[1:] if a != "--bytes"] or [(128, 2048)]
    if compile_only:
        from stoker.model.model import Transformer
        from stoker.sizing.compiler import load_slice

        placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(QWEN_05B, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), abstract)
    else:
        graphdef, state = nnx.split(init_model(QWEN_05B, 0, jnp.bfloat16))
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
    for rows, slots in shapes:
        for shared in (False, True):
            def step(state: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array, shared: bool = shared) -> Any:
                model = nnx.merge(graphdef, state)
                return model.decode(tokens, positions, cache, slot=jnp.max(positions) if shared else None)

            shape = (rows, slots, QWEN_05B.num_kv_heads, 64)
            fn = jax.jit(step, donate_argnums=(1,))
            if compile_only:
                def spec(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> Any:
                    return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

                layer = LayerCache(spec(shape), spec(shape))
                abstract_cache = KVCache((layer,) * QWEN_05B.num_layers, spec((rows, slots), jnp.int32))
                ints = spec((rows,), jnp.int32)
                costs: Any = fn.lower(state, abstract_cache, ints, ints).compile().cost_analysis()
                print(json.dumps({"rows": rows, "slots": slots, "variant": "shared slot" if shared else "per-row select",
                                  "bytes_accessed_gb": round(float(costs["bytes accessed"]) / 1e9, 3)}), flush=True)
                continue
            cache = KVCache(tuple(LayerCache(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
                                  for _ in range(QWEN_05B.num_layers)), jnp.ones((rows, slots), jnp.int32))
            positions = slots - 1 - jnp.arange(rows, dtype=jnp.int32) % 3  # rows of different lengths
            sec = seconds_per_step(fn, [state, cache, jnp.zeros((rows,), jnp.int32), positions])
            bound = (weights + 2 * QWEN_05B.num_layers * rows * slots * shape[2] * shape[3] * 2) / HBM_BYTES_PER_SECOND
            print(json.dumps({"rows": rows, "slots": slots, "variant": "shared slot" if shared else "per-row select",
                              "ms": round(sec * 1e3, 2), "tokens_per_s": round(rows / sec), "of_bound": round(bound / sec, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
