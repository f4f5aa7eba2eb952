"""The engine driven inline (no gRPC, no thread): segments, admission and its load figures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.rollout.sampling import Generation, Sampler
from stoker.rollout.turns import EngineBusy, TurnResult

from .conftest import MAX_BATCH, make_engine, teacher_forced, weights

pytestmark = pytest.mark.slow


def test_turns_beyond_the_batch_wait_are_admitted_as_others_finish_and_stats_add_up(xla_cache: Path) -> None:
    now = [100.0]
    turns = 2 * MAX_BATCH  # twice the batch: half wait in the queue
    engine = make_engine(max_queue=turns, segment_tokens=2, clock=lambda: now[0])
    answers: dict[str, TurnResult | BaseException] = {}
    for i in range(turns):
        # Short turns finish in one segment, long ones take three: short ones free slots first.
        engine.submit([1 + i % 5, 2], max_new_tokens=2 if i % 2 else 6, stop_token_ids=(), session=f"s{i}",
                      pin_weights=False, on_done=lambda r, key=f"s{i}": answers.__setitem__(key, r))
    with pytest.raises(EngineBusy) as busy:
        engine.submit([1], max_new_tokens=1, stop_token_ids=(), session="late", pin_weights=False, on_done=print)
    assert busy.value.retry_after_ms >= 50
    stats = engine.stats()
    assert (stats.queue_depth, stats.running, stats.rejected_total) == (turns, 0, 1)

    engine.step()
    now[0] += 1.0
    stats = engine.stats()
    # The first segment: a full batch, two tokens each; the short half answered already.
    assert stats.running == MAX_BATCH // 2 and stats.queue_depth == MAX_BATCH
    assert len(answers) == MAX_BATCH // 2 and stats.batch_occupancy == 1.0
    assert stats.tokens_per_second == pytest.approx(2 * MAX_BATCH / 1.0)
    engine.step()  # the freed slots are taken by queued turns (whose short half then finishes)
    assert engine.stats().queue_depth == MAX_BATCH // 2 and len(answers) == MAX_BATCH // 2 + MAX_BATCH // 4
    while len(answers) < turns:
        engine.step()
    results = [answers[f"s{i}"] for i in range(turns)]
    assert all(isinstance(r, TurnResult) for r in results)
    assert [len(r.token_ids) for r in results if isinstance(r, TurnResult)] == [6 if i % 2 == 0 else 2 for i in range(turns)]
    # Every conversation stays cached between turns while rows last (here all of them).
    stats = engine.stats()
    assert stats.kv_cache_bytes_used == stats.kv_cache_bytes_total == 2 * MAX_BATCH * engine.sampler.session_row_nbytes


def test_a_turn_keeps_its_weights_and_the_next_turn_moves_unless_pinned(xla_cache: Path) -> None:
    engine = make_engine(segment_tokens=2)
    answers: dict[str, TurnResult | BaseException] = {}
    conversations = {"moves": [1, 2, 4], "pinned": [2, 1, 4]}

    def turn(session: str) -> None:
        engine.submit(conversations[session], max_new_tokens=6, stop_token_ids=(), session=session,
                      pin_weights=session == "pinned", on_done=lambda r: answers.__setitem__(session, r))

    def finish() -> None:
        while len(answers) < 2:
            engine.step()
        for session, result in answers.items():
            assert isinstance(result, TurnResult)
            conversations[session] = conversations[session] + result.token_ids + [5, 6]

    for session in conversations:
        turn(session)
    engine.step()  # two of six tokens sampled: both turns are mid-way when new weights arrive
    engine.load_weights(weights(1), 1)
    finish()
    first = dict(answers)
    assert all(r.versions == [0] * 6 for r in first.values() if isinstance(r, TurnResult))
    answers.clear()
    for session in conversations:
        turn(session)
    finish()
    second = {s: r.versions for s, r in answers.items() if isinstance(r, TurnResult)}
    assert second == {"moves": [1] * 6, "pinned": [0] * 6}
    # The log-probs of both turns are the model's under the versions reported.
    for session, ids in conversations.items():
        recorded = [*first[session].logprobs, *answers[session].logprobs]  # type: ignore[union-attr]
        versions = [*first[session].versions, *answers[session].versions]  # type: ignore[union-attr]
        positions = [*range(3, 9), *range(11, 17)]
        for version in set(versions):
            [model] = teacher_forced(version, [ids[:17]])
            mine = [i for i, v in enumerate(versions) if v == version]
            assert np.allclose(model[[positions[i] - 1 for i in mine]], [recorded[i] for i in mine], atol=2e-4)


@dataclass
class _Call:
    sessions: list[str]
    widths: list[int]  # each prompt's uncached part, padded to its chunk bucket, when called
    max_new_tokens: int
    computed: tuple[int, int] = (0, 0)  # (rows, chunk width) of the program it ran


class _RecordingSampler(Sampler):
    """A real sampler that records what each call asks of it and the shape its program computed."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.calls: list[_Call] = []
        program: Any = self._jit_continue

        def recorded(state: Any, store: Any, rows: Any, sources: Any, chunk_ids: Any, *rest: Any, **kw: Any) -> Any:
            self.calls[-1].computed = chunk_ids.shape
            return program(state, store, rows, sources, chunk_ids, *rest, **kw)

        self._jit_continue = recorded

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, **options: Any) -> list[Generation]:
        sessions = list(options["sessions"])
        widths = [self.prefill_bucket(s, p) for s, p in zip(sessions, prompts, strict=True)]
        self.calls.append(_Call(sessions, widths, max_new_tokens))
        return super().generate(prompts, max_new_tokens=max_new_tokens, **options)


def test_a_long_new_turn_is_prefilled_apart_and_never_widens_the_decoding_rows_call(xla_cache: Path) -> None:
    engine = make_engine(segment_tokens=2, sampler_class=_RecordingSampler, prefill_apart_above=16)
    sampler = engine.sampler
    assert isinstance(sampler, _RecordingSampler)
    answers: dict[str, TurnResult | BaseException] = {}
    prompts = {f"decoder-{i}": [1 + i, 2, 4] for i in range(3)} | {"agent": [3, 1, 4]}

    def submit(session: str, max_new_tokens: int) -> None:
        engine.submit(prompts[session], max_new_tokens=max_new_tokens, stop_token_ids=(), session=session,
                      pin_weights=session == "agent", on_done=lambda r: answers.__setitem__(session, r))

    for session in list(prompts):
        submit(session, 2 if session == "agent" else 8)
    engine.step()  # the agent's first turn is answered; the decoders are mid-turn
    first = answers.pop("agent")
    assert isinstance(first, TurnResult)
    engine.load_weights(weights(1), 1)  # the agent pins its episode to version 0
    # Its next turn carries a tool's long output: 41 tokens uncached (with its last sampled token).
    prompts["agent"] = prompts["agent"] + first.token_ids + [(5 * j) % 29 + 1 for j in range(40)]
    submit("agent", 4)
    while len(answers) < 4:
        engine.step()

    agent_calls = [c for c in sampler.calls if "agent" in c.sessions][1:]
    # Its prefill: a call of its own, one row, sampling its first token.
    assert (agent_calls[0].sessions, agent_calls[0].widths) == (["agent"], [64])
    assert (agent_calls[0].max_new_tokens, agent_calls[0].computed) == (1, (1, 64))
    # Then it decodes with the others from its cached prompt: one token uncached.
    assert set(agent_calls[1].sessions) == {*prompts} and agent_calls[1].computed == (MAX_BATCH, 1)
    # No call of the decoding rows was ever wider than the threshold, nor padded otherwise.
    decoding = [c for c in sampler.calls if "decoder-0" in c.sessions]
    assert all(c.computed[0] == MAX_BATCH and c.computed[1] <= 16 for c in decoding)
    # Every token is the model's under the version it started with (the agent's is pinned, the
    # decoders' turns began before the swap): log-probs equal a teacher-forced forward.
    for session, prompt in prompts.items():
        result = answers[session]
        assert isinstance(result, TurnResult) and result.versions == [0] * len(result.token_ids)
        [model] = teacher_forced(0, [prompt + result.token_ids])
        np.testing.assert_allclose(model[len(prompt) - 1:], result.logprobs, atol=2e-4)
    [model] = teacher_forced(0, [prompts["agent"]])
    np.testing.assert_allclose(model[2:4], first.logprobs, atol=2e-4)
