"""LoRA: the forward is base + (alpha/r) B A x, gradients and optimizer state are the adapters'
only, the base never moves, samplers get merged weights, and the PEFT adapter directory merges
(as PEFT merges it) into the weights the samplers got."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stoker.learner import sharding, step, train
from stoker.learner.lora import LoraConfig, LoraLinear, init_adapters
from stoker.learner.packing import TrainSequence, pack, rows_for_buckets
from stoker.learner.peft import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, merge_into, read_adapter, write_adapter
from stoker.model.model import init_model
from stoker.weights.channel import flatten_params
from stoker.spec import RLJobSpec, TransformerConfig

pytestmark = pytest.mark.usefixtures("xla_cache")

TINY = TransformerConfig(
    vocab_size=8, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32, max_seq_len=64
)
BUCKETS = (8, 16)


def randomise(trainer: train.Trainer, seed: int = 1) -> None:
    """Non-zero B too (a fresh adapter has B = 0, which hides half the equation)."""
    rng = np.random.default_rng(seed)
    trainer.params = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(scale=0.3, size=x.shape), x.dtype), trainer.params
    )


def micro_batches() -> list:
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 2, 3], np.int32)
    seq = TrainSequence(ids, np.ones(ids.size, np.uint8), np.zeros(ids.size, np.float32), np.full(ids.size, -1, np.int32),
                        behaviour_known=False)
    micros = pack([[seq]], BUCKETS, rows_for_buckets(BUCKETS, 64))
    train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
    return micros


def lora_trainer(**config: object) -> train.Trainer:
    options = train.StepOptions("sft", lora=LoraConfig(**{"rank": 2, "alpha": 4.0, **config}))  # type: ignore[arg-type]
    return train.Trainer(init_model(TINY, 0), options, optax.adam(0.05), sharding.make_mesh())


@pytest.mark.parametrize("jit", [False, True])
def test_lora_projection_is_base_plus_scaled_low_rank(jit: bool) -> None:
    rng = np.random.default_rng(0)
    base = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    a, b = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
    x = rng.normal(size=(2, 4, 6)).astype(np.float32)

    def forward(x: jax.Array) -> jax.Array:
        return LoraLinear(base, jnp.asarray(a), jnp.asarray(b), 0.5, 0.0, None)(x)

    got = np.asarray(jax.jit(forward)(x) if jit else forward(x))
    w = np.asarray(base.kernel[...], np.float64)
    expected = x @ w + np.asarray(base.bias[...]) + 0.5 * (x @ a) @ b  # y = W x + (alpha/r) B A x
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Dropout drops inputs of the low-rank path only, and rescales the kept ones by 1/(1-p).
    dropped = LoraLinear(base, jnp.asarray(a), jnp.zeros_like(jnp.asarray(b)), 0.5, 0.5, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(dropped(jnp.asarray(x))), x @ w + np.asarray(base.bias[...]), rtol=1e-5, atol=1e-5)


def test_trainer_forward_is_the_merged_models_and_policy_copy_is_merged() -> None:
    trainer = lora_trainer()
    randomise(trainer)
    config = trainer.options.lora
    assert config is not None
    # The merged weights, computed here from the equation: W + (alpha / r) A B on each target.
    expected = jax.tree.map(np.asarray, trainer.base)
    for path, adapter in trainer.params["lora"].items():
        _, layer, parent, name = path.split(".")
        kernel = expected["layers"][int(layer)][parent][name]["kernel"]
        kernel.set_value(np.asarray(kernel[...]) + config.scale * np.asarray(adapter["a"]) @ np.asarray(adapter["b"]))
    copy = trainer.policy_copy()
    for got, want in zip(jax.tree.leaves(copy), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert jax.tree.leaves(copy)[0].sharding == jax.tree.leaves(trainer.base)[0].sharding  # the training sharding
    # The training forward (unmerged: base(x) + scale * x A B) gives the merged model's log-probs.
    micros = micro_batches()
    batch = step.batch_to_device(micros[0], trainer.mesh)
    logp = trainer._forward_logprobs(trainer.base, batch, adapters=trainer.params["lora"])[0].logprobs
    merged = trainer._forward_logprobs(copy, batch)[0].logprobs
    np.testing.assert_allclose(np.asarray(logp), np.asarray(merged), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_gradients_and_optimizer_state_are_the_adapters_only() -> None:
    trainer = lora_trainer()
    randomise(trainer)
    assert set(trainer.params) == {"lora"}
    adapter_shapes = {tuple(x.shape) for x in jax.tree.leaves(trainer.params)}
    # Adam's state: a step count and two moments per adapter leaf, nothing base-shaped.
    state_shapes = [tuple(x.shape) for x in jax.tree.leaves(trainer.opt_state)]
    assert {s for s in state_shapes if s} == adapter_shapes
    adapter_size = sum(x.size for x in jax.tree.leaves(trainer.params))
    assert sum(x.size for x in jax.tree.leaves(trainer.opt_state)) == 2 * adapter_size + 1  # + Adam's count
    micros = micro_batches()
    batch = step.batch_to_device(micros[0], trainer.mesh)
    scalars = {"version": jnp.asarray(0), "num_pairs": jnp.asarray(1.0), "micro": jnp.asarray(0)}
    grads, _ = trainer._grad(trainer.params, trainer.frozen, batch, scalars)
    assert jax.tree.structure(grads) == jax.tree.structure(trainer.params)
    # The chain rule through W' = W + s A B: dL/dA = s dL/dW' B^T, dL/dB = s A^T dL/dW'. dL/dW' is
    # the full model's gradient at the merged weights, from a trainer that trains every weight.
    full = train.Trainer(init_model(TINY, 0), train.StepOptions("sft"), optax.adam(0.05), sharding.make_mesh())
    full.params = {"policy": jax.tree.map(lambda x: x.astype(jnp.float32), trainer.policy_copy())}
    full_grads, _ = full._grad(full.params, full.frozen, batch, scalars)
    s = trainer.options.lora.scale  # type: ignore[union-attr]
    for path, g in grads["lora"].items():
        _, layer, parent, name = path.split(".")
        dw = np.asarray(full_grads["policy"]["layers"][int(layer)][parent][name]["kernel"][...])
        a, b = (np.asarray(trainer.params["lora"][path][k]) for k in ("a", "b"))
        np.testing.assert_allclose(np.asarray(g["a"]), s * dw @ b.T, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g["b"]), s * a.T @ dw, rtol=1e-3, atol=1e-6)
    base_before = jax.tree.map(np.asarray, trainer.base)
    adapters_before = jax.tree.map(np.asarray, trainer.params)
    for version in range(3):
        stats = trainer.step(micros, version)
    assert stats["loss"] > 0
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(trainer.base), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))  # the base never moves
    moved = [not np.array_equal(x, np.asarray(y)) for x, y in zip(jax.tree.leaves(adapters_before),
                                                                   jax.tree.leaves(trainer.params), strict=True)]
    assert all(moved)


def test_peft_directory_merges_into_the_samplers_weights(tmp_path: Path) -> None:
    trainer = lora_trainer(targets=("q_proj", "v_proj", "down_proj"))
    randomise(trainer)
    config = trainer.options.lora
    assert config is not None
    write_adapter(tmp_path, jax.device_get(trainer.params["lora"]), config, base_model="/models/base", version=7)
    peft_config, tensors, version = read_adapter(tmp_path)
    assert version == 7
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 2 and peft_config["lora_alpha"] == 4.0
    assert peft_config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert peft_config["task_type"] == "CAUSAL_LM" and peft_config["base_model_name_or_path"] == "/models/base"
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (2, 16)  # [r, in]
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (16, 2)  # [out, r]
    assert len(tensors) == 2 * 3 * TINY.num_layers
    base_hf = flatten_params(nnx.merge(trainer.policy_def, trainer.base))
    merged = merge_into({k: np.asarray(v) for k, v in base_hf.items()}, tmp_path)
    published = flatten_params(trainer.policy_model(trainer.policy_copy()))
    for name, array in published.items():
        np.testing.assert_allclose(merged[name], np.asarray(array), rtol=1e-5, atol=1e-6)
    assert not np.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base_hf["model.layers.0.self_attn.q_proj.weight"])


def test_spec_lora_reaches_the_learner() -> None:
    from stoker.learner.settings import LearnerSettings

    spec = RLJobSpec.model_validate({"model": {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"], "dropout": 0.05}}})
    assert LearnerSettings.from_spec(spec).lora == LoraConfig(4, 8.0, ("q_proj",), 0.05, seed=0)
    with pytest.raises(ValueError, match="targets"):
        RLJobSpec.model_validate({"model": {"lora": {"targets": ["lm_head"]}}})
    with pytest.raises(ValueError):
        RLJobSpec.model_validate({"model": {"lora": {"targets": []}}})


@pytest.mark.slow
def test_lora_sft_run_exports_merged_weights_and_the_adapter(tmp_path: Path) -> None:
    """A LoRA SFT learner run: its loss falls, `stoker export` writes the merged weights and the
    PEFT directory, and the base plus that adapter is exactly the exported model."""
    from stoker.learner.export import export
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.model.hf import load_checkpoint
    from stoker.weights.channel import WeightPublisher

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="},
                                                     {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(6)))
    spec = RLJobSpec.model_validate({
        "model": {"architecture": {"vocabSize": 264, "hiddenSize": 32, "numLayers": 1, "maxSeqLen": 32},
                  "lora": {"rank": 4, "alpha": 8}},
        "environment": {"name": "answers"},
        "algorithm": {"name": "sft", "learningRate": 0.05, "sft": {"dataset": str(data), "evalFraction": 0}},
        "learner": {"sequenceBuckets": [32], "batchGroups": 6, "checkpoint": {"dir": "ck", "intervalSteps": 100}},
    })
    run = tmp_path / "run"
    run.mkdir()
    (run / "runs.jsonl").write_text(json.dumps({"spec": spec.model_dump(by_alias=True, mode="json")}) + "\n")
    learner = Learner(LearnerSettings.from_spec(spec, run_dir=run))
    publisher = WeightPublisher(directory=run / "weights")

    class Sink:
        records: list[dict[str, float]] = []

        def record(self, metrics: dict[str, float]) -> None:
            self.records.append(metrics)

    try:
        assert learner.run(None, publisher, max_steps=15, sink=Sink()) == 15
    finally:
        learner.close()
        publisher.close()
    # A random base's tied head keeps logits near uniform (ln 264 = 5.58), so the adapters alone
    # cannot go far below it; they still learn.
    assert Sink.records[-1]["loss"] < Sink.records[0]["loss"] - 0.3
    target, copied = export(run, tmp_path / "export")
    assert "adapter/" in copied
    assert (target / ADAPTER_DIR / CONFIG_FILE).is_file() and (target / ADAPTER_DIR / WEIGHTS_FILE).is_file()
    assert read_adapter(target / ADAPTER_DIR)[2] == 15
    base = flatten_params(init_model(spec.model.architecture, spec.seed))
    merged = merge_into({k: np.asarray(v) for k, v in base.items()}, target / ADAPTER_DIR)
    exported = flatten_params(load_checkpoint(target))
    for name, array in exported.items():
        np.testing.assert_allclose(np.asarray(array), merged[name], rtol=1e-5, atol=1e-6)
