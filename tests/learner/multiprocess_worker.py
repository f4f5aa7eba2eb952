"""One learner process of a multi-process test (``test_multiprocess.py`` runs it).

    python multiprocess_worker.py OUT_DIR --devices D --steps K --mesh FSDPxTP [--mesh FSDPxEPxTP ...]
        [--buffer ADDR] [--resume-only]

The process topology comes from the environment (``STOKER_NUM_PROCESSES`` ...), as in
``stoker learner``. With no ``--buffer`` the primary trains on ``fixed_batches`` from an in-memory
source. The primary writes ``OUT_DIR/<mesh>.npz`` (every parameter after K steps, the published
weights, the per-step losses) and ``<mesh>.json`` (what the buffer and the publisher saw).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mesh", action="append", required=True)
    parser.add_argument("--sharded", action="store_true", help="publish with a ShardedPublisher on every process")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    from stoker import distributed

    distributed.initialize()
    import json
    import uuid
    from pathlib import Path

    import jax
    import numpy as np

    from stoker.buffer.client import SampledBatch, SampledGroup
    from stoker.distributed import Processes
    from stoker.learner import multihost
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.learner.testing import tiny_spec
    from stoker.weights.channel import flatten_params
    from stoker.spec import TransformerConfig
    from stoker.trajectory import Episode

    processes = Processes.current()
    # Big enough that parameters really are split (sharding.MIN_SHARDED_SIZE), small enough for CPU.
    arch = TransformerConfig(
        vocab_size=64, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=512,
        max_seq_len=64,
    )

    def fixed_batches(count: int, seed: int) -> list[SampledBatch]:
        rng = np.random.default_rng(seed)
        batches = []
        for b in range(count):
            groups = []
            for g in range(2):
                episodes = []
                for j in range(4):
                    n = int(rng.integers(5, 28))  # several lengths: packing into both buckets
                    mask = np.zeros(n, np.uint8)
                    mask[3:] = 1
                    episodes.append(
                        Episode(
                            episode_id=f"b{b}g{g}e{j}", group_id=f"b{b}g{g}", group_size=4, task_id=f"t{g}",
                            token_ids=rng.integers(0, arch.vocab_size, n).astype(np.int32), loss_mask=mask,
                            logprobs=np.where(mask > 0, -rng.uniform(0.5, 4.0, n), 0).astype(np.float32),
                            policy_versions=np.where(mask > 0, b, -1).astype(np.int32),
                            reward=float(j % 2) + 0.1 * g, status=1, metrics={"success": float(j % 2)},
                        )
                    )
                groups.append(SampledGroup(f"b{b}g{g}", False, episodes))
            batches.append(SampledBatch(f"batch-{b}-{uuid.uuid4().hex[:6]}", groups, b))
        return batches

    class Source:
        def __init__(self, batches: list[SampledBatch]):
            self.batches, self.sampled, self.committed, self.versions = list(batches), [], [], []

        def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch | None:
            if not self.batches:
                return None
            batch = self.batches.pop(0)
            self.sampled.append(batch.batch_id)
            return batch

        def commit(self, batch_id: str) -> None:
            self.committed.append(batch_id)

        def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
            self.versions.append(version)

    class Publisher:
        def __init__(self) -> None:
            self.published: dict[int, dict[str, np.ndarray]] = {}

        @property
        def latest_version(self) -> int:
            return max(self.published, default=-1)

        def publish(self, version: int, flat: dict[str, np.ndarray]) -> None:
            assert version not in self.published, f"version {version} published twice"
            self.published[version] = flat

    from stoker.weights.publish import ShardedPublisher

    class ShardedRecorder(ShardedPublisher):
        def __init__(self, directory: Path) -> None:
            super().__init__(directory=str(directory), processes=processes)
            self.published: dict[int, Any] = {}

        def publish(self, version: int, model: Any) -> Any:
            self.published[version] = None
            return super().publish(version, model)

    class Sink:
        def __init__(self) -> None:
            self.records: list[dict[str, float]] = []

        def record(self, metrics: dict[str, float]) -> None:
            self.records.append(dict(metrics))

    out = Path(args.out)
    for mesh in args.mesh:
        sizes = [int(x) for x in mesh.split("x")]
        fsdp, ep, tp = sizes if len(sizes) == 3 else (sizes[0], 1, sizes[1])
        # An expert axis needs experts: the same model with every MLP a mixture of 4 (top-2).
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256} if ep > 1 else {}
        spec = tiny_spec(
            model={"architecture": arch.model_copy(update=moe)}, algorithm={"learningRate": 0.01}, buffer={"groupSize": 4},
            learner={"sequenceBuckets": [16, 32], "microbatchTokens": 128, "batchGroups": 2,
                     "mesh": {"fsdp": fsdp, "ep": ep, "tp": tp},
                     "checkpoint": {"intervalSteps": 2}, "publishIntervalSteps": 1, "maxSteps": args.steps},
        )
        settings = LearnerSettings.from_spec(spec, checkpoint_dir=str(out / f"ckpt-{mesh}"))
        learner = Learner(settings)
        # Every process is handed a source, publisher and sink, as every pod gets --buffer; each
        # source holds other batches (as a second buffer client would sample other groups), so a
        # process that sampled for itself would train apart. Only the primary's may be used.
        source = Source(fixed_batches(args.steps, seed=7 + processes.index))
        publisher, sink = (ShardedRecorder(out / f"weights-{mesh}") if args.sharded else Publisher()), Sink()
        made = learner.run(source, publisher, sink=sink)
        if args.sharded:  # what was committed, as a reader fetches it
            from stoker.weights.channel import WeightSubscriber

            with WeightSubscriber(directory=out / f"weights-{mesh}") as subscriber:
                publisher.published[learner.version] = dict(subscriber.fetch(learner.version))
        params = multihost.replicate(processes, learner.trainer.params, learner.mesh)
        final = flatten_params(learner.trainer.policy_model(params["policy"]))
        programs = learner.trainer.compiled_programs()
        learner.close()
        # Orbax restores with every process taking part, onto the same mesh.
        resumed = Learner(settings)
        restored = multihost.replicate(processes, resumed.trainer.params, resumed.mesh)
        restored_flat = flatten_params(resumed.trainer.policy_model(restored["policy"]))
        resumed_at = (resumed.steps, resumed.version)
        resumed.close()
        used = {"sampled": source.sampled, "committed": source.committed, "versions": source.versions,
                "published": sorted(publisher.published), "records": len(sink.records)}
        (out / f"{mesh}-process{processes.index}.json").write_text(json.dumps(used))
        if processes.primary:
            arrays = {f"param/{k}": v for k, v in final.items()}
            arrays.update({f"published/{k}": v for k, v in publisher.published[learner.version].items()})
            arrays.update({f"restored/{k}": v for k, v in restored_flat.items()})
            arrays["loss"] = np.asarray([r["loss"] for r in sink.records], np.float64)
            np.savez(out / f"{mesh}.npz", **arrays)
            report = {
                "made": made, "version": learner.version, "steps": learner.steps, "sampled": source.sampled,
                "committed": source.committed, "versions": source.versions,
                "published": sorted(publisher.published), "records": len(sink.records),
                "programs": programs, "resumed_at": list(resumed_at),
                "embedding_shards": len(jax.tree.leaves(learner.trainer.params)[0].addressable_shards),
                "devices": jax.device_count(), "processes": processes.count,
            }
            (out / f"{mesh}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
