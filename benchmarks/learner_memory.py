"""Learner gradient-step memory at real lengths, and what remat costs in step time.

Memory: XLA's compiled memory analysis (``Trainer.memory_analysis``) of the learner's real
gradient step over an abstract model (``nnx.eval_shape``: no weights allocated), at the
Qwen2.5-0.5B shape, one row on one device, for each remat policy side by side. Works on the CPU at
any size; ``temp`` is the step's activations and workspace.

Step time: the same step executed on a small model (``--time-config``), remat none against full,
interleaved, median of ``--repeats``; the ratio is what remat costs.

    .venv/bin/python benchmarks/learner_memory.py                  # 2k/8k/32k, ~10 min on 2 CPUs
    .venv/bin/python benchmarks/learner_memory.py --lengths 2048 --repeats 3
    .venv/bin/python benchmarks/learner_memory.py --lengths 8192 --remat full --attention blockwise xla --repeats 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                  intermediate_size=4864, max_seq_len=32768, attention_bias=True, tie_embeddings=True,
                  rope_theta=1e6)
TIME_CONFIG = dict(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=384, max_seq_len=4096)
GIB = 2**30


def trainer(config: dict[str, Any], remat: str, abstract: bool, attention: str = "blockwise") -> Any:
    import jax
    import optax
    from flax import nnx

    from stoker.learner import train
    from stoker.model.model import Transformer, init_model
    from stoker.learner.sharding import make_mesh
    from stoker.spec import TransformerConfig

    cfg = TransformerConfig(**config)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))) if abstract else init_model(cfg, seed=0)
    options = train.StepOptions(remat=remat, attention=attention)  # type: ignore[arg-type]
    return train.Trainer(model, options, optax.adam(1e-4), make_mesh(devices=jax.devices()[:1]))


def step_seconds(remats: list[str], length: int, repeats: int) -> dict[str, float]:
    """Median seconds of one executed grad step per remat policy (compiled first, interleaved)."""
    import jax
    import numpy as np

    from stoker.learner.packing import FIELDS
    from stoker.learner.step import DEVICE_FIELDS

    rng = np.random.default_rng(0)
    batch = {
        name: (rng.integers(0, TIME_CONFIG["vocab_size"], (1, length)) if name in ("tokens", "targets")
               else np.ones((1, length))).astype(FIELDS.get(name, np.dtype(np.float32)))
        for name in DEVICE_FIELDS
    }
    batch["positions"] = np.arange(length, dtype=np.int32)[None]
    batch["weights"] = np.full((1, length), 1.0 / length, np.float32)
    scalars = {"version": jax.numpy.asarray(0), "num_pairs": jax.numpy.asarray(1.0)}
    trainers = {r: trainer(TIME_CONFIG, r, abstract=False) for r in remats}
    times: dict[str, list[float]] = {r: [] for r in remats}
    for r, t in trainers.items():
        jax.block_until_ready(t._grad(t.params, t.frozen, batch, scalars))  # compile
    for _ in range(repeats):
        for r, t in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(t._grad(t.params, t.frozen, batch, scalars))
            times[r].append(time.perf_counter() - start)
    return {r: statistics.median(v) for r, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--remat", nargs="+", default=["none", "full", "save-matmuls"])
    parser.add_argument("--attention", nargs="+", default=["blockwise"],
                        help="attention kernels to compare (blockwise, xla); on the CPU only these run")
    parser.add_argument("--time-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, Any] = {"shape": "qwen2.5-0.5b", "memory_gib": {}}
    for length in args.lengths:
        row: dict[str, float] = {}
        for remat in args.remat:
            for attention in args.attention:
                analysis = trainer(QWEN25_05B, remat, abstract=True, attention=attention).memory_analysis(1, length)
                key = remat if args.attention == ["blockwise"] else f"{remat}/{attention}"
                row[key] = round(analysis.temp_size_in_bytes / GIB, 2)
                print(f"{length:>6} tokens  remat={remat:<13} attention={attention:<10} temp {row[key]:7.2f} GiB",
                      flush=True)
        results["memory_gib"][str(length)] = row
    if args.repeats > 0:  # --repeats 0: memory only
        seconds = step_seconds(args.remat, args.time_length, args.repeats)
        base = seconds["none"] if "none" in seconds else next(iter(seconds.values()))
        results["step_seconds"] = {r: round(s, 4) for r, s in seconds.items()}
        results["step_time_vs_none"] = {r: round(s / base, 3) for r, s in seconds.items()}
        for r, s in seconds.items():
            print(f"step ({args.time_length} tokens, small model) remat={r:<13} {s * 1e3:8.1f} ms  x{s / base:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
