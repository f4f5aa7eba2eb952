"""The job's device programs, built abstractly (``nnx.eval_shape``: no weights allocated) on a
slice's abstract devices and compiled by libtpu: the learner's grad step per sequence bucket, its
optimizer apply and weight publish, and each rollout server's prefill and decode step.

Each program's memory on one device is split into terms: what lives beside it (parameters,
optimizer state, the KV cache) and what it holds itself (gradients, its batch, temporaries).

Built on real devices instead (``stoker bench``), each program also says how to make concrete
arguments for one run (``Program.inputs``) and which of its outputs the next run takes in place
of the arguments it donates (``Program.carry``), as the learner and the sampler chain them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.hfconfig import read_config
from stoker.model.flops import train_flops
from stoker.learner import packing, remat, sharding, step, train, trees, value_network
from stoker.learner.optimizer import learning_rate_schedule
from stoker.learner.remat import RematChoice, StateBytes, grad_terms, shard_bytes  # shard_bytes: also programs_rollout's
from stoker.learner.settings import LearnerSettings
from stoker.model.attention_kernels import Backend, select_attention
from stoker.model.hf import dtype_from_name
from stoker.model.layers import head_dim
from stoker.model.model import RematPolicy, Transformer
from stoker.sizing.chips import chip
from stoker.sizing.compiler import Compiled, Slice, compile_lowered, compile_program
from stoker.spec import RLJobSpec, TransformerConfig


@dataclass
class Program:
    """One compiled program and the per-device memory it needs, term by term (bytes)."""

    component: str  # learner | rollout
    name: str
    shape: str  # e.g. "4 x 8192 tokens"
    terms: dict[str, int]
    compiled: Compiled
    tokens: int = 0  # tokens one run of the program processes (all devices)
    model_flops: float = 0.0  # useful flops of one run (all devices), for MFU
    notes: list[str] = field(default_factory=list)
    # (input shardings of the compiled program, seed) -> concrete arguments of one run.
    inputs: Callable[[Any, int], tuple[Any, ...]] | None = None
    # (argument index, output index): the output a next run takes for a donated argument.
    carry: tuple[tuple[int, int], ...] = ()
    # A learner program's rematerialisation: model.remat, auto resolved (the grad step's only).
    remat: RematChoice | None = None

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def largest(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


def random_like(abstract: Any, shardings: Any, seed: int, scale: float = 0.02) -> Any:
    """Arrays of ``abstract``'s shapes and dtypes laid out as ``shardings`` (a tree over the same
    structure): floats normal with std ``scale`` (0: zeros), integers 0, booleans true. Each device
    makes its own shard, so no device holds a whole tree."""
    leaves, treedef = jax.tree.flatten(abstract)
    # None where the compiled program dropped an argument it never reads (the prefill's cache
    # segment ids): any layout will do there.
    where = jax.tree.leaves(jax.tree.map(lambda _, sharding: sharding, abstract, shardings),
                            is_leaf=lambda x: x is None)
    made = [_filler(tuple(leaf.shape), np.dtype(leaf.dtype), sharding, scale)(np.int32(seed), np.int32(index))
            for index, (leaf, sharding) in enumerate(zip(leaves, where, strict=True))]
    return jax.tree.unflatten(treedef, made)


@functools.cache
def _filler(shape: tuple[int, ...], dtype: np.dtype, where: Any, scale: float) -> Any:
    """``random_like``'s program for one leaf layout. One program per distinct layout, not one for
    the whole tree: a model's layers repeat a dozen layouts, and a single program over ~300 leaves
    of random numbers took XLA minutes to compile on a TPU (the bench's "hang" of issue 51)."""
    def fill(seed: jax.Array, index: jax.Array) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.floating) and scale:
            key = jax.random.fold_in(jax.random.key(seed), index)  # each leaf its own numbers
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        if dtype == np.bool_:
            return jnp.ones(shape, jnp.bool_)
        return jnp.zeros(shape, dtype)

    return jax.jit(fill, out_shardings=where)


def full_batch(rows: int, length: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """The learner's device arrays of one micro-batch of ``rows`` episodes, each a full row of
    ``length`` random tokens, every one sampled (packed and weighted as the learner does)."""
    rng = np.random.default_rng(seed)
    episodes = [[packing.TrainSequence(rng.integers(0, vocab, length, dtype=np.int32), np.ones(length, np.uint8),
                                       np.full(length, -1.0, np.float32), np.zeros(length, np.int32),
                                       advantage=float(rng.choice([-1.0, 1.0])))] for _ in range(rows)]
    (micro,) = packing.pack(episodes, [length], {length: rows})
    step.assign_weights([micro], [micro.arrays["mask"]], "token-mean")
    return {name: micro.arrays[name] for name in step.DEVICE_FIELDS}


def on_devices(values: Any, shardings: Any) -> Any:
    """Host arrays (a tree) on the devices, laid out as ``shardings`` (the same tree)."""
    return jax.tree.map(jax.device_put, values, shardings)


def model_config(spec: RLJobSpec) -> tuple[TransformerConfig, str | None]:
    """The architecture the programs are built for: the checkpoint's config.json when it is on
    this machine, else the manifest's (with a note saying so)."""
    checkpoint = spec.model.checkpoint
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        return read_config(checkpoint), None
    if checkpoint:
        return spec.model.architecture, f"checkpoint {checkpoint} is not on this machine: sized from spec.model.architecture"
    return spec.model.architecture, None


def learner_programs(spec: RLJobSpec, slice_: Slice, *, buckets: list[int] | None = None,
                     progress: Callable[[str], None] = lambda line: None, backend: Backend | None = None,
                     kinds: Collection[str] | None = None, keep: bool = False,
                     memory_limit: int | None = None, compile_workers: int | None = None) -> list[Program]:
    """The learner's programs on ``slice_``: grad per bucket (at its micro-batch rows), apply, publish
    (``kinds``: only those). ``backend`` picks the attention kernel (a TPU's when None); ``keep``
    holds each compiled program, to run it on ``slice_``'s devices when they are real.
    ``memory_limit``: bytes one chip may hold, what ``model.remat: auto`` judges the grad steps
    against (``stoker.learner.remat``; the chip's usable HBM for a TPU slice when None).
    ``compile_workers``: threads compiling remat auto's candidates and the apply side by side
    (None: ``remat.side_by_side_workers()``; 0: one after another, each candidate only if the one before
    did not fit)."""
    config, note = model_config(spec)
    settings = LearnerSettings.from_spec(spec)
    dtype = dtype_from_name(settings.dtype)
    backend = backend or Backend("tpu", "", None)
    kernel = select_attention(settings.attention, backend, dtype=dtype,
                              head_dim=head_dim(config), softcap=config.attn_logit_softcap)
    options = step.StepOptions(
        settings.algorithm, settings.loss, settings.temperature, allowed_token_ids=settings.allowed_token_ids,
        attention=kernel.implementation, sequence_sharding=settings.sequence_sharding,
        expert_capacity_factor=settings.expert_capacity_factor,
    )
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
    value_model = None
    if options.needs_value:
        value_model = nnx.eval_shape(lambda: value_network.ValueNetwork(config, rngs=nnx.Rngs(1), dtype=dtype))
    mesh = sharding.make_mesh(settings.mesh_fsdp, settings.mesh_tp, slice_.devices, ep=settings.mesh_ep)
    optimizer = train.make_optimizer(settings.learning_rate, settings.max_grad_norm, settings.optimizer)

    @functools.cache
    def trainer_for(policy: RematPolicy) -> train.Trainer:
        return train.Trainer(model, dataclasses.replace(options, remat=policy), optimizer, mesh, value_model=value_model,
                             schedule=learning_rate_schedule(settings.learning_rate, settings.optimizer),
                             weight_dtype=dtype_from_name(settings.weight_dtype))

    devices = list(mesh.devices.flat)

    def slice_of(index: int) -> int:  # a collective's device index (mesh order) -> its slice
        return int(getattr(devices[index], "slice_index", 0) or 0) if index < len(devices) else 0

    fsdp = sharding.data_parallel_size(mesh)
    rows = packing.rows_for_buckets(settings.buckets, settings.microbatch_tokens_on(devices[0].platform if devices else "tpu", config), fsdp)
    lengths = sorted(buckets or list(settings.buckets), reverse=True)  # longest first: the largest step
    wanted = set(kinds) if kinds is not None else {"grad", "apply", "publish"}
    grads: dict[RematPolicy, list[Program]] = {}
    prefetched: dict[tuple[RematPolicy, int] | str, Future[Compiled]] = {}

    def grad_programs(policy: RematPolicy, allowed: int | None = None) -> list[Program]:
        """Each bucket's grad under ``policy``, longest first; stops past ``allowed`` bytes per chip."""
        trainer = trainer_for(policy)
        state = StateBytes.of(trainer)
        for length in lengths[len(grads.setdefault(policy, [])):]:
            grad, args = trainer.programs(rows[length], length)["grad"]
            progress(f"  grad {length} ({rows[length]} x {length} tokens, remat {policy})")
            ahead = prefetched.pop((policy, length), None)
            compiled = ahead.result() if ahead is not None else compile_program(grad, args, devices, slice_of, keep=keep)
            terms = grad_terms(state, compiled.argument_bytes, compiled.required_temp_bytes or compiled.temp_bytes)
            program = Program("learner", f"grad {length}", f"{rows[length]} x {length} tokens", terms, compiled,
                              tokens=rows[length] * length, model_flops=train_flops(config, rows[length], length),
                              inputs=grad_inputs(trainer, rows[length], length, config.vocab_size))
            grads[policy].append(program)
            if allowed is not None and (compiled.error or program.total * slice_.devices_per_chip > allowed):
                break
        return grads[policy]

    limit = memory_limit
    if limit is None and settings.remat == "auto" and backend.platform != "cpu":
        limit = chip(slice_.name.split(":")[0]).usable_hbm_bytes
    allowed = remat.budget(limit) if limit is not None else None

    def peak(policy: RematPolicy) -> int | None:
        programs = grad_programs(policy, allowed)
        if any(p.compiled.error for p in programs):
            return None
        return max(p.total for p in programs) * slice_.devices_per_chip

    workers = remat.side_by_side_workers() if compile_workers is None else compile_workers
    deciding = "grad" in wanted and settings.remat == "auto" and backend.platform != "cpu" and limit is not None
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="compile") if deciding and workers > 0 else None
    if pool is not None:
        # Each candidate's longest bucket (the one that decides the fit) and the apply, traced here
        # and compiled on the pool's threads: on a TPU host ~15-30 s each, side by side not in turn.
        progress(f"  compiling remat {', '.join(remat.REMAT_ORDER)} and the apply side by side ({workers} threads)")
        for policy in remat.REMAT_ORDER:
            grad, args = trainer_for(policy).programs(rows[lengths[0]], lengths[0])["grad"]
            started = time.perf_counter()
            prefetched[(policy, lengths[0])] = pool.submit(compile_lowered, grad.lower(*args), started, devices,
                                                           slice_of, keep=keep)
        if "apply" in wanted:
            apply, args = trainer_for(remat.REMAT_ORDER[0]).programs(rows[settings.buckets[-1]], settings.buckets[-1])["apply"]
            started = time.perf_counter()
            prefetched["apply"] = pool.submit(compile_lowered, apply.lower(*args), started, devices, slice_of, keep=keep)

    if "grad" in wanted:
        choice = remat.resolve_remat(settings.remat, backend.platform, peak, limit)
    else:  # apply and publish do not depend on remat: nothing to decide it by
        choice = remat.RematChoice(settings.remat, "full" if settings.remat == "auto" else settings.remat,
                                   "no grad program built")
    trainer = trainer_for(choice.policy)
    state = StateBytes.of(trainer)
    stored = "".join(f", {what} {name}" for what, name in (("weights", settings.weight_dtype),
                                                            ("Adam state", settings.optimizer.state_dtype)) if name != "float32")
    ep = int(mesh.shape[sharding.EP])
    axes = f"fsdp {mesh.shape[sharding.FSDP]}" + (f" x ep {ep}" if ep > 1 else "") + f" x tp {mesh.shape[sharding.TP]}"
    if config.num_experts and (ep > 1 or settings.expert_capacity_factor is not None):
        factor = settings.expert_capacity_factor
        axes += f", experts routed by all-to-all ({'no drops' if factor is None else f'capacity factor {factor:g}'})"
    layout = (f"{axes}, {settings.dtype}{stored}, remat {choice.policy}, "
              f"attention {kernel.implementation}{', sequence sharding' if settings.sequence_sharding else ''}")
    notes = [layout] + ([choice.line] if settings.remat == "auto" and "grad" in wanted else []) + ([note] if note else [])
    out: list[Program] = []

    def apply_inputs(shardings: Any, seed: int) -> tuple[Any, ...]:
        where_params, where_opt, where_grads = shardings
        # Adam's state before its first update (zeros): random second moments could be negative.
        return (random_like(trainer.params, where_params, seed), random_like(trainer.opt_state, where_opt, seed, 0.0),
                random_like(trainer.params, where_grads, seed + 1))

    if "grad" in wanted:
        # In the manifest's bucket order, each compiled once: auto's choice reuses what it compiled.
        by_length = {int(p.name.split()[1]): p for p in grad_programs(choice.policy)}
        for length in buckets or list(settings.buckets):
            program = by_length[length]
            program.notes, program.remat = list(notes), choice
            out.append(program)
    if "apply" in wanted:
        apply, args = trainer.programs(rows[settings.buckets[-1]], settings.buckets[-1])["apply"]
        progress("  apply")
        ahead = prefetched.pop("apply", None)  # the same program whatever the remat
        compiled = ahead.result() if ahead is not None else compile_program(apply, args, devices, slice_of, keep=keep)
        terms = {"parameters": state.params, "optimizer": state.opt_state, "gradients": state.params,
                 "temporaries": compiled.required_temp_bytes or compiled.temp_bytes}
        if compiled.output_bytes - compiled.alias_bytes > 2**20:  # outputs not written in place of donated inputs
            terms["not donated"] = compiled.output_bytes - compiled.alias_bytes
        # The update donates the parameters and the optimizer state: the next takes its outputs.
        out.append(Program("learner", "apply", "one Adam update", terms, compiled, notes=list(notes),
                           inputs=apply_inputs, carry=((0, 0), (1, 1)), remat=choice))
    if "publish" in wanted:
        progress("  publish")
        out.append(_publish(trainer, state, devices, slice_of, notes, keep=keep))
        out[-1].remat = choice
    if pool is not None:  # a candidate auto did not need is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def grad_inputs(trainer: train.Trainer, rows: int, length: int, vocab: int) -> Callable[[Any, int], tuple[Any, ...]]:
    """Concrete arguments of one run of ``trainer``'s grad step over ``rows`` full rows of ``length``."""
    def inputs(shardings: Any, seed: int) -> tuple[Any, ...]:
        where_params, where_frozen, where_batch, where_scalars = shardings
        scalars = {"version": trees.host_scalar(0, np.int32), "num_pairs": trees.host_scalar(1, np.float32),
                   "micro": trees.host_scalar(0, np.int32)}
        return (random_like(trainer.params, where_params, seed), random_like(trainer.frozen, where_frozen, seed + 1),
                on_devices(full_batch(rows, length, vocab, seed), where_batch), on_devices(scalars, where_scalars))
    return inputs


def _publish(trainer: Any, state: StateBytes, devices: list[Any], slice_of: Any, notes: list[str],
             *, keep: bool = False) -> Program:
    """``Trainer.policy_copy`` as one program over the training layout: the device side of the
    weight publish (the copy in the compute dtype the publisher reads while training goes on)."""
    def copy(live: Any) -> Any:
        saved = trainer.params
        trainer.params = live  # policy_copy reads the trainer's parameters: here the traced ones
        try:
            return trainer.policy_copy()
        finally:
            trainer.params = saved

    args = (jax.eval_shape(lambda: trainer.params),)
    try:  # the copy keeps the parameters' own layout: nothing gathered onto one chip
        jitted = jax.jit(copy, in_shardings=(trainer.param_shardings,), out_shardings=trainer.param_shardings["policy"])
        compiled = compile_program(jitted, args, devices, slice_of, keep=keep)
    except ValueError:  # a policy_copy returning another tree than the policy's: its own layout
        compiled = compile_program(jax.jit(copy, in_shardings=(trainer.param_shardings,)), args, devices, slice_of,
                                   keep=keep)
    terms = {"parameters": state.params, "optimizer": state.opt_state, "publish copy": compiled.output_bytes,
             "temporaries": compiled.required_temp_bytes or compiled.temp_bytes}

    def inputs(shardings: Any, seed: int) -> tuple[Any, ...]:
        return (random_like(trainer.params, shardings[0], seed),)

    return Program("learner", "publish", "policy copy, training layout", terms, compiled, notes=list(notes),
                   inputs=inputs)
