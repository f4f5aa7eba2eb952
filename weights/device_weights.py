"""Weights handed over device to device inside one process (colocated mode).

JAX and ``stoker.model.hf`` (which imports Flax) are imported where they are used, as in
``shard_layout``: ``stoker.weights.shards`` imports this module, and the shard format, its readers
and transports load with numpy alone (a second or more sooner than with JAX).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from stoker.hfconfig import CheckpointError


class DeviceWeights(Mapping[str, np.ndarray]):
    """Weights handed over inside one process (colocated mode): ``load_into`` reshards each
    parameter from ``source``'s arrays (another module of the same architecture, e.g. the
    learner's policy over a ``policy_copy``) into the target's sharding device to device, never
    through the host. As a Mapping it gives host copies (HF names and layout)."""

    def __init__(self, source: Any):
        from stoker.model.hf import hf_name, param_items  # on use: see the module doc

        self._values: dict[str, tuple[Any, bool]] = {}
        for path, var in param_items(source):
            name, transpose = hf_name(path)
            self._values[name] = (var.get_value(), transpose)

    def __getitem__(self, name: str) -> np.ndarray:
        value, transpose = self._values[name]
        host = np.asarray(value)
        return np.ascontiguousarray(host.T) if transpose else host

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def load_into(self, model: Any) -> None:
        import jax  # on use, as the model below: see the module doc

        from stoker.model.hf import hf_name, param_items

        items = param_items(model)
        missing = sorted({hf_name(path)[0] for path, _ in items} - set(self._values))
        if missing:
            raise CheckpointError(f"the weights do not match the model: missing {missing[:5]}")
        for path, var in items:
            value, _ = self._values[hf_name(path)[0]]
            current = var.get_value()
            if tuple(value.shape) != tuple(current.shape):
                raise CheckpointError(f"{hf_name(path)[0]}: shape {tuple(value.shape)} does not fit the model")
            where = getattr(current, "sharding", None)
            if isinstance(current, jax.Array) and not current.committed:
                where = None
            cast = value.astype(current.dtype)
            var.set_value(jax.device_put(cast, where) if isinstance(where, jax.sharding.Sharding) else cast)
