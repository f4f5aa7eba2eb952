"""``stoker export`` of what a cluster learner leaves behind: its Orbax checkpoint directory (no
``runs.jsonl``, no published ``weights/``), written here by the real learner code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stoker.cli import main as stoker_main
from stoker.learner.checkpoint import Checkpointer
from stoker.learner.loop import Learner
from stoker.learner.peft import ADAPTER_DIR, merge_into, read_adapter
from stoker.learner.settings import LearnerSettings
from stoker.model.hf import load_checkpoint, save_checkpoint
from stoker.model.model import init_model
from stoker.weights.channel import flatten_params
from stoker.spec import RLJobSpec, TransformerConfig

pytestmark = pytest.mark.usefixtures("xla_cache")


ARCHITECTURE = TransformerConfig(vocab_size=264, hidden_size=32, num_layers=1, max_seq_len=32)


def sft_job(tmp_path: Path, lora: bool) -> RLJobSpec:
    """Full fine-tuning from a base checkpoint; LoRA on a random init (the seed's)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="},
                                                     {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(6)))
    model: dict[str, object] = {"architecture": ARCHITECTURE.model_dump(by_alias=True)}
    if lora:
        model["lora"] = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "up_proj"]}
    else:
        model = {"checkpoint": str(save_checkpoint(init_model(ARCHITECTURE, seed=3), tmp_path / "base")),
                 "tokenizer": "builtin"}
    return RLJobSpec.model_validate({
        "seed": 3, "model": model, "environment": {"name": "answers"},
        "algorithm": {"name": "sft", "learningRate": 0.05, "sft": {"dataset": str(data), "evalFraction": 0}},
        "learner": {"sequenceBuckets": [32], "batchGroups": 6},
    })


class Sink:
    def record(self, metrics: dict[str, float]) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_learners_checkpoint_directory_exports_its_policy(tmp_path: Path, lora: bool) -> None:
    """The learner trains 3 steps and checkpoints into RUN_DIR/checkpoints, as on a cluster; the
    export of RUN_DIR is exactly the policy the learner would publish (LoRA: merged), and with
    LoRA also the checkpoint's adapters as a PEFT directory that merges into the base to it. A full
    fine-tune exports without its base checkpoint at hand (the checkpoint records the architecture),
    as on a workstation that copied only the checkpoint directory."""
    spec = sft_job(tmp_path, lora)
    run = tmp_path / "run"
    learner = Learner(LearnerSettings.from_spec(spec, run_dir=run))
    try:
        assert learner.run(None, None, max_steps=3, sink=Sink()) == 3
        learner.save(wait=True)
        published = {k: np.asarray(v) for k, v in flatten_params(learner.trainer.policy_model()).items()}
        adapters = None if not lora else {p: {k: np.asarray(v) for k, v in a.items()}
                                          for p, a in learner.trainer.params["lora"].items()}
    finally:
        learner.close()
    assert sorted(p.name for p in run.iterdir()) == (["adapter", "checkpoints"] if lora else ["checkpoints"])
    initial = flatten_params(init_model(spec.model.architecture, spec.seed))
    assert any(not np.array_equal(published[k], np.asarray(initial[k])) for k in published)  # it trained

    if not lora:
        (tmp_path / "base").rename(tmp_path / "elsewhere")
    assert stoker_main(["export", str(run), "--to", str(tmp_path / "hf")]) == 0
    exported = flatten_params(load_checkpoint(tmp_path / "hf"))
    assert sorted(exported) == sorted(published)
    for name, array in exported.items():
        np.testing.assert_array_equal(np.asarray(array), published[name], err_msg=name)
    if lora:
        assert adapters is not None
        config, tensors, version = read_adapter(tmp_path / "hf" / ADAPTER_DIR)
        assert (config["r"], config["lora_alpha"], version) == (4, 8, 3)
        assert sorted(config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
        for path, pair in adapters.items():
            np.testing.assert_array_equal(tensors[f"base_model.model.model.{path}.lora_A.weight"], pair["a"].T)
            np.testing.assert_array_equal(tensors[f"base_model.model.model.{path}.lora_B.weight"], pair["b"].T)
        merged = merge_into({k: np.asarray(v) for k, v in initial.items()}, tmp_path / "hf" / ADAPTER_DIR)
        for name, array in exported.items():
            np.testing.assert_allclose(np.asarray(array), merged[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_checkpoint_without_its_spec_needs_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints written before the spec was recorded: one line asking for --manifest, which then
    exports them (the checkpoint directory itself given, not its run directory)."""
    spec = RLJobSpec.model_validate({"model": {"architecture": {
        "vocabSize": 40, "hiddenSize": 16, "numLayers": 1, "numHeads": 2, "numKvHeads": 1, "intermediateSize": 24}}})
    model = init_model(spec.model.architecture, seed=5)
    from flax import nnx

    from stoker.learner.trees import cast_floats as _cast
    import jax.numpy as jnp

    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(7, {"policy": _cast(nnx.state(model), jnp.float32)}, {"count": jnp.zeros(())}, version=6,
              rng=np.zeros(2, np.uint32))
    ckpt.close()
    assert stoker_main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint 7 does not record its job; pass the job's manifest with --manifest" in err
    assert len(err.strip().splitlines()) == 1
    manifest = tmp_path / "job.yaml"
    manifest.write_text(json.dumps({"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
                                    "spec": spec.model_dump(by_alias=True, mode="json")}))
    assert stoker_main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "b"), "--manifest", str(manifest)]) == 0
    exported = flatten_params(load_checkpoint(tmp_path / "b"))
    for name, array in flatten_params(model).items():
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(array), err_msg=name)
