"""Model: the transformer, its attention, RoPE and log-probs, and checkpoint I/O.

Shared by the learner (which trains it), the rollout tier and the in-process actor (which sample
from it). Nothing here imports training code (optax, Orbax, the learner's loop).
"""
