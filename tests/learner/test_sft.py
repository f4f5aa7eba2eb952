"""SFT: the masked cross-entropy against its equation, conversations rendered with a chat
template (loss on the assistant's tokens only), and a tiny model whose held-out loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stoker.learner.algorithms import sft_loss
from stoker.learner.batches import DatasetError
from stoker.learner.loop import Learner
from stoker.learner.packing import pack
from stoker.learner.settings import LearnerSettings
from stoker.learner.sft import load_sft_data, read_conversations, render_conversation, split_held_out
from stoker.conversation.tokenization import text_interface
from stoker.learner.train import assign_weights
from stoker.spec import RLJobSpec, TransformerConfig

pytestmark = pytest.mark.usefixtures("xla_cache")

# ChatML as its published turn format describes it (written here, not copied).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY = TransformerConfig(
    vocab_size=264, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=128
)


def tokenizer_dir(path: Path, template: str | None = CHATML) -> Path:
    """A byte-level tokenizer.json with ChatML's specials and a tokenizer_config.json holding the template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def job(tmp_path: Path, dataset: Path, **sft: object) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"tokenizer": str(tokenizer_dir(tmp_path / "tok")), "architecture": TINY.model_dump(by_alias=True)},
        "environment": {"name": "answers"},
        "algorithm": {"name": "sft", "learningRate": 0.01, "sft": {"dataset": str(dataset), **sft}},
        "learner": {"sequenceBuckets": [64], "batchGroups": 4, "microbatchTokens": 256},
    })


def write_jsonl(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def chat(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Add."}, {"role": "user", "content": question},
            {"role": "assistant", "content": answer}]


# ------------------------------------------------------------------------------ the equation


def masked_cross_entropy(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """-(1/sum m) sum_t m_t log softmax(z_t)[y_t], in float64 from the logits."""
    z = logits.astype(np.float64)
    log_softmax = z - z.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    return float(-(mask * picked).sum() / mask.sum())


@pytest.mark.parametrize("jit", [False, True])
def test_sft_loss_is_the_masked_cross_entropy_and_its_gradient(jit: bool) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(3, 7)).astype(np.int32)
    mask = (rng.random((3, 7)) < 0.6).astype(np.float32)
    weights = mask / mask.sum()

    def loss_of(z: jax.Array) -> jax.Array:
        logp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(targets)[..., None], -1)[..., 0]
        return sft_loss(logp, jnp.asarray(weights))[0]

    fn = jax.jit(jax.value_and_grad(loss_of)) if jit else jax.value_and_grad(loss_of)
    value, grad = fn(jnp.asarray(logits))
    assert float(value) == pytest.approx(masked_cross_entropy(logits, targets, mask), rel=1e-5)
    # d/dz of -w log softmax(z)[y] = w (softmax(z) - onehot(y)); nothing off the mask.
    softmax = np.exp(logits - logits.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    expected = weights[..., None] * (softmax - np.eye(11)[targets])
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)
    _, stats = sft_loss(np.zeros((3, 7), np.float32) - 2.0, weights)
    assert float(stats["nll_sum"]) == pytest.approx(2.0 * mask.sum()) and float(stats["nll_tokens"]) == mask.sum()


@pytest.mark.slow
def test_trainer_sft_loss_is_the_models_masked_cross_entropy(tmp_path: Path) -> None:
    """Through packing, sharding and the train step: the reported loss is the NLL of the model's own logits."""
    data = write_jsonl(tmp_path / "d.jsonl", [chat("2+2", "4"), chat("3+5", "8"), chat("1+1", "2")])
    spec = job(tmp_path, data, evalFraction=0.0)
    learner = Learner(LearnerSettings.from_spec(spec, run_dir=tmp_path))
    sequences = [c.sequence() for c in learner.sft_data.train]
    model = learner.trainer.policy_model()
    micros = pack([[s] for s in sequences], learner.settings.buckets, learner.rows)
    assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
    logits_all, targets_all, mask_all = [], [], []
    for micro in micros:
        a = micro.arrays
        logits = model(jnp.asarray(a["tokens"]), jnp.asarray(a["positions"]), jnp.asarray(a["segment_ids"]))
        logits_all.append(np.asarray(logits))
        targets_all.append(a["targets"])
        mask_all.append(a["mask"])
    expected = masked_cross_entropy(np.concatenate(logits_all), np.concatenate(targets_all), np.concatenate(mask_all))
    evaluated = learner.evaluate_sequences(sequences)
    assert evaluated["eval_loss"] == pytest.approx(expected, rel=1e-4)
    assert evaluated["eval_tokens"] == sum(int(s.loss_mask[1:].sum()) for s in sequences)
    metrics = learner.train_on_sequences(sequences)  # the loss of the update is the same number, before it
    assert metrics["loss"] == pytest.approx(expected, rel=1e-4) and metrics["nll"] == pytest.approx(expected, rel=1e-4)


# ----------------------------------------------------------------------------- rendering


def test_chat_template_trains_the_assistant_turns_only(tmp_path: Path) -> None:
    spec = job(tmp_path, tmp_path / "unused.jsonl")
    interface = text_interface(spec)
    messages = [*chat("2+2", "4"), {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    conversation = render_conversation(interface, messages)
    ids, mask = conversation.token_ids, conversation.loss_mask
    assert interface.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
    )
    trained = interface.tokenizer.decode(ids[mask > 0].tolist(), skip_special_tokens=False)
    # Each answer, its end-of-turn token and the newline the template closes the turn with.
    assert trained == "4<|im_end|>\n6<|im_end|>\n"
    everything = render_conversation(interface, messages, "all")
    assert everything.loss_mask.all() and np.array_equal(everything.token_ids, ids)


def test_without_a_template_the_actors_layout(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate({"environment": {"name": "answers"}, "model": {"architecture": {"vocabSize": 264}}})
    interface = text_interface(spec)  # the built-in byte tokenizer: <bos>, the prompt marker <act>, <eot>
    conversation = render_conversation(interface, chat("2+2", "4"))
    ids, mask = conversation.token_ids.tolist(), conversation.loss_mask.tolist()
    expected = [*interface.bos_ids, *interface.encode("Add."), *interface.encode("2+2"), *interface.prompt_ids,
                *interface.encode("4"), interface.stop_token_ids[0]]
    assert ids == expected
    assert mask == [0] * (len(expected) - 2) + [1, 1]


def test_bad_lines_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    for text, message in [
        ('{"messages": []}\n', r"bad.jsonl:1: expected an object with a non-empty messages list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"bad.jsonl:1: no assistant message"),
        ('\n{"messages": [{"role": "robot", "content": "hi"}]}\n', r"bad.jsonl:2: messages\[0\] must be"),
        ("not json\n", r"bad.jsonl:1: not JSON"),
    ]:
        bad.write_text(text)
        with pytest.raises(DatasetError, match=message):
            read_conversations(bad)
    with pytest.raises(DatasetError, match="cannot read"):
        read_conversations(tmp_path / "missing.jsonl")


def test_held_out_split(tmp_path: Path) -> None:
    held = split_held_out(40, 0.1, seed=3)
    assert held.sum() == 4 and np.array_equal(held, split_held_out(40, 0.1, seed=3))
    assert split_held_out(3, 0.01, seed=0).sum() == 1 and split_held_out(5, 0.0, seed=0).sum() == 0
    data_path = write_jsonl(tmp_path / "d.jsonl", [chat(f"{i}+1", str(i + 1)) for i in range(8)])
    interface = text_interface(job(tmp_path, data_path))
    data = load_sft_data(interface, str(data_path), eval_fraction=0.25, seed=1)
    assert len(data.train) == 6 and len(data.eval) == 2
    other = load_sft_data(interface, str(data_path), eval_dataset=str(data_path))
    assert len(other.train) == 8 and len(other.eval) == 8


# --------------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_sft_loss_falls_on_a_tiny_dataset(tmp_path: Path) -> None:
    """A tiny model learns one-digit sums: its held-out loss falls well below where it started."""
    sums = [chat(f"{a}+{b}", str(a + b)) for a in range(5) for b in range(5)]
    data = write_jsonl(tmp_path / "sums.jsonl", sums)
    spec = job(tmp_path, data, evalFraction=0.2, evalIntervalSteps=10)
    learner = Learner(LearnerSettings.from_spec(spec, run_dir=tmp_path))
    held_out = [c.sequence() for c in learner.sft_data.eval]
    before = learner.evaluate_sequences(held_out)["eval_loss"]

    class Sink:
        records: list[dict[str, float]] = []

        def record(self, metrics: dict[str, float]) -> None:
            self.records.append(dict(metrics))

    sink = Sink()
    assert learner.run(None, max_steps=60, sink=sink) == 60
    evals = [r["eval_loss"] for r in sink.records if "eval_loss" in r]
    assert len(evals) == 6  # every 10 updates, the last one included
    assert evals[-1] < 0.5 * before, (before, evals)
    assert sink.records[-1]["loss"] < 0.5 * sink.records[0]["loss"]
