"""The FrozenLake environment's words (``stoker.actor.frozenlake``): every word an observation or
an answer can contain. The built-in FrozenLake tokenizer's vocabulary is made of them, one token a
word, so a move is exactly one sampled token."""

from __future__ import annotations

ACTIONS = ("left", "down", "right", "up")  # gymnasium's action order 0..3
INSTRUCTION = "reach G and avoid H . you are P . answer with one move : left down right up ."
INVALID = "invalid move ."
ROW_END = "|"
# Every word an observation can contain; the tokenizer's vocabulary is built from this.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys([*INSTRUCTION.split(), *INVALID.split(), ROW_END, "S", "F", "H", "G", "P", *ACTIONS])
)
