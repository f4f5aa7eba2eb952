"""Learner: JAX training core (algorithms, packing, sharding, Orbax checkpoints, the buffer loop).

The model and checkpoint I/O it trains live in `stoker.model`; generation in `stoker.rollout`.
"""
