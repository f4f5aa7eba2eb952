"""Where a model's parameters live on this process's devices (``layout_of``: the boxes each
device holds, in HF names and layout); ``stoker.weights.shard_read`` reads and stages a version's
boxes for such a layout.

JAX and ``stoker.model.hf`` (which imports Flax) are imported where they are used:
``stoker.weights.shards`` imports this module, and the shard format, its readers and transports
load with numpy alone (a second or more sooner than with JAX).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stoker.weights.shard_format import Box


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter of a model lives: its HF name, its shape and sharding, and the HF
    boxes this process's devices hold (``devices[i]`` holds ``reads[i]``; ``None``: unplaced)."""

    name: str
    transpose: bool
    shape: tuple[int, ...]
    sharding: Any
    devices: tuple[Any, ...]
    reads: tuple[tuple[str, Box], ...]
    tied: bool = False


def _where(current: Any) -> Any:
    import jax  # on use: see the module doc

    sharding = getattr(current, "sharding", None)
    if isinstance(current, jax.Array) and not current.committed:
        return None
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def layout_of(model: Any) -> tuple[ParamSlot, ...]:
    """Every parameter's ``ParamSlot`` in ``model`` as it is placed now."""
    from stoker.model.hf import hf_name, param_items  # on use: see the module doc

    tied = getattr(model, "lm_head", "absent") is None
    slots = []
    for path, var in param_items(model):
        name, transpose = hf_name(path)
        current = var.get_value()
        shape, sharding = tuple(current.shape), _where(current)
        if sharding is not None:
            placed = sharding.addressable_devices_indices_map(shape)
            devices = tuple(placed)
            boxes = [_box(index, shape) for index in placed.values() if index is not None]
        else:
            devices, boxes = (None,), [tuple((0, n) for n in shape)]
        reads = tuple((name, tuple(reversed(b)) if transpose else b) for b in boxes)
        slots.append(ParamSlot(name, transpose, shape, sharding, devices, reads, tied))
    return tuple(slots)


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
