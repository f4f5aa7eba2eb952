"""The policy in a learner's Orbax checkpoints (``stoker.learner.checkpoint``), for ``stoker export``.

What a cluster learner leaves behind is its checkpoint directory (``learner.checkpoint.dir``, on
its run volume or ``gs://``), not a run's published ``weights/``: it serves weights over gRPC.
Each checkpoint's metadata holds the job's spec and the model's architecture, so the directory
alone says which model it is.
The newest step's ``params`` item is read with Orbax onto the host (one CPU device, whatever mesh
wrote it) and laid into the model the spec describes: full fine-tuning stores the policy itself
(``policy.<module path>``); LoRA stores the adapters only (``lora.<module path>.a|b``), merged
here into the frozen base the learner started from (``model.checkpoint``, or the seed's random
init) as the learner merges them for its samplers, and written as a PEFT directory too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from pydantic import ValidationError

from stoker.hfconfig import read_config
from stoker.learner import lora
from stoker.learner.checkpoint import flatten
from stoker.model.hf import dtype_from_name, load_checkpoint
from stoker.model.model import Transformer, init_model
from stoker.spec import RLJobSpec, TransformerConfig

PARAMS_ITEM = "params"


class CheckpointExportError(Exception):
    """The checkpoint directory cannot be exported (said in user terms)."""


@dataclass
class CheckpointPolicy:
    model: Any  # a Transformer with the checkpoint's weights (LoRA: merged)
    spec: RLJobSpec
    version: int
    step: int
    adapters: dict[str, dict[str, np.ndarray]] | None  # LoRA: {module path: {"a", "b"}}


def is_checkpoint_dir(path: Path) -> bool:
    """An Orbax CheckpointManager directory of the learner: numbered steps holding a params item."""
    return path.is_dir() and any(c.name.isdigit() and (c / PARAMS_ITEM).is_dir() for c in path.iterdir())


def read_checkpoint(directory: Path, spec: RLJobSpec | None = None) -> CheckpointPolicy:
    """The newest checkpoint of ``directory`` as a model; ``spec`` (a manifest's) overrides the
    one the checkpoint recorded (needed for checkpoints written before it was recorded)."""
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    if step is None:
        raise CheckpointExportError(f"{directory}: no complete checkpoint")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    manager.close()
    if spec is None:
        if "spec" not in meta:
            raise CheckpointExportError(
                f"{directory}: checkpoint {step} does not record its job; pass the job's manifest with --manifest"
            )
        try:
            spec = RLJobSpec.model_validate(meta["spec"])
        except ValidationError as err:
            raise CheckpointExportError(f"{directory}: checkpoint {step}'s recorded spec is invalid ({err})") from None
    checkpointer = ocp.StandardCheckpointer()
    path = directory.absolute() / str(step) / PARAMS_ITEM
    stored = checkpointer.metadata(path)
    stored = getattr(stored, "item_metadata", stored)
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = {name: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host) for name, m in stored.items()}
    flat = {name: np.asarray(a) for name, a in checkpointer.restore(path, abstract).items()}
    checkpointer.close()
    architecture = TransformerConfig.model_validate(meta["architecture"]) if "architecture" in meta else None
    model, adapters = _policy(spec, architecture, flat, directory, step)
    return CheckpointPolicy(model, spec, int(meta["version"]), int(step), adapters)


def _policy(
    spec: RLJobSpec, architecture: Any, flat: dict[str, np.ndarray], directory: Path, step: int
) -> tuple[Any, Any]:
    """``architecture``: the learner's model config as recorded (that of ``model.checkpoint`` when
    it started from one), so a full fine-tune exports without the base checkpoint at hand."""
    dtype = dtype_from_name(spec.model.dtype)
    where = f"{directory} checkpoint {step}"
    if spec.model.lora is None:
        config, base_dir = architecture, spec.model.checkpoint
        if config is None and not base_dir:
            config = spec.model.architecture
        elif config is None and base_dir and Path(base_dir).is_dir():
            config = read_config(base_dir)
        if config is None:  # the architecture is the base checkpoint's; it must be readable here
            raise CheckpointExportError(f"{where}: model.checkpoint {spec.model.checkpoint} is not a directory here")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype)))
        names, treedef = flatten({"policy": state})
        _check(names, flat, where, "policy.")
        leaves = [jnp.asarray(flat[name]).astype(names[name].dtype) for name in names]
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)["policy"]), None
    if spec.model.checkpoint:  # the learner's frozen base: the very weights it started from
        if not Path(spec.model.checkpoint).is_dir():
            raise CheckpointExportError(f"{where}: LoRA base model.checkpoint {spec.model.checkpoint} is not a directory here")
        base = load_checkpoint(spec.model.checkpoint, dtype=dtype)
    else:
        base = init_model(spec.model.architecture, spec.seed, dtype)
    config = lora.LoraConfig(
        spec.model.lora.rank, spec.model.lora.alpha, tuple(spec.model.lora.targets), spec.model.lora.dropout, seed=spec.seed
    )
    lora.check_lora_targets(base.config, config)
    graphdef, state = nnx.split(base)
    expected = lora.init_adapters(jax.eval_shape(lambda: state), base.config.num_layers, config)
    names, _ = flatten({"lora": expected})
    _check(names, flat, where, "lora.")
    adapters = {path: {part: flat[f"lora.{path}.{part}"] for part in ("a", "b")} for path in expected}
    merged = lora.merged_state(state, {p: {k: jnp.asarray(v) for k, v in a.items()} for p, a in adapters.items()}, config)
    return nnx.merge(graphdef, merged), adapters


def _check(names: dict[str, Any], flat: dict[str, np.ndarray], where: str, prefix: str) -> None:
    stored = {k for k in flat if k.startswith(prefix)}
    missing, extra = sorted(set(names) - stored), sorted(stored - set(names))
    if missing or extra:
        raise CheckpointExportError(
            f"{where} does not match the job's model: missing {missing[:3]}, extra {extra[:3]} (pass the job's --manifest?)"
        )
    for name, like in names.items():
        if tuple(like.shape) != tuple(flat[name].shape):
            raise CheckpointExportError(f"{where}: {name} has shape {flat[name].shape}; the job's model expects {like.shape}")
