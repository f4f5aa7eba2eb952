"""What the stuck-group unlikelihood term costs a GRPO step (ratio in one run).

    .venv/bin/python benchmarks/stuck_loss_cost.py [--vocab 32768] [--tokens 256] [--repeats 7]

``log(1 - pi(y))`` for stuck groups' tokens is a second pass over the [B, T, V] logits (a one-hot
and a log-sum-exp over the vocabulary), so the learner computes it only for batches that hold a
stuck token. Two batches of the same shape, 4 groups x 8 episodes: one where every group has a
reward spread (no stuck token: the pass is skipped), one where a group is stuck (the pass runs,
as it did on every step before). Train steps alternate between them; medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

import numpy as np

from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import tiny_spec
from stoker.spec import TransformerConfig
from stoker.trajectory import Episode


def group(task: str, rewards: list[float], tokens: int, vocab: int, rng: np.random.Generator) -> Group:
    prompt = tokens // 2
    return Group([
        Episode(
            episode_id=uuid.uuid4().hex, group_id=uuid.uuid4().hex, group_size=len(rewards), task_id=task,
            token_ids=rng.integers(0, vocab, tokens).astype(np.int32),
            loss_mask=np.asarray([0] * prompt + [1] * (tokens - prompt), np.uint8),
            logprobs=np.asarray([0.0] * prompt + [-1.0] * (tokens - prompt), np.float32),
            policy_versions=np.asarray([-1] * prompt + [0] * (tokens - prompt), np.int32),
            reward=r, status=1,
        )
        for r in rewards
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per episode")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    spec = tiny_spec(
        model={"architecture": TransformerConfig(vocab_size=args.vocab)},
        learner={"sequenceBuckets": [args.tokens], "microbatchTokens": 4096},
        buffer={"maxStaleness": 1_000_000},  # the same version-0 episodes train at every step
    )
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None), resume=False)
    spread = [0.0, 1.0] * 4

    def batch(stuck: bool) -> list[Group]:
        groups = [group(f"t{i}", spread, args.tokens, args.vocab, rng) for i in range(4)]
        if stuck:  # t0 has reached 1.0 before (the spread batches): all-zero is stuck, not solved
            groups[0] = group("t0", [0.0] * 8, args.tokens, args.vocab, rng)
        return groups

    for stuck in (False, True):  # compiles; records t0's best reward
        learner.train_on(batch(stuck))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for stuck in (False, True):
            groups = batch(stuck)
            started = time.perf_counter()
            metrics = learner.train_on(groups)
            times[stuck].append(time.perf_counter() - started)
            assert metrics.get("stuck_groups", 0) == int(stuck), metrics.get("stuck_groups")
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"vocab {args.vocab}, 32 episodes x {args.tokens} tokens, medians of {args.repeats} steps each")
    print(f"  no stuck token (pass skipped):   {without * 1000:8.1f} ms")
    print(f"  a stuck group (pass computed):   {with_ * 1000:8.1f} ms   ({with_ / without:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
