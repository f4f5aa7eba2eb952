"""Shared by the rollout tests: a tiny model, its weights by version, and rollout servers on loopback.

Every server builds a fresh sampler; one persistent XLA compilation cache per module keeps the
identical tiny programs from compiling again for each of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.hf import to_hf
from stoker.model.logprobs import token_logprobs
from stoker.model.model import init_model
from stoker.rollout.engine import Engine
from stoker.rollout.sampling import Sampler
from stoker.rollout.server import RolloutServer
from stoker.spec import SamplingSpec, TransformerConfig

CONFIG = TransformerConfig(
    vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=128
)
MAX_BATCH = 8  # fewer than the 16 concurrent episodes: turns wait for slots and are admitted as others finish




def weights(version: int) -> dict[str, np.ndarray]:
    """The weights published as ``version``: the model initialised with seed ``version``."""
    return to_hf(init_model(CONFIG, seed=version))


def make_engine(
    *, max_queue: int = 64, segment_tokens: int = 2, clock: Callable[[], float] = time.monotonic,
    sampler_class: type[Sampler] = Sampler, **engine_options: Any,
) -> Engine:
    # One batch shape for every call (min_batch = max batch): fewer programs to compile.
    sampler = sampler_class(
        CONFIG, SamplingSpec(temperature=1.0), seed=0, buckets=(128,), min_batch=MAX_BATCH,
        session_rows=2 * MAX_BATCH, pin_sessions=True, min_chunk=1,
    )
    return Engine(
        sampler, max_batch=MAX_BATCH, max_queue=max_queue, segment_tokens=segment_tokens, clock=clock, **engine_options
    )


ServerFactory = Callable[..., RolloutServer]


@pytest.fixture
def serve(xla_cache: Path) -> Iterator[ServerFactory]:
    """Starts rollout servers on loopback; all are stopped after the test."""
    servers: list[RolloutServer] = []

    def start(engine: Engine | None = None, *, started: bool = True, **kwargs: object) -> RolloutServer:
        server = RolloutServer(engine or make_engine(), **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start() if started else server

    yield start
    for server in servers:
        server.stop(grace=0)


def teacher_forced(
    version: int, sequences: Sequence[Sequence[int]], config: TransformerConfig = CONFIG
) -> list[np.ndarray]:
    """log p(token t | tokens < t) under ``version``'s weights (the model initialised with seed
    ``version``) for every token after the first."""
    width = config.max_seq_len
    ids = np.zeros((len(sequences), width), np.int32)
    segments = np.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        segments[row, : len(seq)] = 1
    positions = np.broadcast_to(np.arange(width), ids.shape)
    model = init_model(config, seed=version)
    logits = model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments))
    out = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(ids[:, 1:])))
    return [out[row, : len(seq) - 1] for row, seq in enumerate(sequences)]
