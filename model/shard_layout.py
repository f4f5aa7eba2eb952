"""Where a model's parameters live on this process's devices (``layout_of``: the boxes each
device holds, in HF names and layout), and a version's boxes staged for that layout."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.model.shard_format import Box

if TYPE_CHECKING:
    from stoker.model.shard_read import ShardedWeights

log = logging.getLogger(__name__)


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
    import jax

    sharding = getattr(current, "sharding", None)
    if isinstance(current, jax.Array) and not current.committed:
        return None
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def layout_of(model: Any) -> tuple[ParamSlot, ...]:
    """Every parameter's ``ParamSlot`` in ``model`` as it is placed now."""
    from stoker.model.hf import _param_items, hf_name

    tied = getattr(model, "lm_head", "absent") is None
    slots = []
    for path, var in _param_items(model):
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


class StagedWeights(Mapping[str, np.ndarray]):
    """A version's boxes for one model layout, read and verified, in host memory (a rollout
    follower's prefetch). ``load_into`` only places them; a model laid out otherwise than
    ``layout`` is loaded by slice from the source instead."""

    def __init__(self, weights: ShardedWeights, layout: tuple[ParamSlot, ...], pieces: tuple[tuple[np.ndarray, ...], ...]):
        self.weights, self.layout, self.pieces = weights, layout, pieces

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for parts in self.pieces for p in parts)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def load_into(self, model: Any) -> None:
        import jax
        import jax.numpy as jnp

        from stoker.model.hf import _param_items

        now = layout_of(model)
        if [(s.name, s.shape, s.sharding, s.devices) for s in now] != [(s.name, s.shape, s.sharding, s.devices) for s in self.layout]:
            log.warning("the model's layout changed since version %d was staged; reading its slices again", self.version)
            self.weights.load_into(model)
            return
        for (_, var), slot, parts in zip(_param_items(model), self.layout, self.pieces, strict=True):
            current = var.get_value()
            arrays = [np.asarray(p.T if slot.transpose else p).astype(current.dtype, copy=False) for p in parts]
            if slot.sharding is None:
                var.set_value(jnp.asarray(arrays[0], dtype=current.dtype))
            else:
                shards = [jax.device_put(a, d) for a, d in zip(arrays, slot.devices, strict=True)]
                var.set_value(jax.make_array_from_single_device_arrays(slot.shape, slot.sharding, shards))



def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))

