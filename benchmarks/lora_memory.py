"""LoRA's optimizer memory against full fine-tuning at an 8B shape, from compiled memory analysis.

Two abstract trainers (``nnx.eval_shape``: no weights allocated) of the Llama-3-8B shape in
bfloat16 on one device: full fine-tuning (float32 master weights, Adam moments for every weight)
and LoRA (``model.lora``: a frozen bfloat16 base, float32 adapters and their moments). For each it
compiles the learner's real optimizer update (``Trainer._apply``: clip, Adam, apply) and reads
XLA's memory analysis: its arguments are the trained parameters, the optimizer state and the
gradients. The optimizer state's bytes are also summed from its shapes. CPU compilation of the
abstract program: the sizes are the program's, whatever device would run it.

    .venv/bin/python benchmarks/lora_memory.py                 # rank 16 on all 7 projections
    .venv/bin/python benchmarks/lora_memory.py --rank 8 --targets q_proj v_proj
"""

from __future__ import annotations

import argparse
import json
from typing import Any

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 intermediate_size=14336, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False)
GIB = 2**30


def measure(lora: Any) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from stoker.learner import train
    from stoker.learner.sharding import make_mesh
    from stoker.model.model import Transformer
    from stoker.spec import TransformerConfig

    config = TransformerConfig(**LLAMA3_8B)  # type: ignore[arg-type]
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    options = train.StepOptions("grpo", lora=lora)
    trainer = train.Trainer(model, options, optax.adam(1e-5), make_mesh(devices=jax.devices()[:1]))
    params = jax.eval_shape(lambda: trainer.params)
    opt_state = jax.eval_shape(lambda: trainer.opt_state)
    analysis = trainer._apply.lower(params, opt_state, params).compile().memory_analysis()

    def size(tree: Any) -> float:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / GIB

    return {
        "trained_params_gib": round(size(params), 3),
        "frozen_base_gib": round(size(jax.eval_shape(lambda: trainer.frozen)), 3),
        "optimizer_state_gib": round(size(opt_state), 3),
        "update_arguments_gib": round(analysis.argument_size_in_bytes / GIB, 3),
        "update_outputs_gib": round(analysis.output_size_in_bytes / GIB, 3),
        "update_temp_gib": round(analysis.temp_size_in_bytes / GIB, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=None, help="projections (default: all seven)")
    args = parser.parse_args()
    from stoker.learner.lora import TARGETS, LoraConfig

    lora = LoraConfig(args.rank, args.alpha, tuple(args.targets) if args.targets else TARGETS)
    full, adapted = measure(None), measure(lora)
    results = {
        "shape": "llama-3-8b bfloat16", "rank": args.rank, "targets": list(lora.targets), "full": full, "lora": adapted,
        "optimizer_state_ratio": round(adapted["optimizer_state_gib"] / full["optimizer_state_gib"], 5),
    }
    for name, row in (("full fine-tuning", full), (f"LoRA r={args.rank}", adapted)):
        print(f"{name:>18}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
