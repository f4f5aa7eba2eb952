"""Stoker's mixture-of-experts forward held against Hugging Face transformers (the referee).

tests/learner/test_moe.py checks Qwen3-MoE and Mixtral against a float64 forward written here
from the papers; this checks them against the implementation the checkpoints come from. Tiny
random models (hidden 64, 4 heads, 2 KV heads, 8 experts, top-2) are built and run by
transformers, saved with ``save_pretrained``, then loaded and run by Stoker: logits, greedy
argmax, and the export (``to_hf``, ``save_checkpoint``) against transformers' tensors bit for bit.

torch stays out of the project: ``--make`` runs in a throwaway venv with torch + transformers,
``--compare`` in the project's venv (from the repository root):

    python3 -m venv /tmp/moe-ref && /tmp/moe-ref/bin/pip install torch==2.13.0 transformers==5.25.0
    /tmp/moe-ref/bin/python benchmarks/moe_referee.py --make /tmp/moe-ref/models
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe_referee.py --compare /tmp/moe-ref/models

Exits 1 if a logit differs by more than 1e-4, or a tensor does not round-trip exactly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
IDS_SHAPE = (2, 16)  # a batch of 2 rows x 16 tokens
TOLERANCE = 1e-4
COMMON: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
}
# name -> (model_type, config fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Every layer sparse, top-2 of 8 renormalised.
    "qwen3_moe": ("qwen3_moe", COMMON | {
        "num_hidden_layers": 3, "num_experts": 8, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    }),
    # Layers 1 and 3 sparse, 0 and 2 dense (intermediate_size); top-2 of 8 not renormalised.
    "qwen3_moe-step2": ("qwen3_moe", COMMON | {
        "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    }),
    # Every layer sparse, top-2 of 8 renormalised, experts intermediate_size wide.
    "mixtral": ("mixtral", COMMON | {"num_hidden_layers": 3, "num_local_experts": 8}),
}


def redraw(model: Any, seed: int) -> None:
    """Every parameter drawn again (transformers' 0.02 init gives near-zero logits): norms
    1 +- 0.3, embeddings N(0, 1), routers N(0, 1) so each token's experts are far from ties,
    other matrices N(0, 1/fan_in)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith("embed_tokens.weight") or name.endswith(".gate.weight"):
                param.copy_(noise)
            else:  # [out, in] linears; fused expert stacks [E, out, in]
                param.copy_(noise / param.shape[-1] ** 0.5)


def make(out: Path) -> None:
    """Build, run and save each model with transformers (the torch venv)."""
    import torch
    import transformers

    ids = np.random.default_rng(SEED).integers(0, COMMON["vocab_size"], IDS_SHAPE)
    for name, (kind, fields) in MODELS.items():
        config_class = transformers.Qwen3MoeConfig if kind == "qwen3_moe" else transformers.MixtralConfig
        config = config_class(**fields)
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        redraw(model, SEED)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(ids)).logits.float().numpy()
        model.save_pretrained(out / name, safe_serialization=True)
        np.savez(out / name / "referee.npz", ids=ids, logits=logits)
        print(f"{name}: {out / name} logits {logits.shape}, max |logit| {np.abs(logits).max():.3g}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


def stoker_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    """Stoker's training forward, jitted (as tests/learner/test_families.py's ``forward``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    batch, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    args = (jnp.asarray(ids, jnp.int32), positions, jnp.ones((batch, length), jnp.int32))
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args))


def bit_equal(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> bool:
    """The same names, dtypes, shapes and bytes."""
    return sorted(ours) == sorted(theirs) and all(
        ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        and np.ascontiguousarray(ours[k]).tobytes() == np.ascontiguousarray(theirs[k]).tobytes()
        for k in theirs
    )


def compare(directory: Path) -> bool:
    """Stoker's logits and export against the saved referee (the project venv); prints a
    markdown table and returns whether every model passed."""
    import jax

    from stoker.model.hf import load_checkpoint, read_weights, save_checkpoint, to_hf

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}\n")
    print("| model | layers (sparse) | experts, top-k, renormalised | max abs logit diff | max abs logit "
          "| greedy argmax agrees | tensors round-trip bit for bit |")
    print("|---|---|---|---|---|---|---|")
    passed = True
    for name in MODELS:
        path = directory / name
        referee = np.load(path / "referee.npz")
        model = load_checkpoint(path)  # float32
        got, want = stoker_logits(model, referee["ids"]), referee["logits"]
        diff = float(np.abs(got - want).max())
        agree = got.argmax(-1) == want.argmax(-1)
        theirs = read_weights(path)
        with tempfile.TemporaryDirectory() as tmp:
            written = read_weights(save_checkpoint(model, tmp))
        exact = bit_equal(to_hf(model), theirs) and bit_equal(written, theirs)
        config = model.config
        sparse = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        print(f"| {name} | {config.num_layers} ({','.join(map(str, sparse))}) "
              f"| {config.num_experts}, {config.num_experts_per_tok}, {config.norm_topk_prob} "
              f"| {diff:.2e} | {float(np.abs(want).max()):.2f} | {'yes' if agree.all() else 'no'} "
              f"({int(agree.sum())}/{agree.size}) | {'yes' if exact else 'NO'} ({len(theirs)}) |")
        passed = passed and diff <= TOLERANCE and exact
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make", type=Path, metavar="DIR", help="transformers side (torch venv): write DIR/<model>")
    mode.add_argument("--compare", type=Path, metavar="DIR", help="Stoker side (project venv): read DIR/<model>")
    args = parser.parse_args()
    if args.make is not None:
        make(args.make)
    elif not compare(args.compare):
        sys.exit(1)


if __name__ == "__main__":
    main()
