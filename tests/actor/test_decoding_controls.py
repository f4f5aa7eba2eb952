"""Stop strings, a per-episode sampled-token budget, and allowedTokens written as text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import OK, TRUNCATED, EpisodeLimits, run_episode
from stoker.actor.policy import ScriptedPolicy
from stoker.conversation.tokenization import EOT, TextInterface, TokenizerProblem, allowed_token_ids, byte_tokenizer
from stoker.model.tokenizer import save_tokenizer, train_word_tokenizer
from stoker.spec import RLJobSpec

pytestmark = pytest.mark.asyncio

TOKENIZER = byte_tokenizer()
INTERFACE = TextInterface(TOKENIZER, (), (), (TOKENIZER.token_to_id(EOT),))


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


class Echo:
    """Records each action; ends after ``turns`` steps."""

    def __init__(self, turns: int = 1):
        self.actions: list[str] = []
        self.turns = turns

    async def reset(self, task_id: str, seed: int) -> Observation:
        return Observation("Q: 3+5?\n")

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        return StepResult(Observation("again\n"), 1.0, terminated=len(self.actions) >= self.turns)

    async def close(self) -> None:
        return None


async def test_a_turn_ends_at_its_first_stop_string_and_keeps_exactly_what_was_sampled() -> None:
    answer = ids("It is 8.\nUser: and 9?")
    logprobs = [-0.1 * (i + 1) for i in range(len(answer))]

    class Scripted(ScriptedPolicy):
        async def generate(self, prompt: Sequence[int], **kwargs: object):  # type: ignore[no-untyped-def,override]
            sampled = await super().generate(prompt, **kwargs)  # type: ignore[arg-type]
            sampled.logprobs = logprobs[: len(sampled.token_ids)]
            return sampled

    env = Echo()
    limits = EpisodeLimits(max_turns=2, max_new_tokens=64, max_tokens=256, stop_strings=("\nUser:", "###"))
    episode = await run_episode(Scripted(lambda _: answer), env, INTERFACE, "t", seed=0, limits=limits)  # type: ignore[arg-type]
    assert episode.status == OK
    assert env.actions == ["It is 8.\nUser:"]  # the environment sees the text up to the stop string
    kept = len(ids("It is 8.\nUser:"))
    sampled = episode.token_ids[episode.loss_mask.astype(bool)]
    assert sampled.tolist() == answer[:kept]  # a prefix of the sampled ids ...
    np.testing.assert_allclose(episode.logprobs[episode.loss_mask.astype(bool)], logprobs[:kept], rtol=1e-6)  # ... with their log-probs


async def test_without_a_stop_string_in_the_text_nothing_is_cut() -> None:
    answer = ids("It is 8.")
    limits = EpisodeLimits(max_turns=1, max_new_tokens=64, max_tokens=256, stop_strings=("\nUser:",))
    episode = await run_episode(ScriptedPolicy(lambda _: answer), Echo(), INTERFACE, "t", seed=0, limits=limits)  # type: ignore[arg-type]
    assert episode.token_ids[episode.loss_mask.astype(bool)].tolist() == answer


async def test_the_episode_token_budget_shrinks_the_last_turn_then_truncates() -> None:
    policy = ScriptedPolicy(lambda _: ids("abcde"))
    asked: list[int] = []
    generate = policy.generate

    async def spy(prompt: Sequence[int], *, max_new_tokens: int, **kwargs: object):  # type: ignore[no-untyped-def]
        asked.append(max_new_tokens)
        return await generate(prompt, max_new_tokens=max_new_tokens, **kwargs)  # type: ignore[arg-type]

    policy.generate = spy  # type: ignore[method-assign]
    limits = EpisodeLimits(max_turns=10, max_new_tokens=5, max_tokens=512, max_sampled_tokens=12)
    episode = await run_episode(policy, Echo(turns=10), INTERFACE, "t", seed=0, limits=limits)
    assert asked == [5, 5, 2]
    assert int(episode.loss_mask.sum()) == 12
    assert episode.status == TRUNCATED and episode.status_reason == "token budget (12 sampled tokens per episode)"


async def test_allowed_tokens_accept_text_as_well_as_vocabulary_spellings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokenizer = train_word_tokenizer(["8 9 10 plus"], kind="bpe", vocab_size=60)
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    vocab = tokenizer.get_vocab()
    spec = RLJobSpec.model_validate({
        "environment": {"name": "answers"},
        "model": {"tokenizer": str(tmp_path / "tokenizer.json")},
        "actors": {"sampling": {"allowedTokens": ["8</w>", "plus"]}},
    })
    assert "plus" not in vocab  # only its end-of-word spelling is
    got = allowed_token_ids(spec)
    assert got == tuple(sorted({vocab["8</w>"], vocab["plus</w>"]}))
    bad = spec.model_copy(update={"actors": spec.actors.model_copy(update={
        "sampling": spec.actors.sampling.model_copy(update={"allowed_tokens": ["8 9 10"]})})})
    with pytest.raises(TokenizerProblem, match="not single tokens"):
        allowed_token_ids(bad)
