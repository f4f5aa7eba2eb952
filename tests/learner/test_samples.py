"""Decoded sample episodes (samples.jsonl and TensorBoard text) and the batch's generation figures."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from stoker.conversation.tokenization import byte_tokenizer
from stoker.learner.batches import Group, generation_figures, prepare_groups
from stoker.learner.metrics import MetricsSink
from stoker.learner.samples import SAMPLES_FILE, SampleLog, attach_samples, decode_episode, turns
from stoker.spec import RLJobSpec
from stoker.trajectory import Episode
from stoker.v1 import trajectory_pb2

TOKENIZER = byte_tokenizer()


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def decode(token_ids: list[int]) -> str:
    return str(TOKENIZER.decode(list(token_ids), skip_special_tokens=False))


def chat_episode(parts: list[tuple[str, str]], reward: float, status: int = trajectory_pb2.EPISODE_STATUS_OK) -> Episode:
    """(observation, model answer) per turn, as a trajectory: context masked out, answers in."""
    tokens: list[int] = []
    mask: list[int] = []
    for observation, answer in parts:
        tokens += ids(observation)
        mask += [0] * len(ids(observation))
        tokens += ids(answer)
        mask += [1] * len(ids(answer))
    n = len(tokens)
    return Episode(
        episode_id=f"e{reward}", group_id="g", group_size=2, task_id="sum-3",
        token_ids=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, np.uint8),
        logprobs=np.where(np.asarray(mask) > 0, -0.5, 0.0).astype(np.float32), policy_versions=np.zeros(n, np.int32),
        reward=reward, turn_rewards=[reward / len(parts)] * len(parts), status=status, num_turns=len(parts),
    )


def test_an_episode_decodes_to_its_prompt_completion_and_turns() -> None:
    episode = chat_episode([("What is 3+5? ", "8 8 8"), ("\nNo. Again: ", "8")], 0.0)
    assert [(decode(c), decode(m)) for c, m in turns(episode)] == [("What is 3+5? ", "8 8 8"), ("\nNo. Again: ", "8")]
    record = decode_episode(episode, decode)
    assert record["prompt"] == "What is 3+5? "
    assert record["completion"] == "8 8 8\nNo. Again: 8"
    assert record["turns"][1] == {"context": "\nNo. Again: ", "model": "8"}
    assert record["num_turns"] == 2 and record["sampled_tokens"] == len(ids("8 8 8")) + 1
    assert record["turn_rewards"] == [0.0, 0.0]


def read_texts(directory: Path) -> dict[tuple[str, int], str]:
    out: dict[tuple[str, int], str] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.tensor.string_val:
                    out[(value.tag.removesuffix("/text_summary"), event.step)] = value.tensor.string_val[0].decode()
    return out


def test_every_nth_step_logs_the_best_and_the_worst_episode(tmp_path: Path) -> None:
    good = chat_episode([("3+5=", "8")], 1.0)
    bad = chat_episode([("3+5=", "8 8 8 8 8 8")], -1.0, trajectory_pb2.EPISODE_STATUS_TRUNCATED)
    middle = chat_episode([("3+5=", "7")], 0.0)
    with MetricsSink(tmp_path / "learner_metrics.jsonl") as sink:
        sink.attach_samples(SampleLog(tmp_path / SAMPLES_FILE, decode, every=2))
        for step in (1, 2, 3, 4):
            sink.record_episodes(step, [middle, bad, good])
    records = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in records] == [(2, "best"), (2, "worst"), (4, "best"), (4, "worst")]
    assert records[0]["completion"] == "8" and records[0]["reward"] == 1.0
    assert records[1]["completion"] == "8 8 8 8 8 8" and records[1]["status"] == trajectory_pb2.EPISODE_STATUS_TRUNCATED
    texts = read_texts(tmp_path / "tensorboard")
    assert set(texts) == {("samples/best", 2), ("samples/worst", 2), ("samples/best", 4), ("samples/worst", 4)}
    assert "8 8 8 8 8 8" in texts[("samples/worst", 4)] and "reward -1.000" in texts[("samples/worst", 4)]


def test_samples_are_off_at_zero_and_on_by_default(tmp_path: Path) -> None:
    off = RLJobSpec.model_validate({"learner": {"logSamplesEverySteps": 0}})
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        attach_samples(sink, off, tmp_path)
        sink.record_episodes(10, [chat_episode([("a", "b")], 1.0)])
    assert not (tmp_path / SAMPLES_FILE).exists()
    assert RLJobSpec().learner.log_samples_every_steps == 10
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        attach_samples(sink, RLJobSpec(), tmp_path)  # the job's own tokenizer decodes
        sink.record_episodes(10, [chat_episode([("a", "b")], 1.0)])
    assert (tmp_path / SAMPLES_FILE).exists()


def test_sampled_tokens_count_groups_that_do_not_train() -> None:
    """A batch whose groups have no reward spread trains on nothing, yet it was generated."""
    flat = Group([chat_episode([("3+5=", "8 8")], 0.0), chat_episode([("3+5=", "8 8")], 0.0)])
    spread = Group([chat_episode([("1+1=", "2")], 1.0), chat_episode([("1+1=", "3 3 3")], 0.0, trajectory_pb2.EPISODE_STATUS_TRUNCATED)])
    failed = Group([chat_episode([("x", "y")], 0.0, trajectory_pb2.EPISODE_STATUS_FAILED), chat_episode([("1+1=", "2")], 1.0)])
    prepared = prepare_groups([flat, spread, failed], "grpo")
    figures = prepared.episode_metrics
    sampled = 2 * len(ids("8 8")) + len(ids("2")) + len(ids("3 3 3")) + len(ids("y")) + len(ids("2"))
    assert figures["sampled_tokens"] == sampled
    assert figures["completion_tokens_mean"] == pytest.approx(sampled / 6)
    assert figures["truncation_rate"] == pytest.approx(1 / 6)
    assert figures["failed_episodes"] == 1 and figures["turns_mean"] == 1.0
    trained = sum(int(seq.loss_mask.sum()) for item in prepared.items for seq in item)
    assert trained < sampled  # the flat group and the failed episode are generated, not trained


def test_a_batch_says_how_long_its_groups_took_and_waited() -> None:
    """The loop's latency from the episodes' clocks: a group spans its first episode's start to its
    last one's end, and waits from that end to its training; both are means over the groups."""
    def timed(group: str, start: float, end: float) -> Episode:
        return dataclasses.replace(chat_episode([("1+1=", "2")], 1.0), group_id=group, started_unix=start, finished_unix=end)

    episodes = [timed("a", 100.0, 101.0), timed("a", 100.5, 103.0), timed("b", 102.0, 102.5)]
    figures = generation_figures(episodes, now=104.0)
    assert figures["group_seconds"] == pytest.approx(((103.0 - 100.0) + (102.5 - 102.0)) / 2)
    assert figures["group_wait_seconds"] == pytest.approx(((104.0 - 103.0) + (104.0 - 102.5)) / 2)
    # Episodes without clock times (older actors) give no latency rather than a wrong one.
    assert "group_seconds" not in generation_figures([chat_episode([("1+1=", "2")], 1.0)], now=104.0)
