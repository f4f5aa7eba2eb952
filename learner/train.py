"""The jitted train step: forward, loss, gradients, optimizer update, on a device mesh.

One optimizer update per sampled batch. The batch arrives as one or more fixed-shape micro-batches
(``stoker.learner.packing``); ``Trainer.grad`` runs the model and the loss on one micro-batch and
returns its gradients, which are summed over micro-batches (the loss weights are normalised over the
whole batch, so the sum is exactly the full-batch gradient) before ``Trainer.apply`` takes one Adam
step. ``grad`` is compiled once per bucket shape, ``apply`` and ``accumulate`` once per run.

Layout (see ``stoker.learner.sharding``): parameters and optimizer state sharded by
PartitionSpecs, batch rows over ``fsdp``. The model forward runs under ``jit`` with explicit
shardings (XLA's SPMD partitioner places the collectives); the loss is a per-shard computation
under ``shard_map`` — every packed sequence lies inside one row and every row inside one shard, so
each shard reduces its own rows and one ``psum`` over ``fsdp`` combines them.

The step's options, its per-shard loss and the micro-batches' loss weights are
``stoker.learner.step``; PPO's critic is ``stoker.learner.value_network``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from stoker.learner import algorithms, lora, sharding
from stoker.learner.optimizer import make_optimizer as make_optimizer  # re-exported: train.make_optimizer
from stoker.learner.optimizer import updates_applied
from stoker.learner.packing import MicroBatch
# Re-exported: train.StepOptions, train.assign_weights, train.ValueNetwork, as callers name them.
from stoker.learner.step import StepOptions as StepOptions
from stoker.learner.step import assign_weights as assign_weights
from stoker.learner.step import abstract_batch, add_router_loss, batch_to_device, per_shard_loss
from stoker.learner.trees import abstract_placed, cast_floats, float_dtype, fresh_copy, host_scalar
from stoker.learner.value_network import ValueNetwork as ValueNetwork
from stoker.learner.value_network import init_value_network as init_value_network
from stoker.model.attention_kernels import rows_split_over
from stoker.model.logprobs import TokenStats, token_stats
from stoker.model.model import Transformer
from stoker.model.moe import RouterStats
from stoker.model.training_layout import TrainingLayout, training_layout

class Trainer:
    """Parameters, optimizer state and the compiled step functions on one mesh.

    ``params`` (what the optimizer trains) is a dict ``{"policy": nnx.State, "value": nnx.State}``
    (value only for PPO); with LoRA ``{"lora": adapters, ...}`` instead of the policy, whose frozen
    base is ``base`` (in the compute dtype). ``reference`` is the frozen initial policy when the
    objective needs one (KL, DPO); with LoRA the base is the reference. ``frozen`` holds what the
    step reads and never trains: ``{"reference": ...}`` or ``{"base": ...}``.
    """

    def __init__(
        self,
        model: Transformer,
        options: StepOptions,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        value_model: nnx.Module | None = None,
        schedule: optax.Schedule | None = None,
        teacher_model: Transformer | None = None,
        weight_dtype: Any = jnp.float32,
    ):
        self.options = options
        # Hugging Face trains with the router's loss only when output_router_logits is set.
        arch = model.config
        self.router_aux_coef = arch.router_aux_loss_coef if arch.output_router_logits else 0.0
        self.num_experts = arch.num_experts
        self.schedule = schedule  # the optimizer's learning rate per update, for the metrics
        self.mesh = mesh
        self.optimizer = optimizer
        self.nonfinite_updates = 0  # updates skipped for a non-finite gradient (``step``)
        self.policy_def, policy_state = nnx.split(model)
        # Mixed precision: the model computes in its own dtype (bfloat16, say) but the optimizer
        # keeps master weights in ``weight_dtype``, float32 by default: an Adam step of lr ~1e-6
        # is below bfloat16's resolution (8 mantissa bits) and rounds away in bfloat16 weights
        # (spec.learner.weightDtype says so). The update is computed in float32 either way and
        # rounded once into the weights (``_apply_impl``); gradients come in the weights' dtype.
        self.compute_dtype = float_dtype(policy_state)
        self.weight_dtype = jnp.dtype(weight_dtype)
        params: dict[str, Any] = {}
        base = None
        if options.lora is not None:
            if self.weight_dtype != jnp.float32:
                raise ValueError("learner.weightDtype: LoRA trains float32 adapters on a base frozen in model.dtype; "
                                 "expected float32 with model.lora")
            lora.check_lora_targets(model.config, options.lora)
            base = cast_floats(policy_state, self.compute_dtype)
            params["lora"] = lora.init_adapters(policy_state, model.config.num_layers, options.lora)
        else:
            params["policy"] = cast_floats(policy_state, self.weight_dtype)
        self.value_def = None
        if options.needs_value:
            if value_model is None:
                raise ValueError("PPO needs a value_model")
            self.value_def, value_state = nnx.split(value_model)
            params["value"] = cast_floats(value_state, self.weight_dtype)
        self.param_shardings = sharding.tree_shardings(params, mesh)
        # An abstract model (nnx.eval_shape) gives a trainer that only compiles: see memory_analysis.
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        self.params = abstract_placed(params, self.param_shardings) if self.abstract else jax.device_put(params, self.param_shardings)
        self.base = None
        self.base_shardings = None
        if base is not None:
            self.base_shardings = sharding.tree_shardings(base, mesh)
            self.base = abstract_placed(base, self.base_shardings) if self.abstract else jax.device_put(base, self.base_shardings)
        # A copy in the compute dtype, not an alias: the live parameters are donated to updates.
        self.reference = None
        if options.needs_reference and options.lora is None:
            reference = cast_floats(self.params["policy"], self.compute_dtype)
            self.reference = reference if self.abstract else jax.tree.map(jnp.copy, reference)
        # The optimizer sees float32 parameters and gradients (``_apply_impl``), so its state is
        # float32 whatever the weights' dtype, unless it stores its own (optimizerStateDtype).
        init = lambda p: optimizer.init(cast_floats(p, jnp.float32))  # noqa: E731
        opt_state = jax.eval_shape(init, self.params)
        self.opt_shardings = sharding.tree_shardings(opt_state, mesh)
        self.opt_state = (
            abstract_placed(opt_state, self.opt_shardings) if self.abstract
            else jax.jit(init, out_shardings=self.opt_shardings)(self.params)
        )
        rep = sharding.replicated(mesh)
        batch_spec = sharding.batch_sharding(mesh)
        self.frozen: dict[str, Any] = {}
        frozen_shardings: dict[str, Any] = {}
        if self.base is not None:
            self.frozen["base"], frozen_shardings["base"] = self.base, self.base_shardings
        elif self.reference is not None:
            self.frozen["reference"], frozen_shardings["reference"] = self.reference, self.param_shardings["policy"]
        self.teacher_def = None
        if options.needs_teacher:  # frozen, in the compute dtype, laid out by the same rule as the reference
            if teacher_model is None:
                raise ValueError("distillation needs a teacher_model")
            self.teacher_def, teacher_state = nnx.split(teacher_model)
            teacher_state = cast_floats(teacher_state, self.compute_dtype)
            frozen_shardings["teacher"] = sharding.tree_shardings(teacher_state, mesh)
            self.frozen["teacher"] = (
                abstract_placed(teacher_state, frozen_shardings["teacher"]) if self.abstract
                else jax.device_put(teacher_state, frozen_shardings["teacher"])
            )
        ref_shardings = frozen_shardings
        self._grad = jax.jit(
            self._grad_impl,
            in_shardings=(self.param_shardings, ref_shardings, batch_spec, rep),
            out_shardings=(self.param_shardings, rep),
        )
        self._apply = jax.jit(
            self._apply_impl,
            in_shardings=(self.param_shardings, self.opt_shardings, self.param_shardings),
            out_shardings=(self.param_shardings, self.opt_shardings, rep, rep),
            donate_argnums=(0, 1),
        )
        self._evaluate = jax.jit(
            lambda params, frozen, batch, scalars: self._loss(params, frozen, batch, scalars, train=False)[1],
            in_shardings=(self.param_shardings, ref_shardings, batch_spec, rep),
            out_shardings=rep,
        )
        self._merge = None
        if self.base is not None:
            assert options.lora is not None
            config = options.lora
            self._merge = jax.jit(
                lambda base, adapters: lora.merged_state(base, adapters, config),
                in_shardings=(self.base_shardings, self.param_shardings["lora"]),
                out_shardings=self.base_shardings,
            )
        self._accumulate = jax.jit(
            lambda a, b: jax.tree.map(jnp.add, a, b),
            in_shardings=(self.param_shardings, self.param_shardings),
            out_shardings=self.param_shardings,
            donate_argnums=(0,),
        )
        # One program for the whole copy: an eager jnp.copy per leaf compiled one per distinct shape.
        self._copy = None
        if "policy" in self.param_shardings:
            compute_dtype = self.compute_dtype
            self._copy = jax.jit(
                lambda policy: jax.tree.map(partial(fresh_copy, dtype=compute_dtype), policy),
                in_shardings=(self.param_shardings["policy"],),
                out_shardings=self.param_shardings["policy"],
            )

    # -------------------------------------------------------------------------------- device

    def _forward_logprobs(
        self, policy: Any, batch: dict[str, jax.Array], *, full: bool = True, adapters: Any = None,
        dropout_key: jax.Array | None = None, graphdef: Any = None,
    ) -> tuple[TokenStats, RouterStats]:
        """The policy's per-token stats at the targets, the logits a chunk at a time
        (``logprobs.token_stats``), and its routing sums (a mixture of experts'); ``full=False``:
        log-probs only (the reference policy).
        ``adapters``: LoRA's, on the frozen ``policy`` (``stoker.learner.lora``)."""
        model = nnx.merge(self.policy_def if graphdef is None else graphdef, cast_floats(policy, self.compute_dtype))
        if adapters is not None:
            assert self.options.lora is not None
            lora.attach(model, adapters, self.options.lora, dropout_key)
        mesh = self.mesh
        layout = TrainingLayout(
            lambda shape: sharding.stacked_sharding(shape, mesh),
            sharding.residual_sharding(mesh) if self.options.sequence_sharding else None,
            sharding.expert_layout(mesh, self.num_experts, self.options.expert_capacity_factor),
        )
        # Each device attends over its own rows; the layer loop keeps the training layout.
        with rows_split_over(self.mesh, sharding.row_axes(mesh)), training_layout(layout):
            hidden, routing = model.hidden_states_and_routing(
                batch["tokens"], batch["positions"], batch["segment_ids"], remat=self.options.remat if full else "none",
                kernel=self.options.attention,
            )
        stats = token_stats(
            hidden,
            model.output_head(),
            batch["targets"],
            temperature=self.options.temperature,
            allowed_token_ids=self.options.allowed_token_ids,
            top_k=self.options.top_k,
            min_p=self.options.min_p,
            entropy=full and self.options.loss.entropy_coef > 0,
            # For stuck groups' tokens (algorithms.stuck_unlikelihood).
            log_not_taken=full and self.options.algorithm in ("grpo", "gspo"),
        )
        return stats, routing

    def _loss(
        self, params: dict[str, Any], frozen: dict[str, Any], batch: dict[str, jax.Array], scalars: dict[str, jax.Array],
        *, train: bool = True,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        adapters = params.get("lora")
        reference = frozen.get("reference")
        if adapters is None:
            policy, routing = self._forward_logprobs(params["policy"], batch)
        else:
            config = self.options.lora
            assert config is not None
            key = None
            if train and config.dropout > 0:  # a fresh mask per update and micro-batch
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), scalars["version"]), scalars["micro"])
            policy, routing = self._forward_logprobs(frozen["base"], batch, adapters=adapters, dropout_key=key)
            reference = frozen["base"] if self.options.needs_reference else None
        logp = policy.logprobs
        extras: dict[str, jax.Array] = {}
        if policy.entropy is not None:
            extras["entropy"] = policy.entropy
        if policy.log_not_taken is not None:
            extras["log_not_taken"] = policy.log_not_taken
        if "teacher" in frozen:
            teacher, _ = self._forward_logprobs(frozen["teacher"], batch, full=False, graphdef=self.teacher_def)
            extras["teacher_logprobs"] = jax.lax.stop_gradient(teacher.logprobs)
        if reference is not None:
            extras["ref_logprobs"] = jax.lax.stop_gradient(self._forward_logprobs(reference, batch, full=False)[0].logprobs)
        if self.value_def is not None:
            critic = nnx.merge(self.value_def, cast_floats(params["value"], self.compute_dtype))
            extras["values"] = critic(batch["tokens"], batch["positions"], batch["segment_ids"])
        row = PartitionSpec(sharding.row_axes(self.mesh), None)
        per_shard = jax.shard_map(
            partial(per_shard_loss, self.options, sharding.row_axes(self.mesh)),
            mesh=self.mesh,
            in_specs=(row, {k: row for k in extras}, {k: row for k in batch}, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec()),
        )
        loss, stats = per_shard(logp, extras, batch, scalars)
        if routing.load.shape[0]:  # a mixture of experts: its load-balancing loss and load
            loss, stats = add_router_loss(loss, stats, routing, self.router_aux_coef, jnp.sum(batch["weights"]))
        return loss, stats

    def _grad_impl(
        self, params: dict[str, Any], frozen: dict[str, Any], batch: dict[str, jax.Array], scalars: dict[str, jax.Array]
    ) -> tuple[Any, dict[str, jax.Array]]:
        (_, stats), grads = jax.value_and_grad(self._loss, has_aux=True)(params, frozen, batch, scalars)
        return grads, stats

    def _apply_impl(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any, jax.Array, jax.Array]:
        """One optimizer update, or none when a gradient is not finite: an inf or NaN would reach
        every parameter through Adam's moments and never leave. Skipped, the parameters and the
        optimizer state (its step count, so the learning-rate schedule too) stay as they were."""
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        grads = cast_floats(grads, jnp.float32)  # a no-op for float32 weights: clip, norm and Adam in float32

        def update() -> tuple[Any, Any]:
            updates, new_state = self.optimizer.update(grads, opt_state, params)
            # p + u in float32, rounded once to the weights' dtype (optax.apply_updates casts back).
            return optax.apply_updates(params, updates), new_state

        new_params, new_state = jax.lax.cond(finite, update, lambda: (params, opt_state))
        return new_params, new_state, optax.tree.norm(grads), finite

    # ---------------------------------------------------------------------------------- host

    def step(self, micros: list[MicroBatch], version: int, num_pairs: int = 0, updates: int = 1) -> dict[str, float]:
        """``updates`` optimizer updates from the micro-batches of one batch (weights already set),
        each from the gradient at the parameters the last one left (PPO's epochs); an update whose
        gradient is not finite changes nothing (``nonfinite_grads`` 1 in the returned stats when the
        first was not, ``nonfinite_updates`` the steps with any so far). The updates are dispatched
        without a host round trip between them. The stats are the first pass's: the batch as it came."""
        if not micros:
            raise ValueError("no micro-batches to train on")
        scalars = {"version": host_scalar(version, np.int32), "num_pairs": host_scalar(max(num_pairs, 1), np.float32)}
        device_stats, grad_norm, first = self._update(micros, scalars)
        finite = first
        for _ in range(updates - 1):
            finite = finite & self._update(micros, scalars)[2]
        applied = bool(first)
        total: dict[str, float] = {}
        for stats in jax.device_get(device_stats):
            total = algorithms.combine_stats(total, {k: float(v) for k, v in stats.items()})
        total["grad_norm"] = float(grad_norm)
        if not bool(finite):
            self.nonfinite_updates += 1
        total["nonfinite_grads"] = 0.0 if applied else 1.0
        total["nonfinite_updates"] = float(self.nonfinite_updates)
        if self.schedule is not None and applied:  # the rate the last update applied used
            total["learning_rate"] = float(self.schedule(updates_applied(self.opt_state) - 1))
        return total

    def _update(self, micros: list[MicroBatch], scalars: dict[str, Any]) -> tuple[list[Any], jax.Array, jax.Array]:
        """One optimizer update from the gradient summed over ``micros``: each micro-batch's device
        stats, the gradient's norm and whether it was finite (if not, nothing changed)."""
        grads = None
        device_stats = []
        for index, micro in enumerate(micros):
            scalars["micro"] = host_scalar(index, np.int32)
            g, stats = self._grad(self.params, self.frozen, batch_to_device(micro, self.mesh), scalars)
            grads = g if grads is None else self._accumulate(grads, g)
            device_stats.append(stats)
        self.params, self.opt_state, grad_norm, finite = self._apply(self.params, self.opt_state, grads)
        return device_stats, grad_norm, finite

    def evaluate(self, micros: list[MicroBatch], version: int) -> dict[str, float]:
        """The loss's summed stats over micro-batches (weights already set), without an update:
        a held-out split's loss."""
        scalars = {"version": host_scalar(version, np.int32), "num_pairs": host_scalar(1.0, np.float32), "micro": host_scalar(0, np.int32)}
        device_stats = [
            self._evaluate(self.params, self.frozen, batch_to_device(micro, self.mesh), scalars) for micro in micros
        ]
        total: dict[str, float] = {}
        for stats in jax.device_get(device_stats):
            total = algorithms.combine_stats(total, {k: float(v) for k, v in stats.items()})
        return total

    def memory_analysis(self, rows: int, length: int) -> Any:
        """XLA's compiled memory analysis of ``grad`` on one [rows, length] micro-batch (its
        ``temp_size_in_bytes`` is the activations and workspace of a step). Compiles, runs nothing:
        with an abstract model, at any size on the CPU."""
        grad, args = self.programs(rows, length)["grad"]
        return grad.lower(*args).compile().memory_analysis()

    def programs(self, rows: int, length: int) -> dict[str, tuple[Any, tuple[Any, ...]]]:
        """``grad`` (one [rows, length] micro-batch), ``apply`` and ``accumulate``, each with abstract
        arguments to ``lower(*args).compile()`` ahead of time (stoker plan, memory_analysis)."""
        batch = abstract_batch(rows, length)
        scalars = {
            "version": jax.ShapeDtypeStruct((), jnp.int32), "num_pairs": jax.ShapeDtypeStruct((), jnp.float32),
            "micro": jax.ShapeDtypeStruct((), jnp.int32),
        }
        params = jax.eval_shape(lambda: self.params)
        frozen = jax.eval_shape(lambda: self.frozen)
        opt_state = jax.eval_shape(lambda: self.opt_state)
        return {
            "grad": (self._grad, (params, frozen, batch, scalars)),
            "apply": (self._apply, (params, opt_state, params)),
            "accumulate": (self._accumulate, (params, params)),
        }

    def compiled_programs(self) -> dict[str, int]:
        """How many programs each step function holds (one per distinct input shape)."""
        return {
            name: int(getattr(fn, "_cache_size")())  # noqa: B009 - private jit API, untyped
            for name, fn in (("grad", self._grad), ("apply", self._apply), ("accumulate", self._accumulate))
        }

    def policy_model(self, params: Any = None) -> Transformer:
        """The policy as an nnx module over ``params`` (a ``policy_copy``), or over the current
        device arrays: those are valid only until the next ``step``, which donates them."""
        if params is not None:
            state = params
        elif self._merge is not None:
            state = self._merge(self.base, self.params["lora"])
        else:
            state = cast_floats(self.params["policy"], self.compute_dtype)
        model: Transformer = nnx.merge(self.policy_def, state)
        return model

    def policy_copy(self) -> Any:
        """The policy's parameters in the compute dtype, in buffers the next ``step`` leaves alone
        (for another thread to read while training goes on). Dispatched, not waited for. With LoRA,
        the merged ``W + scale * A B`` (in the base's sharding)."""
        if self._merge is not None:
            return self._merge(self.base, self.params["lora"])

        assert self._copy is not None
        return self._copy(self.params["policy"])
