"""Actors: multi-turn episodes in sandboxes, strict token-in-token-out trajectories."""
