"""A proxy for `plan_real_scale.py`: Llama-3-70B's (or 8B's) width with a few layers, its GRPO grad
step compiled by libtpu for a real slice in minutes instead of the full model's tens of minutes;
prints the per-chip HBM temporaries (`memory_analysis()`). The per-layer difference between two
layer counts is what each added layer costs.

    .venv/bin/python benchmarks/plan_proxy.py --layers 4 --dtype bfloat16 [--sequence-sharding]
        [--topology v5p:4x4x4 --fsdp 16 --tp 4] [--model 70b|8b] [--length 8192]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

WIDTHS = {
    "70b": dict(vocab_size=128256, hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672,
                rope_theta=500000.0, tie_embeddings=False),
    "8b": dict(vocab_size=128256, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               rope_theta=500000.0, tie_embeddings=False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", choices=sorted(WIDTHS), default="70b")
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--fsdp", type=int, default=16)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=0, help="rows per micro-batch (default: one per fsdp shard)")
    parser.add_argument("--sequence-sharding", action="store_true")
    args = parser.parse_args()

    import jax.numpy as jnp
    from flax import nnx

    from stoker.learner import sharding, train
    from stoker.model.model import Transformer
    from stoker.sizing.compiler import load_slice
    from stoker.spec import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, max_seq_len=args.length, **WIDTHS[args.model])  # type: ignore[arg-type]
    devices = load_slice(args.topology, args.fsdp * args.tp).devices
    mesh = sharding.make_mesh(args.fsdp, args.tp, devices)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
    options = train.StepOptions("grpo", remat="full", attention="blockwise", sequence_sharding=args.sequence_sharding)
    trainer = train.Trainer(model, options, train.make_optimizer(1e-6, 1.0), mesh)
    rows = args.rows or args.fsdp
    grad, abstract = trainer.programs(rows, args.length)["grad"]
    started = time.perf_counter()
    memory = grad.lower(*abstract).compile().memory_analysis()
    gib = 2**30
    print(f"{args.model} width, {args.layers} layers, {args.topology} fsdp {args.fsdp} x tp {args.tp}, {args.dtype}, "
          f"sequence sharding {args.sequence_sharding}, {rows} x {args.length}: arguments "
          f"{memory.argument_size_in_bytes / gib:.2f}, temporaries {memory.temp_size_in_bytes / gib:.2f} GiB per chip "
          f"(compiled in {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
