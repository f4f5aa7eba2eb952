"""Tokenizers: load a Hugging Face ``tokenizer.json``, or train a tiny real one for an environment.

Everything is a ``tokenizers.Tokenizer`` so actors encode and decode with the same library (and the
same file) whether the policy is a tiny FrozenLake model or a pretrained checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_FILE = "tokenizer.json"
UNK_TOKEN = "<unk>"
_EOW = "</w>"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded, or a token it lacks."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (or a directory holding one, such as a checkpoint directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"{path} not found; expected a tokenizers tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a bare Exception for malformed files
        raise TokenizerError(f"{path} is not a valid tokenizer.json: {err}") from err


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write ``tokenizer.json`` (into ``path`` if it is a directory); returns the file."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def train_word_tokenizer(
    texts: Iterable[str],
    special_tokens: Sequence[str] = (),
    *,
    kind: Literal["wordlevel", "bpe"] = "wordlevel",
    vocab_size: int | None = None,
) -> Tokenizer:
    """Train a small tokenizer on ``texts`` with the ``tokenizers`` trainers.

    ``wordlevel``: one id per whitespace/punctuation-separated word seen in ``texts`` (a closed
    vocabulary such as an environment's observations and actions). ``bpe``: byte-pair merges up
    to ``vocab_size``. Special tokens get the first ids, in the order given, followed by ``<unk>``
    if it is not among them; they are never split. Decoding joins words with spaces."""
    specials = list(dict.fromkeys([*special_tokens, UNK_TOKEN]))
    if kind == "wordlevel":
        tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
        trainer: trainers.Trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size or 1 << 30, min_frequency=1, special_tokens=specials, show_progress=False
        )
    elif kind == "bpe":
        # The end-of-word suffix lets the decoder put the spaces back between words.
        tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN, end_of_word_suffix=_EOW))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size or 1000,
            min_frequency=1,
            special_tokens=specials,
            end_of_word_suffix=_EOW,
            show_progress=False,
        )
        tokenizer.decoder = decoders.BPEDecoder(suffix=_EOW)
    else:
        raise TokenizerError(f"kind must be 'wordlevel' or 'bpe', got {kind!r}")
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a single token (e.g. a stop token), with a clear error if it is missing."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise TokenizerError(f"token {token!r} is not in the tokenizer's vocabulary")
    return int(found)
