"""A sampler warmed up compiles nothing during episodes, and samples exactly as one that was not."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.model.model import init_model
from stoker.rollout.sampling import Sampler
from stoker.rollout.warmup import row_counts
from stoker.spec import SamplingSpec, TransformerConfig
from stoker.weights.channel import flatten_params

CONFIG = TransformerConfig(max_seq_len=64)
BUCKETS = (16, 32, 64)
SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0)

pytestmark = pytest.mark.usefixtures("xla_cache")


def sampler(sessions: int) -> Sampler:
    return Sampler(CONFIG, SAMPLING, seed=3, buckets=BUCKETS, min_batch=2, session_rows=sessions)


def play(s: Sampler, sessions: bool) -> list[tuple[list[int], list[float]]]:
    """Conversations of 1, 3 and 4 rows that grow turn by turn, then new weights (a re-prefill
    of every cached row) and a long prompt: every row count and width the calls can take."""
    out = []
    prompts = [[1 + i, 2, 3] for i in range(4)]
    for turn, rows in enumerate((1, 3, 4, 4, 3)):
        if turn == 3:
            s.load_weights(flatten_params(init_model(CONFIG, seed=9)), version=1)
        batch = [prompts[i] + [5 + turn] * (9 * turn) for i in range(rows)]
        names = [f"c{i}" for i in range(rows)] if sessions else None
        for prompt, gen in zip(batch, s.generate(batch, max_new_tokens=3, sessions=names), strict=True):
            out.append((prompt + gen.token_ids, gen.logprobs))
    return out


@pytest.mark.parametrize("sessions", [4, 0], ids=["conversation-cache", "no-cache"])
def test_warm_up_compiles_every_shape_the_calls_take(sessions: int) -> None:
    warm = sampler(sessions)
    compiled = warm.warm_up(4)
    assert compiled == warm.compile_count > 0
    assert warm.warm_up(4) == 0  # all compiled already
    play(warm, sessions > 0)
    assert warm.compile_count == compiled, "a call compiled a program the warm-up did not"


@pytest.mark.parametrize("sessions", [4, 0], ids=["conversation-cache", "no-cache"])
def test_warm_up_changes_no_sample(sessions: int) -> None:
    cold, warm = sampler(sessions), sampler(sessions)
    warm.warm_up(4, first=5)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(play(cold, sessions > 0), play(warm, sessions > 0), strict=True):
        assert ids_a == ids_b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-6)


def test_row_counts_cover_every_padded_call() -> None:
    assert list(row_counts(8, 4)) == [4, 8]
    assert list(row_counts(5, 4)) == [4, 8]
    assert list(row_counts(1, 4)) == [4]
    assert list(row_counts(3, 1)) == [1, 2, 4]
    assert list(row_counts(4, 3)) == [4]


def test_the_actors_batcher_compiles_nothing_after_its_warm_up_and_skips_calls_it_never_makes() -> None:
    """Through ``BatchedSampler`` as an actor drives it: concurrent conversations that grow turn
    by turn, new weights among them. A call's rows are bounded by max_call_tokens over its width,
    so the warm-up leaves out shapes no call can take."""
    import asyncio

    from stoker.actor.policy import BatchedSampler

    everything = sampler(8).warm_up(8)
    batcher = BatchedSampler(sampler(8), max_call_tokens=64)
    compiled = batcher.warm_up(concurrency=8)
    assert 0 < compiled < everything  # 8 rows of width 16+ exceed 64 tokens: never called

    async def episode(i: int) -> None:
        prompt = [1 + i, 2, 3]
        for turn in range(4):
            sampled = await batcher.generate(prompt, max_new_tokens=2, stop_token_ids=(), session=f"e{i}")
            prompt = prompt + sampled.token_ids + [5 + turn] * (1 + 4 * turn * (i % 3))

    async def play_all() -> None:
        first = asyncio.gather(*(episode(i) for i in range(4)))
        await asyncio.sleep(0)
        await batcher.load_weights(flatten_params(init_model(CONFIG, seed=9)), 1)
        await asyncio.gather(first, *(episode(i) for i in range(4, 8)))
        await batcher.close()

    asyncio.run(play_all())
    assert batcher.stats.calls > 0 and max(batcher.stats.sizes) > 2
    assert batcher.sampler.compile_count == compiled, "a call compiled a program the warm-up did not"


@pytest.mark.parametrize("sessions", [4, 0], ids=["conversation-cache", "no-cache"])
def test_on_an_accelerator_a_call_of_a_new_smaller_shape_runs_on_a_program_already_compiled(sessions: int) -> None:
    """``reuse_compiled`` (a sampler off the CPU): after a call of 4 rows of long prompts, calls of
    fewer rows and shorter prompts compile nothing, and at temperature 0 give the tokens and
    log-probs a sampler of their own shapes gives; on the CPU (the default there) they compile."""
    def calls(s: Sampler) -> list[tuple[list[int], list[float]]]:
        out = []
        for rows, length in ((4, 20), (1, 3), (3, 5)):
            batch = [[1 + i] * length for i in range(rows)]
            names = [f"c{i}-{rows}" for i in range(rows)] if sessions else None
            out += [(g.token_ids, g.logprobs) for g in s.generate(batch, max_new_tokens=3, sessions=names, temperature=0.0)]
        return out

    reusing, own_shapes = sampler(sessions), sampler(sessions)
    assert not own_shapes.reuse_compiled  # the CPU's default
    reusing.reuse_compiled = True
    got, want = calls(reusing), calls(own_shapes)
    assert reusing.compile_count == 1 and own_shapes.compile_count == 3
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
