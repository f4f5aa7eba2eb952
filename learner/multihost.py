"""One logical learner over every JAX process of a multi-host slice.

Process 0, the *primary*, is the only one that talks to the buffer and the outside world: it
samples, commits, publishes weights, reports the version and duty cycle and writes metrics. Every
other process trains on exactly what the primary sampled. Each step starts with ``share_step``: one
all-gather of a small header (every process's stop flag, the primary's batch size) and, when there
is a batch, one broadcast of it as the buffer's own ``SampleResponse`` bytes. Every process then
runs the same deterministic host-side preparation and packing on the same bytes, and hands
``jax.device_put`` its full copy of each micro-batch: it transfers only the rows of the mesh's data
axis that live on this process's devices, so the global array is built from each process's share.
Why the primary broadcasts rather than every process fetching by batch id: docs/architecture.md.

Every decision that leads to a collective (train, publish, checkpoint, stop) is taken from shared
values, so all processes enter the same collectives in the same order and none waits for a peer
that chose otherwise. With one process every function here is a pass-through.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh

from stoker.buffer.client_types import SampledBatch, decode_sample, encode_sample
from stoker.distributed import Processes, collective, share
from stoker.learner.sharding import replicated
from stoker.v1 import buffer_pb2


def share_step(processes: Processes, batch: SampledBatch | None, stop: bool) -> tuple[bool, SampledBatch | None]:
    """``(stop, batch)`` agreed by every process: stop if any process was asked to; the primary's
    batch (None when the buffer had none in time, and always None when stopping: a batch sampled
    but not trained is not committed, so the buffer delivers it again after its lease)."""
    if not processes.multi:
        return stop, batch
    payload = encode_sample(batch).SerializeToString() if processes.primary and batch is not None else b""
    flags, data = share(processes, int(stop), payload, doing="agreeing on the next step", skip=lambda f: bool(f.any()))
    if flags.any() or not data:
        return bool(flags.any()), None
    if processes.primary:
        return False, batch
    return False, decode_sample(buffer_pb2.SampleResponse.FromString(data))


@functools.lru_cache(maxsize=4)
def _replicate_fn(mesh: Mesh) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=replicated(mesh))


def replicate(processes: Processes, tree: Any, mesh: Mesh) -> Any:
    """``tree`` (sharded over every process's devices) with a full copy on each device, so the
    primary can read it to the host without another collective. Every process must call it."""
    if not processes.multi:
        return tree
    with collective("gathering the weights"):
        return _replicate_fn(mesh)(tree)
