"""Decoded sample episodes: what the policy actually wrote, every few steps.

Every ``every`` steps the best and the worst episode of the batch (by reward) are decoded with the
job's tokenizer and appended to ``samples.jsonl`` (one record each: step, rank, task, reward and its
per-turn terms, status, turns, the prompt, the completion and every turn's text) and to TensorBoard
as text. Special tokens are kept in the text, so a turn that never emits its end-of-turn token
shows. ``stoker run``'s report shows the newest ones (``stoker.runner.report``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from stoker.conversation.tokenization import environment_tokenizer
from stoker.jsonl import json_line
from stoker.trajectory import Episode

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
MAX_TEXT_CHARS = 8000  # per prompt/completion in the record; the tokens stay in the buffer

Decode = Callable[[Sequence[int]], str]


def turns(episode: Episode) -> list[tuple[list[int], list[int]]]:
    """The episode as (context ids, model ids) per model turn, from its loss mask: a run of
    context tokens followed by the run of sampled tokens after it."""
    ids = np.asarray(episode.token_ids).tolist()
    mask = np.asarray(episode.loss_mask).tolist()
    out: list[tuple[list[int], list[int]]] = []
    context: list[int] = []
    model: list[int] = []
    for token, sampled in zip(ids, mask):
        if sampled:
            model.append(token)
        else:
            if model:
                out.append((context, model))
                context, model = [], []
            context.append(token)
    if model or context:
        out.append((context, model))
    return out


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + f"... [{len(text) - MAX_TEXT_CHARS} more chars]"


def decode_episode(episode: Episode, decode: Decode) -> dict[str, Any]:
    """One episode as text: ``prompt`` (what came before the first model turn), ``completion``
    (everything after it, model turns and later observations), and each turn's pair."""
    pairs = turns(episode)
    prompt = decode(pairs[0][0]) if pairs else ""
    rest: list[int] = []
    for index, (context, model) in enumerate(pairs):
        rest.extend(([] if index == 0 else context) + model)
    return {
        "episode_id": episode.episode_id,
        "task_id": episode.task_id,
        "reward": float(episode.reward),
        "turn_rewards": [float(r) for r in episode.turn_rewards],
        "metrics": dict(episode.metrics),
        "status": int(episode.status),
        "status_reason": episode.status_reason,
        "num_turns": int(episode.num_turns),
        "sampled_tokens": int(np.asarray(episode.loss_mask).sum()),
        "prompt": _clip(prompt),
        "completion": _clip(decode(rest)),
        "turns": [{"context": _clip(decode(c)), "model": _clip(decode(m))} for c, m in pairs],
    }


def best_and_worst(episodes: Sequence[Episode]) -> list[tuple[str, Episode]]:
    """The highest- and lowest-reward episodes that sampled anything (one if they are the same)."""
    candidates = [e for e in episodes if np.asarray(e.loss_mask).any()]
    if not candidates:
        return []
    best = max(candidates, key=lambda e: e.reward)
    worst = min(candidates, key=lambda e: e.reward)
    return [("best", best)] if best is worst else [("best", best), ("worst", worst)]


def as_markdown(record: dict[str, Any]) -> str:
    """A sample for TensorBoard's text tab and the report (fenced, so markup in it stays text)."""
    fence = "````"
    return (
        f"**{record['rank']}** of step {record['step']}: task `{record['task_id']}`, reward {record['reward']:.3f} "
        f"(turns {record['turn_rewards']}), {record['num_turns']} turns, {record['sampled_tokens']} sampled tokens"
        + (f", {record['status_reason']}" if record.get("status_reason") else "")
        + f"\n\nprompt:\n{fence}\n{record['prompt']}\n{fence}\n\ncompletion:\n{fence}\n{record['completion']}\n{fence}\n"
    )


class SampleLog:
    """Appends the decoded best and worst episode of every ``every``-th step to ``path``; 0 = never.

    ``text`` (tag, markdown, step) is where TensorBoard text goes (``MetricsSink.add_text``)."""

    def __init__(self, path: str | Path, decode: Decode, every: int, text: Callable[[str, str, int], None] | None = None):
        self.path = Path(path)
        self.decode = decode
        self.every = every
        self.text = text
        self._file: IO[str] | None = None

    def observe(self, step: int, episodes: Sequence[Episode]) -> list[dict[str, Any]]:
        if self.every <= 0 or step % self.every != 0:
            return []
        records = []
        for rank, episode in best_and_worst(episodes):
            try:
                record = {"step": step, "rank": rank, **decode_episode(episode, self.decode)}
            except Exception as exc:  # noqa: BLE001 - a token the tokenizer cannot decode never stops training
                log.warning("could not decode a sample episode at step %d: %s", step, exc)
                continue
            records.append(record)
        if not records:
            return []
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        for record in records:
            self._file.write(json_line(record))
            if self.text is not None:
                self.text(f"samples/{record['rank']}", as_markdown(record), step)
        self._file.flush()
        return records

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def job_decoder(spec: Any) -> Decode:
    """The job's tokenizer's decode, special tokens kept (the actors' tokenizer: same ids)."""
    tokenizer = environment_tokenizer(spec)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


def attach_samples(sink: Any, spec: Any, run_dir: str | Path) -> None:
    """Give ``sink`` the job's sample log (``spec.learner.logSamplesEverySteps``), unless it is off
    or the tokenizer cannot be loaded (then training goes on without samples, with a warning)."""
    every = int(spec.learner.log_samples_every_steps)
    if every <= 0:
        return
    try:
        decode = job_decoder(spec)
    except Exception as exc:  # noqa: BLE001 - samples are diagnostics: never stop training for them
        log.warning("no sample episodes will be logged: the job's tokenizer did not load (%s)", exc)
        return
    sink.attach_samples(SampleLog(Path(run_dir) / SAMPLES_FILE, decode, every))
