"""Supervised fine-tuning data: chat conversations rendered with the job's chat template, as
sequences the learner packs like any other.

A line of the dataset is one conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}``.
With a chat template (the checkpoint's, ``model.chatTemplate``'s) the whole conversation is
rendered once and tokenised once; a token trains when it starts inside an assistant turn's text,
which runs from the end of the template's generation prompt before the turn to the end of the
turn as the template closes it (its end-of-turn token included, so the model learns to stop).
Without a template (a built-in tokenizer, or ``chatTemplate: none``) the conversation is laid out
as the actors lay out an episode: BOS, each other message's ids, the prompt marker, then the
assistant's ids and a stop token.

``lossOn: all`` trains every token after the first instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stoker.conversation.chat_template import render
from stoker.conversation.tokenization import TextInterface, TokenizerProblem, text_interface
from stoker.learner.batches import DatasetError, dataset_records
from stoker.learner.packing import TrainSequence
from stoker.spec import RLJobSpec

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One rendered conversation: its ids and which of them train (1)."""

    token_ids: np.ndarray  # int32[n]
    loss_mask: np.ndarray  # uint8[n]

    def sequence(self) -> TrainSequence:
        n = self.token_ids.shape[0]
        return TrainSequence(
            self.token_ids, self.loss_mask, np.zeros(n, np.float32), np.full(n, -1, np.int32), behaviour_known=False
        )


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """The ``messages`` of every line of a JSONL file; a bad line is named with its number."""
    conversations = []
    for number, record in dataset_records(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{path}:{number}: expected an object with a non-empty messages list")
        for index, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)
            ):
                raise DatasetError(
                    f"{path}:{number}: messages[{index}] must be {{\"role\": {'|'.join(ROLES)}, \"content\": string}}"
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError(f"{path}:{number}: no assistant message to train on")
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not conversations:
        raise DatasetError(f"{path}: no conversations")
    return conversations


def _templated(interface: TextInterface, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids of the template's rendering and the 0/1 assistant mask, from the tokens' offsets."""
    chat = interface.chat
    assert chat is not None

    def text(upto: int, generation: bool) -> str:
        return render(
            chat.template, messages[:upto], bos_token=chat.bos_token, eos_token=chat.eos_token,
            add_generation_prompt=generation,
        )

    full = text(len(messages), False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = text(index, True), text(index + 1, False)
        if not full.startswith(before) or not full.startswith(through) or len(through) < len(before):
            raise DatasetError(
                "the chat template renders a conversation's earlier turns differently once later ones follow; "
                "set model.chatTemplate to one that does not"
            )
        spans.append((len(before), len(through)))
    encoding = interface.tokenizer.encode(full, add_special_tokens=False)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoding.offsets]
    return list(encoding.ids), mask


def _plain(interface: TextInterface, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The actors' layout without a template (``TextInterface.first_turn_ids``)."""
    ids, mask = list(interface.bos_ids), [0] * len(interface.bos_ids)
    stop = list(interface.stop_token_ids[:1])
    for index, message in enumerate(messages):
        content = interface.encode(message["content"])
        if message["role"] == "assistant":
            ids += content + stop
            mask += [1] * (len(content) + len(stop))
            continue
        following = messages[index + 1]["role"] if index + 1 < len(messages) else None
        marker = list(interface.prompt_ids) if following == "assistant" else []
        ids += content + marker
        mask += [0] * (len(content) + len(marker))
    return ids, mask


def render_conversation(interface: TextInterface, messages: list[dict[str, str]], loss_on: str = "assistant") -> Conversation:
    """One conversation as ids and its loss mask (module docstring)."""
    ids, mask = (_templated if interface.chat is not None else _plain)(interface, messages)
    if loss_on == "all":
        mask = [1] * len(ids)
    elif loss_on != "assistant":
        raise ValueError(f"loss_on {loss_on!r}; expected 'assistant' or 'all'")
    return Conversation(np.asarray(ids, np.int32), np.asarray(mask, np.uint8))


@dataclass(frozen=True)
class SftData:
    """The training and held-out conversations of one job, rendered."""

    train: list[Conversation]
    eval: list[Conversation]


def split_held_out(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which of ``count`` conversations are held out: ``round(fraction * count)`` of them (at least
    one when the fraction is positive and two or more exist), drawn with the job's seed."""
    held = int(round(fraction * count))
    if fraction > 0 and count >= 2:
        held = min(max(held, 1), count - 1)
    chosen = np.zeros(count, bool)
    chosen[np.random.default_rng(seed).permutation(count)[:held]] = True
    return chosen


def load_sft_data(
    interface: TextInterface,
    dataset: str,
    *,
    eval_dataset: str | None = None,
    eval_fraction: float = 0.0,
    loss_on: str = "assistant",
    seed: int = 0,
    vocab_size: int | None = None,
) -> SftData:
    """Read, render and split a job's SFT data (``spec.algorithm.sft``)."""

    def rendered(path: str, conversations: Sequence[list[dict[str, str]]]) -> list[Conversation]:
        out = []
        for number, messages in enumerate(conversations, 1):
            conversation = render_conversation(interface, messages, loss_on)
            if vocab_size is not None and conversation.token_ids.size and int(conversation.token_ids.max()) >= vocab_size:
                raise DatasetError(f"{path}: conversation {number} has token ids past the model's vocabulary ({vocab_size})")
            if conversation.token_ids.shape[0] < 2 or not conversation.loss_mask[1:].any():
                raise DatasetError(f"{path}: conversation {number} has no token to train on")
            out.append(conversation)
        return out

    train = rendered(dataset, read_conversations(dataset))
    if eval_dataset is not None:
        return SftData(train, rendered(eval_dataset, read_conversations(eval_dataset)))
    held = split_held_out(len(train), eval_fraction, seed)
    return SftData([c for c, h in zip(train, held, strict=True) if not h], [c for c, h in zip(train, held, strict=True) if h])


def job_sft_data(spec: RLJobSpec, vocab_size: int) -> SftData:
    """``load_sft_data`` for a job: its ``algorithm.sft``, its tokenizer and chat template."""
    sft = spec.algorithm.sft
    if sft is None:
        raise DatasetError("algorithm.sft.dataset: missing (SFT needs a dataset)")
    try:
        interface = text_interface(spec)
    except TokenizerProblem as exc:
        raise DatasetError(str(exc)) from None
    return load_sft_data(
        interface, sft.dataset, eval_dataset=sft.eval_dataset, eval_fraction=sft.eval_fraction,
        loss_on=sft.loss_on, seed=spec.seed, vocab_size=vocab_size,
    )
