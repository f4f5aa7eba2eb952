"""Tokenizers and the turn template the actor wraps around observations.

The conversation is token ids from start to end (strict token-in-token-out): ``<bos>`` once, then
per turn the observation's ids and the prompt marker ``<act>`` (loss mask 0), then the model's
sampled ids exactly as sampled (loss mask 1). Observations are tokenised once; sampled ids are
decoded only to give the environment its action text, never re-encoded.

With a pretrained checkpoint, everything comes from its Hugging Face files instead (or from the
directory ``spec.model.tokenizer`` names): tokenizer.json; the stop tokens from
generation_config.json's ``eos_token_id`` and tokenizer_config.json's ``eos_token``; and the chat
template (``stoker.conversation.chat_template``), which lays out the opening and the turn wrapper, BOS
included. Without a template, the BOS is tokenizer_config.json's ``add_bos_token`` rule.

Built-in tokenizers (used when neither is set, or with ``model.tokenizer: builtin``; the learner
must build the same one, so it calls ``environment_tokenizer(spec)`` too):

* FrozenLake: a word-level vocabulary of the environment's few words, so a move is one token.
  The move words double as stop tokens: a turn ends the moment the model names a move.
* SWE: byte-level (256 byte tokens plus the specials), so any text, code included, round-trips.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stoker.conversation.chat_template import ChatTemplateError, ChatTurns, build_chat_turns
from stoker.conversation.frozenlake_words import ACTIONS, WORDS
from stoker.model.tokenizer import TokenizerError, leading_special_ids, load_tokenizer, read_tokenizer_files
from stoker.spec import RLJobSpec

_log = logging.getLogger(__name__)

PAD, UNK, BOS, EOT, ACT = "<pad>", "<unk>", "<bos>", "<eot>", "<act>"
SPECIALS = (PAD, UNK, BOS, EOT, ACT)
# End-of-turn tokens of common chat tokenizers, tried in order when a tokenizer file is given.
STOP_CANDIDATES = (EOT, "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>")


class TokenizerProblem(Exception):
    """A tokenizer the actor cannot use (missing file, no end-of-turn token, vocabulary too big)."""


@lru_cache(maxsize=1)
def frozenlake_tokenizer() -> Tokenizer:
    """The word-level FrozenLake tokenizer: ids 0-4 are the specials, then the environment's words."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


@lru_cache(maxsize=1)
def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: 5 specials + 256 byte tokens; exact round trips."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIALS, *alphabet])}
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


BUILTIN = "builtin"  # spec.model.tokenizer: the environment's built-in tokenizer, even with a checkpoint


def tokenizer_directory(spec: RLJobSpec) -> str | None:
    """Where the job's Hugging Face tokenizer files are: ``spec.model.tokenizer`` (a directory, or a
    tokenizer.json in one), else the checkpoint directory; None for a built-in tokenizer."""
    chosen = spec.model.tokenizer
    if chosen == BUILTIN:
        return None
    if chosen:
        path = Path(chosen)
        return str(path if path.is_dir() else path.parent)
    return spec.model.checkpoint


def environment_tokenizer(spec: RLJobSpec) -> Tokenizer:
    """The tokenizer a job uses: ``spec.model.tokenizer`` when set, the checkpoint's tokenizer.json
    with ``spec.model.checkpoint``, else the environment's built-in (also with ``tokenizer: builtin``).

    A pretrained checkpoint is never paired with the built-in tokenizer unless the manifest asks."""
    if spec.model.tokenizer and spec.model.tokenizer != BUILTIN:
        try:
            return load_tokenizer(spec.model.tokenizer)
        except TokenizerError as exc:
            raise TokenizerProblem(f"spec.model.tokenizer: {exc}") from None
    if spec.model.checkpoint and spec.model.tokenizer != BUILTIN:
        if not Path(spec.model.checkpoint).expanduser().is_dir():  # a wrong path, not a tokenizer to pick
            raise TokenizerProblem(
                f"spec.model.checkpoint: {spec.model.checkpoint!r} is not a directory; expected a Hugging Face "
                "checkpoint directory (config.json, *.safetensors, tokenizer.json)"
            )
        try:
            return load_tokenizer(spec.model.checkpoint)
        except TokenizerError as exc:
            raise TokenizerProblem(
                f"spec.model.checkpoint: {exc}; set model.tokenizer to the checkpoint's tokenizer.json, or to "
                f"{BUILTIN!r} to pair it with the environment's built-in tokenizer"
            ) from None
    return frozenlake_tokenizer() if spec.environment.name == "frozenlake" else byte_tokenizer()


@dataclass(frozen=True)
class TextInterface:
    """How text becomes ids around the model's turns, for one tokenizer.

    Without a chat template: ``bos_ids`` once, then per turn the observation's ids and
    ``prompt_ids``. With one (``chat``): the template's opening for the first observation, then
    ``close + observation + generation`` fixed ids per later turn (``stoker.conversation.chat_template``).
    """

    tokenizer: Tokenizer
    bos_ids: tuple[int, ...]  # once, at the start of every episode
    prompt_ids: tuple[int, ...]  # after every observation: "your turn"
    stop_token_ids: tuple[int, ...]  # a model turn ends after sampling one of these
    chat: ChatTurns | None = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def first_turn_ids(self, observation: str) -> list[int]:
        """The episode's opening: everything before the model's first turn."""
        if self.chat is None:
            return [*self.bos_ids, *self.encode(observation), *self.prompt_ids]
        return [*self.bos_ids, *self.encode(self.chat.opening_text(observation))]

    def next_turn_ids(self, observation: str, sampled: Sequence[int]) -> list[int]:
        """What follows the model's ``sampled`` ids before its next turn, built from fixed ids."""
        if self.chat is None:
            return [*self.encode(observation), *self.prompt_ids]
        ended = bool(sampled) and sampled[-1] in self.stop_token_ids
        close = self.chat.close_ids if ended else self.chat.unterminated_close_ids
        return [*close, *self.encode(self.chat.observation_text(observation)), *self.chat.generation_ids]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


def text_interface(spec: RLJobSpec) -> TextInterface:
    """The job's tokenizer, BOS rule, stop tokens and turn template (see ``TextInterface``)."""
    directory = tokenizer_directory(spec)
    tokenizer = environment_tokenizer(spec)
    interface = (
        _pretrained_interface(spec, tokenizer, directory) if directory else _builtin_interface(spec, tokenizer)
    )
    model_vocab, where = _model_vocab_size(spec)
    if interface.vocab_size > model_vocab:
        raise TokenizerProblem(
            f"{where}: got {model_vocab}; expected >= {interface.vocab_size}, the job's tokenizer's vocabulary"
        )
    return interface


def _builtin_interface(spec: RLJobSpec, tokenizer: Tokenizer) -> TextInterface:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    stops = [vocab[t] for t in STOP_CANDIDATES if t in vocab]
    if spec.environment.name == "frozenlake" and spec.model.tokenizer in (None, BUILTIN):
        stops += [vocab[a] for a in ACTIONS]
    bos = (vocab[BOS],) if BOS in vocab else ()
    prompt = (vocab[ACT],) if ACT in vocab else tuple(tokenizer.encode("\n> ", add_special_tokens=False).ids)
    return TextInterface(tokenizer, bos, prompt, tuple(stops))


def _pretrained_interface(spec: RLJobSpec, tokenizer: Tokenizer, directory: str) -> TextInterface:
    """A Hugging Face tokenizer directory: BOS, stop tokens and chat template from its files."""
    field = "spec.model.tokenizer" if spec.model.tokenizer else "spec.model.checkpoint"
    try:
        files = read_tokenizer_files(directory, spec.model.checkpoint)
    except TokenizerError as exc:
        raise TokenizerProblem(f"{field}: {exc}") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    source = files.chat_template
    if spec.model.chat_template == "none":
        source = None
    elif spec.model.chat_template:
        try:
            source = Path(spec.model.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerProblem(f"spec.model.chatTemplate: cannot read {spec.model.chat_template}: {exc}") from None
    stops = list(files.eos_token_ids)
    chat = None
    if source is not None:
        try:
            chat = build_chat_turns(
                tokenizer, source, bos_token=files.bos_token, eos_token=files.eos_token,
                system_prompt=spec.model.system_prompt, observation_role=spec.environment.observation_role,
            )
        except ChatTemplateError as exc:
            raise TokenizerProblem(f"{field} chat template: {exc}") from None
        if chat.role_fallback:
            _log.warning("spec.environment.observationRole: %s; observations go in user turns", chat.role_fallback)
        if chat.turn_end_id is not None:
            stops.append(chat.turn_end_id)
    if not stops:
        stops = [vocab[t] for t in STOP_CANDIDATES if t in vocab]
    if not stops:
        raise TokenizerProblem(
            f"{field}: no stop token: generation_config.json has no eos_token_id, tokenizer_config.json no "
            f"eos_token, and the vocabulary none of {', '.join(STOP_CANDIDATES)}"
        )
    if chat is not None:
        bos: tuple[int, ...] = ()  # the template renders its own BOS (Llama 3's {{ bos_token }})
        prompt: tuple[int, ...] = ()
    else:
        # No template: the BOS rule is tokenizer_config.json's add_bos_token, else what the
        # tokenizer's own post-processor puts first; turns end with a newline prompt.
        if files.add_bos_token is not None:
            bos = (vocab[files.bos_token],) if files.add_bos_token and files.bos_token else ()
        else:
            bos = leading_special_ids(tokenizer)
        prompt = tuple(tokenizer.encode("\n> ", add_special_tokens=False).ids)
    return TextInterface(tokenizer, bos, prompt, tuple(dict.fromkeys(stops)), chat)


def _model_vocab_size(spec: RLJobSpec) -> tuple[int, str]:
    """The policy's vocabulary: the checkpoint's config.json, else the spec's architecture."""
    if spec.model.checkpoint:
        path = Path(spec.model.checkpoint) / "config.json"
        try:
            size = json.loads(path.read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, json.JSONDecodeError, AttributeError):
            size = None
        if isinstance(size, int):
            return size, f"{path} vocab_size"
    return spec.model.architecture.vocab_size, "spec.model.architecture.vocabSize"


def allowed_token_ids(spec: RLJobSpec) -> tuple[int, ...] | None:
    """``spec.actors.sampling.allowedTokens`` as ids of the job's tokenizer (None: unconstrained).

    The learner calls this too, so the sampler and the trainer restrict the same tokens."""
    words = spec.actors.sampling.allowed_tokens
    if words is None:
        return None
    tokenizer = environment_tokenizer(spec)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ids: set[int] = set()
    unknown: list[str] = []
    for word in words:
        if word in vocab:  # a raw vocabulary spelling ("Ġ8")
            ids.add(vocab[word])
            continue
        encoded = tokenizer.encode(word, add_special_tokens=False).ids  # text (" 8")
        if len(encoded) == 1:
            ids.add(int(encoded[0]))
        else:
            unknown.append(f"{word!r} ({len(encoded)} tokens)")
    if unknown:
        raise TokenizerProblem(
            f"spec.actors.sampling.allowedTokens: {', '.join(unknown)} are not single tokens of the job's tokenizer; "
            "expected a vocabulary entry or text that encodes to one token (with a BPE tokenizer the token after a "
            "space is ' 8', spelled 'Ġ8' in its vocabulary)"
        )
    return tuple(sorted(ids))
