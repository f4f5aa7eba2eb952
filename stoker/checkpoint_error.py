"""The one error every checkpoint reader raises (``stoker.hfconfig``, ``stoker.hf_experts``,
``stoker.checkpoint_files``, ``stoker.model.hf``): its own module so each can import it."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into (or does not match) the model."""
