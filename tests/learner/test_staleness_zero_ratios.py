"""At staleness 0 the behaviour ratio pi_theta / mu is ~1: the real sampler and the trainer agree.

Episodes are played by the very code actors run (``make_policy``'s ``BatchedSampler`` over the
JAX ``Sampler``, ``run_group`` over a FrozenLake sandbox), on the learner's current weights, and
trained with ``Learner.train_on``: the learner's ``behaviour_*`` metrics then measure only the
sampler/trainer numerics. Trained again one update later, the same tokens are one version stale
and the metrics must show it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from stoker.actor.episode import run_group
from stoker.actor.sandbox import close_factory
from stoker.actor.settings import ActorSettings
from stoker.actor.wiring import environment_factory, make_policy
from stoker.conversation.tokenization import text_interface
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import tiny_spec
from stoker.spec import RLJobSpec
from stoker.trajectory import Episode

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared across the parametrized cases

GROUP_SIZE = 4
# FrozenLake on a tiny policy: its word vocabulary (27 ids), three turns of up to three freely
# sampled tokens each (no allowedTokens: the sampler's log-probs are over the whole vocabulary,
# as the trainer's are), in the actor's process (inline sandbox); episodes of 70-95 tokens, one
# 128-token bucket (one sampler prefill shape, one learner program).
JOB: dict[str, Any] = {
    "model": {"architecture": {"vocabSize": 27, "maxSeqLen": 128}},
    "environment": {"name": "frozenlake", "maxTurns": 3, "sandbox": {"kind": "inline"}},
    "actors": {"concurrency": GROUP_SIZE, "sampling": {"maxNewTokens": 3}},
    "buffer": {"groupSize": GROUP_SIZE, "maxStaleness": 1},
    "learner": {"sequenceBuckets": [128], "batchGroups": 1},
    "algorithm": {"name": "grpo", "learningRate": 0.05},
}


async def play_group(spec: RLJobSpec, learner: Learner) -> list[Episode]:
    """One group of episodes from the actor's sampler on the learner's current weights."""
    actor = dataclasses.replace(ActorSettings.from_spec(spec, actor_id="test"), concurrency=GROUP_SIZE)
    policy = make_policy(actor, spec.model.dtype)
    envs = environment_factory(actor)
    try:
        await policy.load_weights(learner.device_weights(), learner.version)
        return await run_group(policy, envs, text_interface(spec), actor.tasks[0], GROUP_SIZE, limits=actor.limits, seed=3)
    finally:
        await close_factory(envs)
        await policy.close()


# The largest |log pi_theta/mu| of a token trained at staleness 0, by the job's model.dtype.
# float32: sampler and trainer differ in op order only (the sampler's cached decode against the
# trainer's whole-sequence forward); measured 2.4e-7 here, 4.8e-7 at worst over five runs (other
# seeds, longer episodes): a float32 ulp or two of a log-prob of ~-3 (ulp 2.4e-7).
# bfloat16: both run the same bf16-rounded weights (the learner's float32 master weights, cast)
# with bf16 activations and take the log-softmax in float32, so they again differ in op order
# only, but each rounding is bf16's (relative 2^-9 ~ 2e-3): measured 5.0e-4 here, 4.1e-4 to
# 7.3e-4 over five runs. A float32 sampler against the bf16 trainer measures 1.5e-3 here, above
# the bound: it also says that the sampler runs in the job's dtype.
LOG_W_BOUND = {"float32": 1e-5, "bfloat16": 1e-3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_behaviour_ratios_are_one_at_staleness_zero_and_move_with_one_version_of_lag(dtype: str) -> None:
    spec = tiny_spec(JOB, model={"dtype": dtype})
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))
    episodes = asyncio.run(play_group(spec, learner))
    assert all(e.ok for e in episodes)
    sampled = [int(e.loss_mask.sum()) for e in episodes]
    assert min(sampled) >= 2, sampled  # multi-token episodes
    for j, episode in enumerate(episodes):  # a reward spread, so that GRPO trains the group
        episode.reward = float(j % 2)
    groups = [Group(episodes)]

    fresh = learner.train_on(groups)
    stale = learner.train_on(groups)  # the same tokens, now one update behind the learner
    assert fresh["trained"] == stale["trained"] == 1.0 and stale["stale_tokens"] == 0
    assert fresh["trained_tokens"] == stale["trained_tokens"] == sum(sampled)  # every sampled token is weighed
    assert fresh["staleness_max"] == 0 and stale["staleness_max"] == 1

    # Staleness 0: every w is 1 up to the sampler/trainer numerics. ESS = 1 - Var(w)/E[w^2]
    # (normalised by the token count), so its deficit is ~(log w)^2: 1e-7 at most here.
    bound = LOG_W_BOUND[dtype]
    assert fresh["behaviour_log_w_abs_max"] < bound, fresh
    assert fresh["behaviour_ess"] == pytest.approx(1.0, abs=1e-5), fresh
    assert fresh["behaviour_log_w_m2"] <= fresh["behaviour_log_w_abs_max"] ** 2, fresh

    # One version stale (one Adam step at learning rate 0.05 between sampling and training): the
    # ratios spread -- measured |log w| up to 0.49 (float32) and 0.46 (bfloat16), ESS 0.90 and 0.96.
    assert stale["behaviour_log_w_abs_max"] > 100 * bound, stale
    assert stale["behaviour_ess"] < 0.995, stale
    assert 1e-3 < stale["behaviour_log_w_m2"] <= stale["behaviour_log_w_abs_max"] ** 2, stale
