"""One sampled token per row over a real vocabulary, with top-p / top-k on (issue 52): the
truncation found by weighing (``stoker.model.selection``) against the full-vocabulary sort and
``lax.top_k``, side by side in one run.

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/sampling_truncation.py
    this CPU:                        .venv/bin/python benchmarks/sampling_truncation.py --rows 8 --repeats 3

Logits [rows, 151,936] float32, N(0, 1) x a scale: 6, a peaked distribution (a top-p 0.9 nucleus
of ~100 tokens); 0.5, a flat one (tens of thousands). Prints one JSON line per case: ms per call
(best of ``--repeats``, 10 calls each) for the plain draw, top-p by weighing and by a full sort,
top-k 50 by weighing, ``lax.top_k`` of 256 alone, the weighing alone at 1, 2 and 4 bits a pass, and
the sort's time over the weighing's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from stoker.model.selection import weighted_threshold
from stoker.rollout.draw import draw
from stoker.rollout.programs import sample_token

VOCAB = 151936


def by_sort(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The top-p draw as it was: the nucleus from a full descending sort of every row."""
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    desc = jnp.sort(logp, axis=-1)[:, ::-1]
    probs = jnp.exp(desc)
    in_nucleus = jnp.cumsum(probs, axis=-1) - probs < top_p
    floor = jnp.min(jnp.where(in_nucleus, desc, jnp.inf), axis=-1, keepdims=True)
    tokens = draw(key, jnp.where(logp >= floor, logp, -jnp.inf), temperature <= 0)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def ms_per_call(fn: Callable[..., tuple[jax.Array, jax.Array]], args: tuple[jax.Array, ...], repeats: int) -> float:
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            out = compiled(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / 10)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    key, t = jax.random.key(0), jnp.float32(1.0)
    for rows in args.rows:
        for scale, top_p in ((6.0, 0.9), (0.5, 0.9)):
            logits = jax.random.normal(jax.random.key(1), (rows, VOCAB), jnp.float32) * scale
            p = jnp.float32(top_p)
            plain = ms_per_call(lambda k, z, t: sample_token(k, z, t, None), (key, logits, t), args.repeats)
            free = ms_per_call(lambda k, z, t, p: sample_token(k, z, t, p), (key, logits, t, p), args.repeats)
            sort = ms_per_call(by_sort, (key, logits, t, p), args.repeats)
            top_k = ms_per_call(lambda k, z, t: sample_token(k, z, t, None, jnp.int32(50)), (key, logits, t), args.repeats)
            lax_top_k = ms_per_call(lambda z: jax.lax.top_k(z, 256), (logits,), args.repeats)
            weighing = {f"weighing_{bits}_bits_ms": round(ms_per_call(
                lambda z, bits=bits: (weighted_threshold(z, 0.9, jnp.exp(z), bits=bits),) * 2, (logits,), args.repeats), 3)
                for bits in (1, 2, 4)}
            print(json.dumps({
                "rows": rows, "scale": scale, "top_p": top_p, "plain_ms": round(plain, 3),
                "top_p_weighing_ms": round(free, 3), "top_p_full_sort_ms": round(sort, 3),
                "top_k_50_ms": round(top_k, 3), "lax_top_k_256_ms": round(lax_top_k, 3), **weighing,
                "sort_over_weighing": round(sort / free, 2), "platform": jax.devices()[0].platform,
            }), flush=True)


if __name__ == "__main__":
    main()
