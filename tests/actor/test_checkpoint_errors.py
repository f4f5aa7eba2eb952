"""A checkpoint the model cannot load gives the actor the learner's clean error, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.actor.settings import ActorSettings
from stoker.actor.wiring import ActorSetupError, make_sampler
from stoker.model.hf import CheckpointError, WEIGHTS_FILE, decode_safetensors, encode_safetensors, save_checkpoint
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.model.model import init_model
from stoker.spec import RLJobSpec, TransformerConfig

TINY = TransformerConfig(
    vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_seq_len=64
)
DROPPED = "model.layers.0.mlp.down_proj.weight"


def test_a_missing_tensor_is_the_same_clean_error_in_actor_and_learner(tmp_path: Path) -> None:
    save_checkpoint(init_model(TINY, 0), tmp_path)
    weights = decode_safetensors((tmp_path / WEIGHTS_FILE).read_bytes())
    del weights[DROPPED]
    (tmp_path / WEIGHTS_FILE).write_bytes(encode_safetensors(weights))
    spec = RLJobSpec.model_validate({
        "model": {"checkpoint": str(tmp_path), "architecture": TINY.model_dump(by_alias=True)},
        "environment": {"sandbox": {"kind": "inline"}},
        "learner": {"sequenceBuckets": [16]},
    })
    with pytest.raises(CheckpointError) as learner_error:
        Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))
    with pytest.raises(ActorSetupError) as actor_error:
        make_sampler(ActorSettings.from_spec(spec, actor_id="a0"))
    assert DROPPED in str(learner_error.value)
    assert str(actor_error.value) == f"spec.model.checkpoint: {learner_error.value}"
