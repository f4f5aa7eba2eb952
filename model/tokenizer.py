"""Tokenizers: load a Hugging Face ``tokenizer.json``, or train a tiny real one for an environment.

Everything is a ``tokenizers.Tokenizer`` so actors encode and decode with the same library (and the
same file) whether the policy is a tiny FrozenLake model or a pretrained checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


# ------------------------------------------------------------ a checkpoint's tokenizer files

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template beside the config


@dataclass(frozen=True)
class TokenizerFiles:
    """A Hugging Face tokenizer directory: ``tokenizer.json`` plus what its config files say.

    ``eos_token_ids`` joins generation_config.json's ``eos_token_id`` (an id or a list: instruct
    models list their end-of-turn token there) and tokenizer_config.json's ``eos_token``."""

    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool | None = None  # None: the config does not say
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(config: dict[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = directory / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def read_tokenizer_files(directory: str | Path, generation_directory: str | Path | None = None) -> TokenizerFiles:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` of a directory
    (generation_config.json from ``generation_directory`` when given: it sits with the weights)."""
    directory = Path(directory)
    tokenizer = load_tokenizer(directory)
    config = _read_json(directory / TOKENIZER_CONFIG_FILE)
    generation = _read_json(Path(generation_directory or directory) / GENERATION_CONFIG_FILE)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos_ids: list[int] = []
    raw = generation.get("eos_token_id")
    for value in raw if isinstance(raw, list) else [raw]:
        if isinstance(value, int) and not isinstance(value, bool):
            eos_ids.append(value)
    eos = _token_text(config.get("eos_token"))
    if eos is not None:
        if eos not in vocab:
            raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: eos_token {eos!r} is not in tokenizer.json")
        eos_ids.append(vocab[eos])
    bos = _token_text(config.get("bos_token"))
    if bos is not None and bos not in vocab:
        raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: bos_token {bos!r} is not in tokenizer.json")
    add_bos = config.get("add_bos_token")
    return TokenizerFiles(
        tokenizer=tokenizer,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        chat_template=_chat_template(config, directory),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def leading_special_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer's own post-processor puts before any text (a BOS, for Llama-style
    tokenizer.json files; nothing for Qwen's)."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start])
    return ()
