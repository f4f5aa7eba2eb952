"""Tokenizers and the turn template the actor wraps around observations.

The conversation is token ids from start to end (strict token-in-token-out): ``<bos>`` once, then
per turn the observation's ids and the prompt marker ``<act>`` (loss mask 0), then the model's
sampled ids exactly as sampled (loss mask 1). Observations are tokenised once; sampled ids are
decoded only to give the environment its action text, never re-encoded.

Built-in tokenizers (used when ``spec.model.tokenizer`` is unset; the learner must build the same
one, so it calls ``environment_tokenizer(spec)`` too):

* FrozenLake: a word-level vocabulary of the environment's few words, so a move is one token.
  The move words double as stop tokens: a turn ends the moment the model names a move.
* SWE: byte-level (256 byte tokens plus the specials), so any text, code included, round-trips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stoker.spec import RLJobSpec

PAD, UNK, BOS, EOT, ACT = "<pad>", "<unk>", "<bos>", "<eot>", "<act>"
SPECIALS = (PAD, UNK, BOS, EOT, ACT)
# End-of-turn tokens of common chat tokenizers, tried in order when a tokenizer file is given.
STOP_CANDIDATES = (EOT, "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>")


class TokenizerProblem(Exception):
    """A tokenizer the actor cannot use (missing file, no end-of-turn token, vocabulary too big)."""


@lru_cache(maxsize=1)
def frozenlake_tokenizer() -> Tokenizer:
    """The word-level FrozenLake tokenizer: ids 0-4 are the specials, then the environment's words."""
    from stoker.actor.frozenlake import WORDS

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


def environment_tokenizer(spec: RLJobSpec) -> Tokenizer:
    """The tokenizer a job uses: ``spec.model.tokenizer`` when set, else the environment's built-in."""
    if spec.model.tokenizer:
        from stoker.learner.tokenizer import TokenizerError, load_tokenizer

        try:
            return load_tokenizer(spec.model.tokenizer)
        except TokenizerError as exc:
            raise TokenizerProblem(f"spec.model.tokenizer: {exc}") from None
    return frozenlake_tokenizer() if spec.environment.name == "frozenlake" else byte_tokenizer()


@dataclass(frozen=True)
class TextInterface:
    """How text becomes ids around the model's turns, for one tokenizer."""

    tokenizer: Tokenizer
    bos_ids: tuple[int, ...]  # once, at the start of every episode
    prompt_ids: tuple[int, ...]  # after every observation: "your turn"
    stop_token_ids: tuple[int, ...]  # a model turn ends after sampling one of these

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


def text_interface(spec: RLJobSpec) -> TextInterface:
    tokenizer = environment_tokenizer(spec)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    stops = [vocab[t] for t in STOP_CANDIDATES if t in vocab][:1]
    if not stops:
        raise TokenizerProblem(
            f"{spec.model.tokenizer}: no end-of-turn token; expected one of {', '.join(STOP_CANDIDATES)}"
        )
    if spec.environment.name == "frozenlake" and not spec.model.tokenizer:
        from stoker.actor.frozenlake import ACTIONS

        stops += [vocab[a] for a in ACTIONS]
    bos = (vocab[BOS],) if BOS in vocab else ()
    prompt = (vocab[ACT],) if ACT in vocab else tuple(tokenizer.encode("\n> ", add_special_tokens=False).ids)
    interface = TextInterface(tokenizer, bos, prompt, tuple(stops))
    model_vocab = spec.model.architecture.vocab_size
    if interface.vocab_size > model_vocab:
        raise TokenizerProblem(
            f"spec.model.architecture.vocabSize: got {model_vocab}; expected >= {interface.vocab_size}, "
            f"the {spec.environment.name} tokenizer's vocabulary"
        )
    return interface


def allowed_token_ids(spec: RLJobSpec) -> tuple[int, ...] | None:
    """``spec.actors.sampling.allowedTokens`` as ids of the job's tokenizer (None: unconstrained).

    The learner calls this too, so the sampler and the trainer restrict the same tokens."""
    words = spec.actors.sampling.allowed_tokens
    if words is None:
        return None
    vocab = environment_tokenizer(spec).get_vocab(with_added_tokens=True)
    unknown = [w for w in words if w not in vocab]
    if unknown:
        raise TokenizerProblem(
            f"spec.actors.sampling.allowedTokens: {unknown} are not tokens of the job's tokenizer"
        )
    return tuple(sorted({vocab[w] for w in words}))
