"""Orbax checkpoints of the learner: parameters, optimizer state, policy version and RNG.

Every pytree (the nnx parameter states, optax's state) is saved as a flat ``{name: array}`` dict
named by its key path, and restored by unflattening into the live trainer's own tree structure
with the live shardings. So a checkpoint restores onto any mesh, and a change to the model or
optimizer shows up as a clear missing/extra-name error instead of silently misplaced arrays.

Saves are asynchronous (Orbax writes in the background while training continues); a save is
committed atomically, so a learner killed mid-write resumes from the previous complete one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
    """The checkpoint's arrays do not match this learner's model or optimizer."""


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """``{dotted key path: leaf}`` and the treedef to rebuild ``tree``."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {".".join(_key_name(e) for e in path): leaf for path, leaf in with_path}
    if len(flat) != len(with_path):
        raise ValueError("two leaves share a key path name")
    return flat, treedef


@dataclass
class Restored:
    params: Any
    opt_state: Any
    version: int
    step: int
    rng: np.ndarray


class Checkpointer:
    """Wraps ``orbax.checkpoint.CheckpointManager``; checkpoints are numbered by train step."""

    def __init__(self, directory: str | Path, *, keep: int = 3):
        path = directory if isinstance(directory, str) and "://" in directory else Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            path,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True),
        )

    def latest_step(self) -> int | None:
        step = self.manager.latest_step()
        return None if step is None else int(step)

    def save(
        self, step: int, params: Any, opt_state: Any, *, version: int, rng: np.ndarray, job: dict[str, Any] | None = None
    ) -> None:
        """``job``: JSON kept beside (the RLJob spec, the model's architecture) so the checkpoint
        alone can be exported (``stoker.learner.checkpoint_export``); restoring ignores it."""
        flat_params, _ = flatten(params)
        flat_opt, _ = flatten(opt_state)
        meta: dict[str, Any] = {"version": int(version), "step": int(step), "rng": [int(x) for x in np.asarray(rng).ravel()]}
        meta.update(job or {})
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(flat_params),
                opt_state=ocp.args.StandardSave(flat_opt),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def restore(self, params_like: Any, opt_like: Any, step: int | None = None) -> Restored | None:
        """The latest (or ``step``) checkpoint laid out like the live ``params_like``/``opt_like``
        trees (same structure, shapes and shardings); None when there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        flat_params, params_def = flatten(params_like)
        flat_opt, opt_def = flatten(opt_like)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(flat_params)),
                opt_state=ocp.args.StandardRestore(_abstract(flat_opt)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        meta = restored["meta"]
        return Restored(
            params=_unflatten(params_def, flat_params, restored["params"], "parameters"),
            opt_state=_unflatten(opt_def, flat_opt, restored["opt_state"], "optimizer state"),
            version=int(meta["version"]),
            step=int(meta["step"]),
            rng=np.asarray(meta["rng"], np.uint32),
        )

    def in_progress(self) -> bool:
        """Whether a background save is still being written."""
        return bool(self.manager.is_saving_in_progress())

    def wait(self) -> None:
        """Block until background saves are durable."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _abstract(flat: dict[str, Any]) -> dict[str, Any]:
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return {k: one(v) for k, v in flat.items()}


def _unflatten(treedef: Any, like: dict[str, Any], got: dict[str, Any], what: str) -> Any:
    missing = sorted(set(like) - set(got))
    extra = sorted(set(got) - set(like))
    if missing or extra:
        raise CheckpointMismatch(f"checkpoint {what} do not match this model: missing {missing[:5]}, extra {extra[:5]}")
    for key, value in like.items():
        if np.shape(value) != np.shape(got[key]):
            raise CheckpointMismatch(
                f"checkpoint {what} {key} has shape {np.shape(got[key])}; this model expects {np.shape(value)}"
            )
    return jax.tree_util.tree_unflatten(treedef, [got[k] for k in like])
