"""Small jobs for tests and benchmarks: ``tiny_spec``.

The spec is the learner's one source of settings (``stoker.learner.settings``), so a test that
wants, say, two buckets and a higher learning rate writes them into a job, as a manifest would::

    spec = tiny_spec(learner={"sequenceBuckets": [8, 16]}, algorithm={"learningRate": 0.05})
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from stoker.spec import RLJobSpec, TransformerConfig

# A policy that compiles in seconds on a CPU: one layer, vocabulary 8.
TINY_ARCHITECTURE = TransformerConfig(
    vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_seq_len=64
)
# Buckets that fit TINY_ARCHITECTURE's maxSeqLen (the spec's default ones do not).
_BASE: dict[str, Any] = {"model": {"architecture": TINY_ARCHITECTURE}, "learner": {"sequenceBuckets": [8, 16]}}


def tiny_spec(*layers: Mapping[str, Any], **sections: Any) -> RLJobSpec:
    """A job of ``TINY_ARCHITECTURE`` with ``layers``, then ``sections``, merged over it.

    Each layer is shaped like a manifest's ``spec`` (camelCase keys); ``sections`` are one more
    layer, by section (``learner={...}``). Mappings merge key by key, anything else replaces, and
    a pydantic value (a ``TransformerConfig``) stands for its whole manifest form. Every field is
    validated, but not the cross-field rules (``stoker.spec.cross_field_problems``): a test may
    hand the learner a combination it must refuse itself."""
    merged: dict[str, Any] = _manifest(_BASE)
    for layer in (*layers, sections):
        merged = _merged(merged, _manifest(layer))
    return RLJobSpec.model_validate(merged)


def _manifest(value: Any) -> Any:
    """``value`` with every pydantic model in it written out as a manifest would hold it."""
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, mode="json")
    if isinstance(value, Mapping):
        return {key: _manifest(item) for key, item in value.items()}
    return value


def _merged(base: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out
