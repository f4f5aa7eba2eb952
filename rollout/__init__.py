"""Rollout: generation. The sampler and its KV cache, used in-process by actors and the colocated
learner, and served to actors over gRPC by ``stoker rollout``.
"""
