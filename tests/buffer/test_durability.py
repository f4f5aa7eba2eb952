"""Real processes: several writer processes and one reader lose and duplicate nothing, and a
``kill -9`` of the buffer under load loses no acknowledged trajectory and redelivers none twice."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.buffer.client import BufferClient, BufferClientError, LeaseLostError, RetryPolicy
from stoker.trajectory import Episode

WRITER = """
import sys
import numpy as np
from stoker.buffer.client import BufferClient
from stoker.trajectory import Episode

address, index, groups, group_size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def episode(group, k):
    mask = np.ones(16, np.uint8)
    return Episode(episode_id=f"w{index}-g{group}-e{k}", group_id=f"w{index}-g{group}", group_size=group_size,
                   task_id="t", token_ids=np.full(16, index * 1000 + group, np.int32), loss_mask=mask,
                   logprobs=np.full(16, -0.1, np.float32), policy_versions=np.zeros(16, np.int32))

with BufferClient(address, client_id=f"writer-{index}") as client, open(out, "w") as acked:
    client.wait_ready(30)
    for group in range(groups):
        batch = [episode(group, k) for k in range(group_size)]
        client.put(batch)
        if group % 5 == 0:
            assert client.put(batch).duplicates == group_size  # a retried batch is not stored twice
        acked.write("".join(f"{e.episode_id}\\n" for e in batch))
        acked.flush()
"""


def test_writer_processes_and_a_reader_lose_and_duplicate_nothing(
    buffer_process: Callable[..., Any], tmp_path: Path
) -> None:
    server = buffer_process(group_size=4)
    writers, groups = 3, 40
    outputs = [tmp_path / f"acked-{i}.txt" for i in range(writers)]
    processes = [
        subprocess.Popen([sys.executable, "-c", WRITER, server.address, str(i), str(groups), "4", str(out)])
        for i, out in enumerate(outputs)
    ]
    delivered: Counter[str] = Counter()
    with BufferClient(server.address, learner_id="reader") as reader:
        while sum(delivered.values()) < writers * groups * 4:
            batch = reader.sample(8, 1, timeout=30)
            assert batch is not None, "writers stalled"
            for group in batch.groups:
                ids = [e.episode_id for e in group.episodes]
                assert len(ids) == 4 and len({i.rsplit("-e", 1)[0] for i in ids}) == 1  # whole groups only
                delivered.update(ids)
            reader.commit(batch.batch_id)
        stats = reader.stats()
    for process in processes:
        assert process.wait(60) == 0
    acked = [line for out in outputs for line in out.read_text().split()]
    assert len(acked) == writers * groups * 4
    assert set(delivered) == set(acked)
    assert max(delivered.values()) == 1
    assert stats.duplicates_total == writers * (groups // 5) * 4
    assert stats.stored_trajectories == 0


def make(writer: int, group: int, k: int, tokens: int) -> Episode:
    mask = np.ones(tokens, np.uint8)
    return Episode(
        episode_id=f"w{writer}-g{group}-e{k}",
        group_id=f"w{writer}-g{group}",
        group_size=2,
        task_id="t",
        token_ids=np.arange(tokens, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.full(tokens, -0.2, np.float32),
        policy_versions=np.zeros(tokens, np.int32),
    )


# 8,192 tokens: a Put of four is ~425 KB, which the log writes with O_DIRECT (stoker.buffer.wal).
@pytest.mark.parametrize("tokens", [32, 8192])
def test_kill_9_under_load_then_restart_delivers_every_acknowledged_trajectory_once(
    buffer_process: Callable[..., Any], tmp_path: Path, tokens: int
) -> None:
    data = tmp_path / "data"
    server = buffer_process(data)
    fail_fast = RetryPolicy(initial=0.01, maximum=0.05, deadline=0.5)
    acked: list[str] = []
    committed: list[str] = []  # commit acknowledged: must never come back
    in_doubt: list[str] = []  # commit sent, answer lost in the crash: may or may not come back
    lock = threading.Lock()
    loaded = threading.Event()

    def writer(index: int) -> None:
        with BufferClient(server.address, retry=fail_fast) as client:
            group = 0
            while True:
                batch = [make(index, group, k, tokens) for k in range(2)] + [make(index, group + 1, k, tokens) for k in range(2)]
                try:
                    client.put(batch)
                except BufferClientError:
                    return  # the server is gone
                with lock:
                    acked.extend(e.episode_id for e in batch)
                    if len(acked) >= 400:
                        loaded.set()
                group += 2

    def reader() -> None:
        with BufferClient(server.address, learner_id="learner", retry=fail_fast) as client:
            while True:
                try:
                    batch = client.sample(4, 1, timeout=0.5)
                except BufferClientError:
                    return
                if batch is None:
                    continue
                ids = [e.episode_id for e in batch.episodes]
                try:
                    client.commit(batch.batch_id)
                except (BufferClientError, LeaseLostError):
                    in_doubt.extend(ids)
                    return
                committed.extend(ids)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)] + [threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    assert loaded.wait(60), "no load built up"
    server.kill()  # kill -9 while writers and the reader are busy
    for thread in threads:
        thread.join(30)
    assert committed, "the reader should have committed something before the crash"

    restarted = buffer_process(data)
    drained: list[str] = []
    with BufferClient(restarted.address, learner_id="learner") as client:
        while (batch := client.sample(16, 1, timeout=0.5)) is not None:
            drained.extend(e.episode_id for e in batch.episodes)
            client.commit(batch.batch_id)
        stats = client.stats()
    # drained; at most one batch per writer torn by the kill (never acknowledged) stays incomplete
    assert stats.complete_groups == 0 and stats.incomplete_groups <= 3
    assert len(drained) == len(set(drained)), "a trajectory was delivered twice after the restart"
    assert not set(committed) & set(drained), "a committed trajectory came back"
    missing = set(acked) - set(committed) - set(drained) - set(in_doubt)
    assert not missing, f"{len(missing)} acknowledged trajectories lost"
    assert restarted.stop() == 0
