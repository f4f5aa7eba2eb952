"""Kernels compiled for real TPUs: splash attention through Mosaic (not Pallas' interpreter) inside
the learner's step, and the rollout sampler's programs, for v5e and v6e, by libtpu on this CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from stoker.learner import sharding, train
from stoker.model.attention_kernels import attend, rows_split_over
from stoker.model.model import Transformer, packed_visibility
from stoker.sizing.compiler import load_slice
from stoker.spec import TransformerConfig

pytestmark = pytest.mark.slow
TOPOLOGIES = ["v5e:2x2", "v6e:2x2"]
MOSAIC = "tpu_custom_call"  # Pallas' TPU kernels lower to this custom call; the interpreter to plain HLO


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_learner_step_with_splash_compiles_through_mosaic(topology: str) -> None:
    mesh = sharding.make_mesh(-1, 1, load_slice(topology, 4).devices)
    config = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                               intermediate_size=128, max_seq_len=256)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    trainer = train.Trainer(model, train.StepOptions(attention="splash"), train.make_optimizer(1e-3, 1.0), mesh)
    grad, args = trainer.programs(4, 256)["grad"]
    lowered = grad.lower(*args)
    assert MOSAIC in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.cost_analysis()["flops"] > 0


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_splash_needs_fewer_temporaries_than_dense_attention(topology: str) -> None:
    """Forward and backward of one layer's attention over 2 rows of 1,024 tokens per chip, 16 heads:
    the dense form's [heads, T, T] float32 scores (64 MiB a row) overflow on-chip memory into HBM;
    splash's tiles never do."""
    mesh = sharding.make_mesh(-1, 1, load_slice(topology, 4).devices)
    rows = NamedSharding(mesh, PartitionSpec(sharding.FSDP))
    qkv = jax.ShapeDtypeStruct((8, 1024, 16, 64), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((8, 1024), jnp.int32)

    def temporaries(kernel: str) -> tuple[int, str]:
        def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
            with rows_split_over(mesh, sharding.FSDP):
                out = attend(kernel, q, k, v, packed_visibility(seg), scale=64**-0.5)  # type: ignore[arg-type]
            return jnp.sum(out.astype(jnp.float32))

        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(rows,) * 4).lower(qkv, qkv, qkv, segments)
        return int(lowered.compile().memory_analysis().temp_size_in_bytes), lowered.as_text()

    splash, splash_text = temporaries("splash")
    dense, dense_text = temporaries("xla")
    assert MOSAIC in splash_text and MOSAIC not in dense_text
    assert dense >= 64 * 2**20  # at least one row's scores in HBM
    assert splash < dense / 4


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_samplers_prefill_and_decode_compile_beside_the_conversation_cache(
    topology: str, job: Callable[..., Path]
) -> None:
    from stoker.manifest import load_job
    from stoker.sizing.programs_rollout import rollout_programs

    accelerator = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}[topology.split(":")[0]]
    path = job(rollout=f"  rollout: {{accelerator: {accelerator}, topology: '2x2', maxBatch: 8}}\n")
    spec = load_job(str(path)).spec
    programs = {p.name: p for p in rollout_programs(spec, load_slice(topology, 4))}
    assert list(programs) == ["prefill", "decode"]
    # 2 x 8 session rows + the scratch row, 128 slots (the longest bucket), 1 layer, 2 key/value
    # heads of width 16: tp 4 (the 4 query heads) does not divide 2 heads, so every chip holds it all.
    slots, rows = 128, 2 * 8 + 1
    cache = 2 * rows * slots * 2 * 16 * 4  # keys and values, float32
    for program in programs.values():
        assert program.compiled.error is None and program.compiled.flops > 0
        assert program.terms["KV cache"] == cache
    assert programs["decode"].tokens == 8  # one token per row per step
    assert programs["prefill"].tokens == 8 * slots


def test_a_one_chip_servers_decode_runs_the_decode_kernels(job: Callable[..., Path]) -> None:
    """The rollout server on one chip decodes on the flat cache's kernels (rollout/sampling.py),
    so the plan's decode program does too; over the 2x2 meshes above it keeps the select."""
    from stoker.manifest import load_job
    from stoker.sizing.programs_rollout import rollout_programs

    path = job(rollout="  rollout: {accelerator: tpu-v5-lite-podslice, topology: '1x1', maxBatch: 8}\n")
    spec = load_job(str(path)).spec
    (decode,) = rollout_programs(spec, load_slice("v5e:1x1", 1), kinds=["decode"], keep=True)
    assert "decode kernels" in decode.notes[0]
    # One kernel a layer: at 8 rows the cache write runs inside the attention (WRITE_FUSED_MAX_ROWS).
    assert decode.compiled.executable.as_text().count(MOSAIC) == spec.model.architecture.num_layers
    (shared,) = rollout_programs(spec, load_slice("v5e:2x2", 4), kinds=["decode"], keep=True)
    assert "decode kernels" not in shared.notes[0] and MOSAIC not in shared.compiled.executable.as_text()
