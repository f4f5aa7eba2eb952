"""Episodes over the real JAX sampler: sampled ids, log-probs and versions survive exactly."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.actor.episode import EpisodeLimits, run_group
from stoker.actor.policy import BatchedSampler, call_limits
from stoker.actor.sandbox import inline_factory
from stoker.conversation.tokenization import TextInterface
from stoker.model.hf import to_hf
from stoker.model.logprobs import token_logprobs
from stoker.model.model import init_model
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig
from stoker.trajectory import array_problem, to_proto

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # compiles a few sampler programs: ~10-20 s

CONFIG = TransformerConfig(
    vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=256
)


async def test_real_sampler_trajectories_match_the_model_and_record_versions(lake: TextInterface, lake_config) -> None:  # type: ignore[no-untyped-def]
    sampler = Sampler(CONFIG, SamplingSpec(temperature=1.0, max_new_tokens=2), seed=0, buckets=(128, 256))
    policy = BatchedSampler(sampler, max_batch=8)
    new_weights = to_hf(init_model(CONFIG, seed=1))
    limits = EpisodeLimits(max_turns=4, max_new_tokens=2, max_tokens=256)

    async def update_after_first_batch() -> None:
        while policy.stats.calls < 1:
            await asyncio.sleep(0.001)
        await policy.load_weights(new_weights, 1)

    group, _ = await asyncio.gather(
        run_group(policy, inline_factory(lake_config), lake, "1", 4, limits=limits), update_after_first_batch()
    )
    await policy.close()
    assert max(policy.stats.sizes) > 1  # the four episodes' turns were batched

    # The learner's recomputation over the trajectory's ids equals what the actor recorded. All
    # episodes go through each model as one padded batch (one shape: one compile).
    width = 128
    ids = np.zeros((len(group), width), np.int32)
    segments = np.zeros((len(group), width), np.int32)
    for row, episode in enumerate(group):
        ids[row, : episode.num_tokens] = episode.token_ids
        segments[row, : episode.num_tokens] = 1
    positions = np.broadcast_to(np.arange(width), ids.shape)
    versions_seen: set[int] = set()
    for version, seed in ((0, 0), (1, 1)):
        model = init_model(CONFIG, seed=seed)
        logits = model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments))
        recomputed = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(ids[:, 1:])))
        for row, episode in enumerate(group):
            n = episode.num_tokens
            here = (episode.loss_mask[1:] == 1) & (episode.policy_versions[1:] == version)
            np.testing.assert_allclose(recomputed[row, : n - 1][here], episode.logprobs[1:][here], atol=2e-4)
            versions_seen |= {version} if here.any() else set()
    for episode in group:
        assert array_problem(to_proto(episode)) is None
        assert episode.policy_versions[episode.loss_mask == 1][0] == 0  # first turns ran before the update
    assert versions_seen == {0, 1}


async def test_a_call_names_no_more_sessions_than_the_cache_has_rows(lake: TextInterface, lake_config) -> None:  # type: ignore[no-untyped-def]
    """Four conversations at once over a cache of two rows: calls take two at a time (the rest wait),
    instead of one call of four failing every episode."""
    sampler = Sampler(CONFIG, SamplingSpec(max_new_tokens=2), seed=0, buckets=(128,), session_rows=2)
    policy = BatchedSampler(sampler, max_batch=8)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=2, max_tokens=128)
    group = await run_group(policy, inline_factory(lake_config), lake, "1", 4, limits=limits)
    await policy.close()
    assert [e.ok for e in group] == [True] * 4
    assert max(policy.stats.sizes) == 2


@pytest.mark.parametrize("platform, calls", [("cpu", [32] * 4), ("tpu", [128])])
async def test_a_batch_of_episodes_goes_out_in_calls_sized_for_the_platform(
    platform: str, calls: list[int]
) -> None:
    """A synchronous or colocated step's 128 episodes ask at once: on a CPU four calls of 32 (the
    CPU's cache-bound sweet spot), on an accelerator one call of 128 (its decode shares each
    weight read among the rows)."""
    sampler = Sampler(CONFIG, SamplingSpec(max_new_tokens=2), seed=0, buckets=(16,))
    policy = BatchedSampler(sampler, *call_limits(platform))
    await asyncio.gather(*(policy.generate([1, 2, 3], max_new_tokens=2, stop_token_ids=()) for _ in range(128)))
    await policy.close()
    assert list(policy.stats.sizes) == calls
