"""How the learner lays the model's layer loop out on its mesh while it traces a step: a context
(``training_layout``) the model's forward reads, so the model itself takes no mesh argument and
the actors' sampler (no layout) traces exactly as before."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from stoker.model.expert_parallel import ExpertLayout


class TrainingLayout(NamedTuple):
    """How the learner lays the layer loop out on its mesh (``training_layout``).

    ``stacked(shape)``: the sharding of a stacked [layers, ...] parameter, each layer sharded as
    it is on its own: without it XLA is free to gather the whole stack at once (every layer's
    weights, fsdp-gathered, live for the whole step). ``residual``: the residual stream's
    [B, T, hidden] sharding between layers (sequence sharding: the saved inputs of the layers
    split over tp), or None to leave it to XLA. ``experts``: where a mixture of experts' tokens
    travel to their experts (``stoker.model.expert_parallel``), or None to compute every expert
    on every token. Layouts only: the values do not change (unless an expert capacity drops tokens)."""

    stacked: Callable[[tuple[int, ...]], jax.sharding.Sharding]
    residual: jax.sharding.Sharding | None = None
    experts: ExpertLayout | None = None


_LAYOUT: contextvars.ContextVar[TrainingLayout | None] = contextvars.ContextVar("training_layout", default=None)


@contextlib.contextmanager
def training_layout(layout: TrainingLayout) -> Iterator[None]:
    """While tracing inside this, ``hidden_states`` places its layer loop as ``layout`` says."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def place_residual(h: jax.Array) -> jax.Array:
    """The residual stream between layers, constrained as the current layout says (if any)."""
    layout = _LAYOUT.get()
    if layout is None or layout.residual is None:
        return h
    return jax.lax.with_sharding_constraint(h, layout.residual)


def place_stacked(stacked: Any) -> Any:
    """A stacked [layers, ...] parameter tree, each leaf constrained as the current layout says."""
    layout = _LAYOUT.get()
    if layout is None:
        return stacked
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout.stacked(tuple(x.shape))), stacked)


def expert_layout() -> ExpertLayout | None:
    """The current layout's ``experts`` (None outside a learner's trace)."""
    layout = _LAYOUT.get()
    return None if layout is None else layout.experts
