"""Decode step time on the chip (issue 52): the real ``Transformer.decode`` of the Qwen2.5-0.5B shape
in bfloat16 (random weights), its cache donated and fed back step after step, as the sampler's loop
runs it, for three writes: per-row select over the whole cache, one shared slot, and the flat
cache's TPU kernels (in-place per-row write, attention over each row's filled slots only).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/decode_step.py 128x2048 128x256x192

A shape is ROWSxSLOTS[xFILLED]: FILLED slots of each row hold tokens (default: all but the last
few). Prints one JSON line per shape and variant: ms per step, tokens/s, and the attainable bound
(weights plus each row's filled keys and values read once at 819 GB/s) as a fraction of the step.
``--ragged-only``: the kernels alone; ``--block-bytes=N``: their block budget. ``--bytes`` (no TPU needed): compile each for v5e with libtpu here and print XLA's "bytes
accessed" of the step instead (the kernels' own traffic is not in it).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.model import decode_attention
from stoker.model.layers import LayerCache
from stoker.model.model import KVCache, flatten_cache, init_model
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
    variants = ("per-row select", "shared slot", "ragged kernels")
    if "--ragged-only" in sys.argv:
        variants = variants[2:]
    for arg in sys.argv:  # --block-bytes=N: the attention kernel's block budget (decode_attention.BLOCK_BYTES)
        if arg.startswith("--block-bytes="):
            decode_attention.BLOCK_BYTES = int(arg.split("=")[1])
    shapes = [[int(n) for n in a.split("x")] for a in sys.argv[1:] if not a.startswith("--")] or [[128, 2048]]
    if compile_only:
        from stoker.model.model import Transformer
        from stoker.sizing.compiler import load_slice

        placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(QWEN_05B, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), abstract)
    else:
        graphdef, state = nnx.split(init_model(QWEN_05B, 0, jnp.bfloat16))
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
    for shape_arg in shapes:
        rows, slots = shape_arg[:2]
        filled = shape_arg[2] if len(shape_arg) > 2 else slots - 3
        for variant in variants:
            def step(state: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array, variant: str = variant) -> Any:
                model = nnx.merge(graphdef, state)
                slot = jnp.max(positions) if variant == "shared slot" else None
                return model.decode(tokens, positions, cache, slot=slot, interpret=False)

            shape = (rows, slots, QWEN_05B.num_kv_heads, 64)
            if variant == "ragged kernels":
                shape = (rows, slots, QWEN_05B.num_kv_heads * 64)
            fn = jax.jit(step, donate_argnums=(1,))
            if compile_only:
                def spec(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> Any:
                    return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

                layer = LayerCache(spec(shape), spec(shape))
                abstract_cache = KVCache((layer,) * QWEN_05B.num_layers, spec((rows, slots), jnp.int32))
                ints = spec((rows,), jnp.int32)
                costs: Any = fn.lower(state, abstract_cache, ints, ints).compile().cost_analysis()
                print(json.dumps({"rows": rows, "slots": slots, "variant": variant,
                                  "bytes_accessed_gb": round(float(costs["bytes accessed"]) / 1e9, 3)}), flush=True)
                continue
            segments = (jnp.arange(slots)[None, :] < filled).astype(jnp.int32) * jnp.ones((rows, 1), jnp.int32)
            cache = KVCache(tuple(LayerCache(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
                                  for _ in range(QWEN_05B.num_layers)), segments)
            positions = filled - jnp.arange(rows, dtype=jnp.int32) % 3  # rows of different lengths
            sec = seconds_per_step(fn, [state, cache, jnp.zeros((rows,), jnp.int32), positions])
            kv_bytes = 2 * QWEN_05B.num_layers * rows * (filled + 1) * QWEN_05B.num_kv_heads * 64 * 2
            bound = (weights + kv_bytes) / HBM_BYTES_PER_SECOND
            print(json.dumps({"rows": rows, "slots": slots, "filled": filled, "variant": variant,
                              "ms": round(sec * 1e3, 2), "tokens_per_s": round(rows / sec), "of_bound": round(bound / sec, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
