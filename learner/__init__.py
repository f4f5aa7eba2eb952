"""Learner: JAX training core (model, algorithms, packing, sharding, checkpoints, weights)."""
