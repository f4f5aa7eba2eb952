"""The decode step's cache write and attention: two kernels a layer (``write_rows``, then
``ragged_decode_attention``) against one (``decode_fused.attend_and_write``), on the chip (issue 52).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/decode_write_fused.py
    this CPU (Pallas' interpreter, a tiny size, to prove it runs and agrees):  .venv/bin/python benchmarks/decode_write_fused.py --check

24 layer caches of [rows, 256, 128] bfloat16 (Qwen2.5-0.5B's attention shape: 14 query heads, 2
kv heads of 64) with 192 filled slots, donated and carried from call to call as the sampler's loop
carries them; each row writes slot 191 and attends over 0-191; each layer's output is the next
one's query. Prints one JSON line per rows and variant: microseconds a layer (best of 5 after a
warm-up, four layers a jit) and the largest difference of the one kernel's output and caches from
the two kernels'. Positional ROWS override (128, 256).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stoker.model.decode_attention import key_positions, ragged_decode_attention, write_rows
from stoker.model.decode_fused import attend_and_write

HEADS, KV_HEADS, DIM = 14, 2, 64
SLOTS, FILLED = 256, 192
LAYERS_PER_JIT = 4


def layers_fn(fused: bool, interpret: bool) -> Any:
    """(q, keys, values, new, q_pos, k_pos) -> (the last output, the caches written)."""
    def chunk(q: jax.Array, keys: list[jax.Array], values: list[jax.Array], new: jax.Array, q_pos: jax.Array,
              k_pos: jax.Array) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        out_k, out_v = [], []
        for k, v in zip(keys, values, strict=True):
            if fused:
                q, k, v = attend_and_write(q, k, v, new, -new, q_pos, k_pos, scale=DIM ** -0.5, interpret=interpret)
            else:
                k, v = write_rows(k, v, new, -new, q_pos, interpret=interpret)
                q = ragged_decode_attention(q, k, v, q_pos, k_pos, scale=DIM ** -0.5, interpret=interpret)
            out_k.append(k)
            out_v.append(v)
        return q, out_k, out_v

    step = jax.jit(chunk, donate_argnums=(1, 2))

    def run(q: jax.Array, keys: list[jax.Array], values: list[jax.Array], new: jax.Array, q_pos: jax.Array,
            k_pos: jax.Array) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        keys, values = list(keys), list(values)
        for i in range(0, len(keys), LAYERS_PER_JIT):
            part = slice(i, i + LAYERS_PER_JIT)
            q, keys[part], values[part] = step(q, keys[part], values[part], new, q_pos, k_pos)
        return q, keys, values

    return run


def main() -> None:
    check = "--check" in sys.argv
    rows_list = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or ([16] if check else [128, 256])
    layers, reps, calls = (LAYERS_PER_JIT, 1, 1) if check else (24, 5, 4)
    features = KV_HEADS * DIM
    for rows in rows_list:
        keys = jax.random.split(jax.random.key(0), 2 * layers + 2)
        q = jax.random.normal(keys[0], (rows, HEADS, DIM), jnp.bfloat16)
        new = jax.random.normal(keys[1], (rows, features), jnp.bfloat16)
        index = jnp.broadcast_to(jnp.arange(SLOTS, dtype=jnp.int32), (rows, SLOTS))
        k_pos = key_positions((index < FILLED).astype(jnp.int32), index)
        q_pos = jnp.full((rows,), FILLED - 1, jnp.int32)
        results = {}
        for name, fused in (("write, then attend (two kernels)", False), ("one kernel", True)):
            caches = [jax.random.normal(k, (rows, SLOTS, features), jnp.bfloat16) for k in keys[2:]]
            k_caches, v_caches = caches[:layers], caches[layers:]
            fn = layers_fn(fused, interpret=check)
            out, k_caches, v_caches = jax.block_until_ready(fn(q, k_caches, v_caches, new, q_pos, k_pos))
            results[name] = [np.asarray(x, np.float32) for x in (out, k_caches[-1], v_caches[-1])]  # before donation
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                for _ in range(calls):
                    _, k_caches, v_caches = fn(q, k_caches, v_caches, new, q_pos, k_pos)
                jax.block_until_ready(k_caches)
                best = min(best, (time.perf_counter() - start) / (calls * layers))
            line: dict[str, Any] = {"rows": rows, "variant": name, "us_per_layer": round(best * 1e6, 1)}
            if fused:
                two = results["write, then attend (two kernels)"]
                line["max_diff_vs_two_kernels"] = max(float(np.abs(a - b).max()) for a, b in zip(results[name], two, strict=True))
                if check and line["max_diff_vs_two_kernels"] > 0:
                    raise SystemExit(f"the one kernel differs from the two: {line}")
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
