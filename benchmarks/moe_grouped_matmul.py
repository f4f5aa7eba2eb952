"""A mixture-of-experts layer computed densely (every expert on every token, gates 0 off the
chosen k: what Stoker's sampler runs) against a grouped matmul (``jax.lax.ragged_dot`` over the
(token, expert) pairs sorted by expert: the routed work only), side by side in one process.

    .venv/bin/python benchmarks/moe_grouped_matmul.py [--tokens 4096] [--experts 64] [--top-k 4]

Both compute the same sum (the script checks it); the question is which is faster on this
backend. Prints one markdown row.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn: Callable[[], jax.Array], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after a warm-up (which compiles)."""
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, d, f, e, k = args.tokens, args.hidden, args.width, args.experts, args.top_k
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(0, d**-0.5, (e, d, f)), jnp.float32) for _ in range(3))
    top, index = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.normal(size=(n, e)), jnp.float32)), k)
    gates = jnp.einsum("nk,nke->ne", top, jax.nn.one_hot(index, e))

    @jax.jit
    def dense(x: jax.Array) -> jax.Array:
        act = jax.nn.silu(jnp.einsum("nd,edf->nef", x, gate)) * jnp.einsum("nd,edf->nef", x, up)
        return jnp.einsum("nef,edf->nd", act * gates[..., None], down)

    @jax.jit
    def grouped(x: jax.Array) -> jax.Array:
        expert = index.reshape(-1)
        order = jnp.argsort(expert, stable=True)  # the pairs grouped by expert
        source = order // k
        sizes = jnp.bincount(expert, length=e).astype(jnp.int32)
        rows = x[source]
        act = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
        out = jax.lax.ragged_dot(act * top.reshape(-1)[order][:, None], jnp.swapaxes(down, 1, 2), sizes)
        return jnp.zeros_like(x).at[source].add(out)

    error = float(jnp.max(jnp.abs(dense(x) - grouped(x))))
    assert error < 1e-4, error
    dense_s, grouped_s = timed(lambda: dense(x), args.repeats), timed(lambda: grouped(x), args.repeats)
    print("| backend | tokens | experts, top-k | hidden x width | dense s | grouped s | grouped / dense | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {jax.default_backend()} | {n} | {e}, {k} | {d} x {f} | {dense_s:.3f} | {grouped_s:.3f} | "
          f"{grouped_s / dense_s:.2f} | {error:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
