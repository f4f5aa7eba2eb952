"""The rollout server's one settings dataclass, from the RLJob spec and its command line, and the
sampler and engine built from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.compilation_cache import cache_dir_for, enable_compilation_cache
from stoker.conversation.tokenization import allowed_token_ids
from stoker.distributed import Processes
from stoker.model.hf import dtype_from_name, read_config, read_weights
from stoker.rollout.engine import SEGMENT_TOKENS, Engine
from stoker.rollout.hosts import LeaderSampler
from stoker.rollout.mesh import rollout_mesh
from stoker.rollout.sampling import Sampler
from stoker.spec import RLJobSpec, SamplingSpec, TransformerConfig


@dataclass(frozen=True)
class RolloutSettings:
    model: TransformerConfig
    sampling: SamplingSpec
    seed: int
    buckets: tuple[int, ...]
    dtype: str
    checkpoint: str | None
    allowed_token_ids: tuple[int, ...] | None  # constrained decoding, as the actors' samplers do
    max_batch: int
    max_queue: int
    session_rows: int  # conversations cached at once: the batch plus those between turns
    segment_tokens: int
    port: int
    weight_poll_seconds: float
    compilation_cache_dir: str | None = None
    tensor_parallel: int | None = None  # chips the model splits over, every host's (None: rollout.mesh.default_tp)

    @classmethod
    def from_spec(cls, spec: RLJobSpec, **overrides: Any) -> RolloutSettings:
        """``overrides``: command-line values (None: the spec's)."""
        rollout = spec.rollout
        arch = spec.model.architecture
        # The actors' buckets: a conversation fits the model and the learner's longest row.
        longest = min(arch.max_seq_len, spec.learner.sequence_buckets[-1])
        buckets = tuple(b for b in spec.learner.sequence_buckets if b <= arch.max_seq_len) or (longest,)
        given = {k: v for k, v in overrides.items() if v is not None}
        max_batch = int(given.pop("max_batch", rollout.max_batch if rollout else 32))
        return cls(
            model=arch,
            sampling=spec.actors.sampling,
            seed=spec.seed,
            buckets=buckets,
            dtype=spec.model.dtype,
            checkpoint=spec.model.checkpoint,
            allowed_token_ids=allowed_token_ids(spec),
            max_batch=max_batch,
            max_queue=int(given.pop("max_queue", rollout.max_queue if rollout else 256)),
            session_rows=int(given.pop("session_rows", 2 * max_batch)),
            segment_tokens=int(given.pop("segment_tokens", SEGMENT_TOKENS)),
            port=int(given.pop("port", rollout.port if rollout else 50053)),
            weight_poll_seconds=float(given.pop("weight_poll_seconds", spec.actors.weight_poll_seconds)),
            compilation_cache_dir=spec.learner.compilation_cache_dir,
            tensor_parallel=given.pop("tensor_parallel", rollout.tensor_parallel if rollout else None),
            **given,
        )


def make_sampler(settings: RolloutSettings, processes: Processes | None = None) -> Sampler:
    """The sampler (initial weights: the checkpoint, else the learner's version-0 init) over a
    mesh of the server's devices: every host's, on a multi-host server, where the primary's is a
    ``LeaderSampler`` and the others replay its calls (rollout/hosts.py). Raises
    ``CheckpointError`` for a checkpoint that cannot be read, ``MeshError`` for a mesh the devices
    or the model cannot take."""
    processes = processes or Processes()
    enable_compilation_cache(cache_dir_for(settings.compilation_cache_dir))
    config, params = settings.model, None
    if settings.checkpoint:
        config, params = read_config(settings.checkpoint), read_weights(settings.checkpoint)
    mesh = rollout_mesh(config, settings.tensor_parallel)  # MeshError for one the chips cannot take
    options: dict[str, Any] = {"processes": processes} if processes.multi and processes.primary else {}
    make = LeaderSampler if options else Sampler
    return make(
        config,
        settings.sampling,
        seed=settings.seed,
        buckets=settings.buckets,
        params=params,
        dtype=dtype_from_name(settings.dtype),
        allowed_token_ids=settings.allowed_token_ids,
        # Every segment is padded to the full batch: one batch shape, so the programs compiled
        # are one per chunk width (a varying batch compiled ~5x as many, each seconds long, and
        # stalled the whole batch while it did; decode on an accelerator costs about the same
        # for 1 row as for a full batch).
        min_batch=settings.max_batch,
        session_rows=max(settings.session_rows, settings.max_batch),
        pin_sessions=True,  # the engine decides when a session moves to new weights
        min_chunk=1,  # a segment continues a turn from the one token sampled last
        mesh=mesh if mesh.size > 1 else None,
        **options,
    )


def make_engine(settings: RolloutSettings, sampler: Sampler | None = None) -> Engine:
    """The continuous-batching engine over ``sampler`` (None: ``make_sampler(settings)``)."""
    return Engine(
        sampler or make_sampler(settings), max_batch=settings.max_batch, max_queue=settings.max_queue,
        segment_tokens=settings.segment_tokens,
    )
