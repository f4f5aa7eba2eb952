"""Chat templates with token-in-token-out intact: a checkpoint's own tokenizer, stop tokens and
template (Qwen-style ChatML and Llama-3-style), written here as tiny Hugging Face files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import EpisodeLimits, run_episode
from stoker.conversation.policy import Sampled
from stoker.conversation.tokenization import TextInterface, TokenizerProblem, text_interface
from stoker.model.hf import save_checkpoint
from stoker.learner.batches import _sequence
from stoker.model.model import init_model
from stoker.learner.packing import pack
from stoker.spec import RLJobSpec, TransformerConfig

# Written from the published turn formats (ChatML; Llama 3's header/eot format), not copied.
CHATML = (
    "{%- if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user turn') }}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Style:
    name: str
    specials: tuple[str, ...]
    template: str
    tokenizer_config: dict[str, object]
    generation_eos: tuple[str, ...]
    turn_end: str
    bos: str | None
    after_last_turn: str  # what the template renders after the model's last end-of-turn token


QWEN = Style(
    "qwen", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), CHATML,
    {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False}, ("<|im_end|>", "<|endoftext|>"),
    "<|im_end|>", None, "\n",
)
# Llama 3 base-style configs name only <|end_of_text|>: the turn's <|eot_id|> stop comes from the template.
LLAMA = Style(
    "llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, ("<|end_of_text|>",),
    "<|eot_id|>", "<|begin_of_text|>", "",
)


def byte_level_tokenizer(specials: Sequence[str], bos: str | None) -> Tokenizer:
    """A real byte-level BPE tokenizer.json (Qwen's and Llama 3's kind) with no merges: small.
    With ``bos``, its post-processor puts the BOS first, as Llama 3's tokenizer.json does."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    if bos is not None:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def write_checkpoint(directory: Path, style: Style, *, template: bool = True) -> RLJobSpec:
    tokenizer = byte_level_tokenizer(style.specials, style.bos)
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    config = dict(style.tokenizer_config, **({"chat_template": style.template} if template else {}))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab[t] for t in style.generation_eos]}))
    arch = TransformerConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=32, max_seq_len=512,
    )
    save_checkpoint(init_model(arch, 0), directory)
    return RLJobSpec.model_validate({
        "model": {"checkpoint": str(directory), "architecture": arch.model_dump(by_alias=True)},
        "environment": {"name": "swe"},
    })


class TalkativeEnv:
    """Observations with whitespace, markup-like text and non-ASCII, three turns."""

    texts = ("Fix the bug in  app.py\n", "ran: `pytest -q` -> 1 failed <b>é</b>", "  all green  ", "done")

    def __init__(self) -> None:
        self.turn = 0
        self.actions: list[str] = []

    async def reset(self, task_id: str, seed: int) -> Observation:
        self.turn = 0
        return Observation(self.texts[0])

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        self.turn += 1
        return StepResult(Observation(self.texts[self.turn]), 0.5, self.turn == 3, False)

    async def close(self) -> None:
        pass


class ScriptedSampler:
    """Returns fixed ids per turn, and remembers every prompt it was given."""

    def __init__(self, answers: list[list[int]]):
        self.answers = answers
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def end_session(self, session: object) -> None:
        pass

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: object = None
    ) -> Sampled:
        self.prompts.append(list(prompt))
        ids = self.answers[len(self.outputs)]
        self.outputs.append(ids)
        return Sampled(ids, [-0.5] * len(ids), True, 7)


@pytest.mark.parametrize("style", [QWEN, LLAMA], ids=lambda s: s.name)
@pytest.mark.asyncio
async def test_trained_ids_are_sampled_ids_through_the_chat_template(tmp_path: Path, style: Style) -> None:
    interface = text_interface(write_checkpoint(tmp_path, style))
    tok = interface.tokenizer
    vocab = tok.get_vocab(with_added_tokens=True)
    turn_end = vocab[style.turn_end]
    assert turn_end in interface.stop_token_ids
    assert all(vocab[t] in interface.stop_token_ids for t in style.generation_eos)
    assert interface.bos_ids == ()  # the template renders the BOS itself (or has none)
    e_acute = list("é".encode())  # two byte tokens; the first alone decodes to nothing
    answers = [
        [*interface.encode("edit app.py"), turn_end],  # a turn that ends on its end-of-turn token
        [*interface.encode("ok "), e_acute[0]],  # cut off mid-character by the token limit
        [*interface.encode("submit"), turn_end],
    ]
    sampler = ScriptedSampler(answers)
    env = TalkativeEnv()  # a template that trims contents gets "  all green  " trimmed, as it renders it
    limits = EpisodeLimits(max_turns=5, max_new_tokens=16, max_tokens=512)
    episode = await run_episode(sampler, env, interface, "t", seed=0, limits=limits)
    ids, mask = episode.token_ids.tolist(), episode.loss_mask.tolist()

    # The model saw exactly the trajectory so far before each turn, and its ids went in as sampled.
    spans, position = [], 0
    for prompt, sampled in zip(sampler.prompts, sampler.outputs, strict=True):
        assert ids[: len(prompt)] == prompt
        assert ids[len(prompt) : len(prompt) + len(sampled)] == sampled
        spans.append((len(prompt), len(prompt) + len(sampled)))
        position = len(prompt) + len(sampled)
    assert position == len(ids)
    expected_mask = [0] * len(ids)
    for start, end in spans:
        expected_mask[start:end] = [1] * (end - start)
    assert mask == expected_mask  # loss mask 1 exactly on the sampled ids

    # The context between the turns is the template's own layout: with each model turn's text as
    # the assistant message, the trajectory reads as the template renders the conversation -- the
    # cut-off turn closed by the template's end-of-turn token, which the model did not sample.
    from stoker.conversation.chat_template import render

    assert interface.chat is not None
    messages = [{"role": "user", "content": env.texts[0]}]
    for turn, sampled in enumerate(answers):
        text = tok.decode([t for t in sampled if t != turn_end], skip_special_tokens=False)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": env.texts[turn + 1]}]
    rendered = render(
        interface.chat.template, messages[:-1], bos_token=style.bos, eos_token=None, add_generation_prompt=False
    )
    as_text = tok.decode(ids, skip_special_tokens=False)
    assert rendered.startswith(as_text) and rendered[len(as_text) :] == style.after_last_turn

    # The learner trains on exactly these ids: the packed targets under weight > 0 are the sampled ids.
    (micro,) = pack([[_sequence(episode)]], (512,), {512: 1})
    trained = micro.arrays["targets"][micro.arrays["mask"] > 0].tolist()
    assert trained == [t for sampled in sampler.outputs for t in sampled]
    assert env.actions[0] == "edit app.py"
    np.testing.assert_array_equal(episode.logprobs[episode.loss_mask == 1], -0.5)


def test_a_checkpoint_without_a_tokenizer_is_a_clear_error_unless_builtin_is_asked(tmp_path: Path) -> None:
    spec = write_checkpoint(tmp_path, QWEN)  # 259 ids
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerProblem, match="spec.model.checkpoint: .*tokenizer.json.*'builtin'"):
        text_interface(spec)
    builtin = spec.model_copy(update={"model": spec.model.model_copy(update={"tokenizer": "builtin"})})
    with pytest.raises(TokenizerProblem, match="config.json vocab_size: got 259; expected >= 261"):
        text_interface(builtin)  # the byte tokenizer's 261 ids do not fit this checkpoint
    llama = tmp_path / "llama"
    llama.mkdir()
    spec = write_checkpoint(llama, LLAMA)  # 261 ids
    builtin = spec.model_copy(update={"model": spec.model.model_copy(update={"tokenizer": "builtin"})})
    interface = text_interface(builtin)
    assert interface.chat is None and interface.vocab_size == 261  # the byte tokenizer, as asked


def test_without_a_template_the_bos_rule_comes_from_the_tokenizer_files(tmp_path: Path) -> None:
    """Llama 3: no add_bos_token in tokenizer_config.json, the tokenizer.json post-processor adds
    it; Qwen: add_bos_token false."""
    llama, qwen = tmp_path / "llama", tmp_path / "qwen"
    llama.mkdir(), qwen.mkdir()
    with_bos = text_interface(write_checkpoint(llama, LLAMA, template=False))
    vocab = with_bos.tokenizer.get_vocab(with_added_tokens=True)
    assert with_bos.chat is None and with_bos.bos_ids == (vocab["<|begin_of_text|>"],)
    assert with_bos.first_turn_ids("hi")[:1] == [vocab["<|begin_of_text|>"]]
    assert text_interface(write_checkpoint(qwen, QWEN, template=False)).bos_ids == ()


def test_the_system_prompt_and_a_template_that_raises(tmp_path: Path) -> None:
    spec = write_checkpoint(tmp_path, QWEN)
    with_system = spec.model_copy(update={"model": spec.model.model_copy(update={"system_prompt": "Be terse."})})
    interface = text_interface(with_system)
    opening = interface.tokenizer.decode(interface.first_turn_ids("go"), skip_special_tokens=False)
    assert opening == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHATML)
    model = with_system.model.model_copy(update={"chat_template": str(strict)})
    with pytest.raises(TokenizerProblem, match="chat template.*raised: no system role"):
        text_interface(with_system.model_copy(update={"model": model}))


# ------------------------------------------------ later turns, against transformers' own rendering

# Written from the published turn formats (not copied): Llama 3.1 trims user contents and renders
# tool results in an ipython turn as JSON; Qwen 2.5 wraps them in <tool_response> inside a user
# turn; Gemma 3 trims, names the assistant "model", and refuses roles that do not alternate.
LLAMA31 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] in ['ipython', 'tool'] %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is mapping or message['content'] is iterable %}{{- message['content'] | tojson }}"
    "{%- else %}{{- message['content'] }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN25 = (
    "{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GEMMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
REFEREE_STYLES = {
    "llama3.1": (LLAMA, LLAMA31),
    "qwen2.5": (QWEN, QWEN25),
    "gemma3": (Style("gemma3", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), GEMMA3,
                     {"bos_token": "<bos>", "eos_token": "<eos>"}, ("<eos>", "<end_of_turn>"), "<end_of_turn>",
                     "<bos>", "\n"), GEMMA3),
}


class UntrimmedEnv(TalkativeEnv):
    texts = ("Fix the bug in  app.py\n", "  ran: `pytest -q`\n -> 1 \"failed\" <b>é</b>  ", "\n all green \t", "done")


@pytest.mark.parametrize(
    ("name", "role", "used"),
    [("llama3.1", "user", "user"), ("llama3.1", "ipython", "ipython"), ("qwen2.5", "tool", "tool"),
     ("qwen2.5", "user", "user"), ("gemma3", "user", "user"), ("gemma3", "tool", "user")],
)
@pytest.mark.asyncio
async def test_every_turn_is_what_transformers_apply_chat_template_renders(
    tmp_path: Path, name: str, role: str, used: str, caplog: pytest.LogCaptureFixture
) -> None:
    import transformers

    style, template = REFEREE_STYLES[name]
    style = Style(style.name, style.specials, template, dict(style.tokenizer_config), style.generation_eos,
                  style.turn_end, style.bos, style.after_last_turn)
    spec = write_checkpoint(tmp_path, style)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    env_spec = spec.environment.model_copy(update={"observation_role": role})
    interface = text_interface(spec.model_copy(update={"environment": env_spec}))
    assert interface.chat is not None and interface.chat.observation_role == used
    if used != role:
        assert f"observationRole: the chat template has no {role!r} role; observations go in user turns" in caplog.text
    turn_end = interface.tokenizer.token_to_id(style.turn_end)
    texts = ["edit app.py", "run the \"tests\"", "submit"]
    sampler = ScriptedSampler([[*interface.encode(t), turn_end] for t in texts])
    env = UntrimmedEnv()
    episode = await run_episode(sampler, env, interface, "t", seed=0, limits=EpisodeLimits(5, 16, 1024))

    referee = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": env.texts[0]}]
    for turn, prompt in enumerate(sampler.prompts):
        rendered = referee.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert interface.tokenizer.decode(prompt, skip_special_tokens=False) == rendered, f"turn {turn}"
        assert prompt == referee(rendered, add_special_tokens=False)["input_ids"], f"turn {turn}"
        messages += [{"role": "assistant", "content": texts[turn]}, {"role": used, "content": env.texts[turn + 1]}]
    assert episode.token_ids.tolist()[: len(sampler.prompts[-1])] == sampler.prompts[-1]


def test_a_template_that_rewrites_observations_is_refused(tmp_path: Path) -> None:
    upper = CHATML.replace("message['content'] + '<|im_end|>", "message['content'] | upper + '<|im_end|>")
    spec = write_checkpoint(tmp_path, Style(QWEN.name, QWEN.specials, upper, dict(QWEN.tokenizer_config),
                                            QWEN.generation_eos, QWEN.turn_end, None, "\n"))
    with pytest.raises(TokenizerProblem, match="other than verbatim, trimmed or JSON-quoted"):
        text_interface(spec)
