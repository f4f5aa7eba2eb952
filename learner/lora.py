"""LoRA (Hu et al. 2021, arXiv:2106.09685): low-rank adapters on the named projections, base frozen.

Each target projection ``y = x W`` (``W`` [in, out], Flax's kernel layout) trains as

    y = x W + (alpha / r) * dropout(x) A B,        A [in, r], B [r, out]

with ``A`` drawn like PEFT's default (Kaiming-uniform, bound 1/sqrt(in)) and ``B`` zero, so the
first forward is the base model's. Only ``A`` and ``B`` are parameters of the optimizer; the base
stays in the compute dtype, frozen, and doubles as the reference policy. What the samplers, the
exports and ``Trainer.policy_copy`` see is the merged ``W + (alpha / r) A B``.

Adapters are keyed by the projection's Hugging Face module path, ``layers.3.self_attn.q_proj``
(``model.`` in front is the checkpoint name; ``stoker.learner.peft`` writes PEFT's file names).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.spec import TransformerConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


@dataclass(frozen=True)
class LoraConfig:
    """``spec.model.lora`` (hashable: part of the compiled step)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}; expected some of {', '.join(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_lora_targets(architecture: TransformerConfig, config: LoraConfig) -> None:
    """Refuse MLP targets on a mixture-of-experts model: its sparse layers have no single
    gate/up/down projection to adapt (the experts are stacked, ``stoker.model.moe``)."""
    mlp = [t for t in config.targets if t in MLP_TARGETS]
    if architecture.num_experts and mlp:
        raise ValueError(
            f"LoRA on {', '.join(mlp)} of a mixture-of-experts model is not supported (its experts have no "
            f"adapters); give model.lora.targets among {', '.join(ATTENTION_TARGETS)}"
        )


def target_paths(num_layers: int, targets: tuple[str, ...]) -> Iterator[tuple[str, int, str, str]]:
    """(module path, layer, block attribute, projection) of every adapted projection."""
    for layer in range(num_layers):
        for name in targets:
            parent = "self_attn" if name in ATTENTION_TARGETS else "mlp"
            yield f"layers.{layer}.{parent}.{name}", layer, parent, name


def _kernel(state: Any, layer: int, parent: str, name: str) -> Any:
    return state["layers"][layer][parent][name]["kernel"]


def init_adapters(policy_state: Any, num_layers: int, config: LoraConfig) -> dict[str, dict[str, Any]]:
    """Fresh float32 adapters for every target of ``policy_state`` (an ``nnx.State`` of the
    Transformer): ``A`` uniform in +-1/sqrt(in), ``B`` zero. Abstract leaves give abstract adapters."""
    key = jax.random.key(config.seed)
    adapters: dict[str, dict[str, Any]] = {}
    for index, (path, layer, parent, name) in enumerate(target_paths(num_layers, config.targets)):
        kernel = jax.tree.leaves(_kernel(policy_state, layer, parent, name))[0]  # an array, or abstract
        n_in, n_out = kernel.shape
        if isinstance(kernel, jax.ShapeDtypeStruct):
            adapters[path] = {
                "a": jax.ShapeDtypeStruct((n_in, config.rank), jnp.float32),
                "b": jax.ShapeDtypeStruct((config.rank, n_out), jnp.float32),
            }
            continue
        bound = 1.0 / float(n_in) ** 0.5
        a = jax.random.uniform(jax.random.fold_in(key, index), (n_in, config.rank), jnp.float32, -bound, bound)
        adapters[path] = {"a": a, "b": jnp.zeros((config.rank, n_out), jnp.float32)}
    return adapters


def module_path(key_path: tuple[Any, ...]) -> str:
    """``layers.0.self_attn.q_proj.kernel`` from a ``jax.tree_util`` key path into an nnx.State."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in key_path]
    return ".".join(n for n in names if n != "value")


def merged_state(base: Any, adapters: dict[str, dict[str, Any]], config: LoraConfig) -> Any:
    """``base`` (an nnx.State) with every target kernel ``W`` replaced by ``W + scale * A B``,
    computed in float32 and stored in ``W``'s dtype."""

    def merge(key_path: tuple[Any, ...], w: Any) -> Any:
        path = module_path(key_path)
        adapter = adapters.get(path.removesuffix(".kernel")) if path.endswith(".kernel") else None
        if adapter is None:
            return w
        delta = config.scale * (adapter["a"].astype(jnp.float32) @ adapter["b"].astype(jnp.float32))
        return (w.astype(jnp.float32) + delta).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(merge, base)


class LoraLinear(nnx.Module):
    """A frozen projection plus its adapter: ``base(x) + scale * dropout(x) A B``."""

    def __init__(self, base: nnx.Linear, a: jax.Array, b: jax.Array, scale: float, dropout: float, key: jax.Array | None):
        self.base = base
        self.a = nnx.Param(a)
        self.b = nnx.Param(b)
        self.scale = scale
        self.dropout = dropout
        # Raw key data (stacks like any array when the layers run as a scan); None: no dropout.
        self.key = nnx.Variable(jax.random.key_data(key)) if key is not None and dropout > 0 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base(x)
        h = x
        if self.key is not None:
            keep = jax.random.bernoulli(jax.random.wrap_key_data(self.key[...]), 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(x.dtype)
        low = (h @ self.a[...].astype(x.dtype)) @ self.b[...].astype(x.dtype)
        return y + (self.scale * low).astype(y.dtype)


def attach(model: Any, adapters: dict[str, dict[str, jax.Array]], config: LoraConfig, key: jax.Array | None) -> None:
    """Swap each target projection of ``model`` (a Transformer built over the frozen base) for a
    ``LoraLinear`` over ``adapters``; ``key`` seeds the dropout masks (None: no dropout, as in eval)."""
    for index, path in enumerate(adapters):
        _, layer, parent, name = path.split(".")
        block = getattr(model.layers[int(layer)], parent)
        sub = None if key is None else jax.random.fold_in(key, index)
        setattr(block, name, LoraLinear(getattr(block, name), adapters[path]["a"], adapters[path]["b"], config.scale,
                                        config.dropout, sub))
