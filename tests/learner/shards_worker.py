"""One process of the sharded-weights tests (``test_shard_publish.py`` runs it).

    python shards_worker.py learn OUT --devices D --mesh FSDPxTP [--die-after K]
    python shards_worker.py read OUT --devices D --tp N --source grpc|dir --version V

``learn``: a learner process (topology from ``STOKER_*``): checks that the random init and
``OUT/checkpoint`` load straight into the training sharding; then a bfloat16 model in a ``Trainer`` on an
fsdp x tp mesh over every process's devices publishes version 1 (its init) and version 2 (every
parameter + 1) with a ``ShardedPublisher`` (directory and peer gRPC), writes
``OUT/learn-<i>.json`` (its publish stats, server port) and serves until ``OUT/readers-done``
appears. ``--die-after K``: process 1 dies after writing K shards of version 2.
``read``: a rollout process: a ``Sampler`` on a ``tp`` mesh (every reader process's devices)
loads version V from the channel; writes ``OUT/read-<i>.json``: whether every parameter's every
shard equals the reference, the bytes read and the bytes its devices need.
"""

from __future__ import annotations

import argparse
import os
import sys

CONFIG = dict(vocab_size=64, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=512, max_seq_len=64)
BLOCK_BYTES = 512  # small checksum blocks, so reads of these tiny tensors are by row range


def reference(version: int) -> dict:
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from stoker.model.hf import to_hf
    from stoker.model.model import init_model
    from stoker.spec import TransformerConfig

    flat = to_hf(init_model(TransformerConfig(**CONFIG), 0, jnp.bfloat16))
    if version == 2:
        flat = {k: (v.astype(np.float32) + 1).astype(ml_dtypes.bfloat16) for k, v in flat.items()}
    return flat


def learn(args: argparse.Namespace) -> int:
    import functools
    import json
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from stoker.model.hf import hf_name, load_checkpoint, param_items
    from stoker.learner import sharding, train
    from stoker.weights.publish import ShardedPublisher
    from stoker.model.model import init_model
    from stoker.weights.shards import ShardDirectory
    from stoker.spec import TransformerConfig

    out = Path(args.out)
    me = jax.process_index()
    fsdp, tp = (int(x) for x in args.mesh.split("x"))
    mesh = sharding.make_mesh(fsdp, tp)
    placement = functools.partial(sharding.param_sharding, mesh=mesh)
    config = TransformerConfig(**CONFIG)
    model = init_model(config, 0, jnp.bfloat16, placement=placement)  # as the Learner inits: in place
    stats: dict = {"process": me, "versions": {}}
    want = reference(1)
    for label, placed in (("init", model), ("checkpoint", load_checkpoint(out / "checkpoint", dtype=jnp.bfloat16, placement=placement))):
        in_place = True
        for path, var in param_items(placed):
            name, transpose = hf_name(path)
            value, full = var.get_value(), (want[name].T if transpose else want[name])
            in_place &= value.sharding.is_equivalent_to(placement(tuple(value.shape)), value.ndim)
            for shard in value.addressable_shards:
                in_place &= np.asarray(shard.data).tobytes() == np.ascontiguousarray(full[shard.index]).tobytes()
        stats[f"{label}_in_place"] = bool(in_place)
    trainer = train.Trainer(model, train.StepOptions("grpo"), optax.sgd(0.1), mesh)
    publisher = ShardedPublisher(
        directory=str(out / "weights"), address="127.0.0.1:0", commit_timeout_s=30.0, block_bytes=BLOCK_BYTES
    )
    stats["port"] = publisher.port
    # The publish program keeps the training sharding: no device holds more than its shard.
    copy = trainer.policy_copy()
    stats["copy_keeps_training_sharding"] = all(
        c.sharding.is_equivalent_to(p.sharding, c.ndim)
        for c, p in zip(jax.tree.leaves(copy), jax.tree.leaves(trainer.params["policy"]), strict=True)
    )
    publisher.publish(1, trainer.policy_model(copy))
    stats["versions"]["1"] = vars(publisher.stats)
    trainer.params = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), out_shardings=trainer.param_shardings)(trainer.params)
    if args.die_after is not None and me == 1:
        written = {"n": 0}
        real = ShardDirectory.write_shard

        def dying(self, *a, **kw):  # type: ignore[no-untyped-def]
            if written["n"] == args.die_after:
                os._exit(17)
            written["n"] += 1
            return real(self, *a, **kw)

        ShardDirectory.write_shard = dying  # type: ignore[method-assign]
    try:
        publisher.publish(2, trainer.policy_model(trainer.policy_copy()))
        stats["versions"]["2"] = vars(publisher.stats)
    except RuntimeError as exc:
        stats["publish_error"] = str(exc)
    stats["held_bytes"] = publisher.held_bytes()
    (out / f"learn-{me}.json").write_text(json.dumps(stats))
    deadline = time.monotonic() + 300
    while not (out / "readers-done").exists() and "publish_error" not in stats and time.monotonic() < deadline:
        time.sleep(0.1)  # serve the readers until the test says they are done
    publisher.close()
    jax.distributed.shutdown()  # together: the coordination service lives in process 0
    return 0


def read(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    from stoker.model.hf import hf_name, param_items
    from stoker.weights.channel import WeightSubscriber
    from stoker.rollout.mesh import rollout_mesh
    from stoker.rollout.sampling import Sampler
    from stoker.spec import SamplingSpec, TransformerConfig

    out = Path(args.out)
    config = TransformerConfig(**CONFIG)
    sampler = Sampler(config, SamplingSpec(), seed=5, buckets=[16], dtype=jnp.bfloat16, mesh=rollout_mesh(config, args.tp))
    if args.source == "dir":
        subscriber = WeightSubscriber(directory=out / "weights")
    else:
        port = json.loads((out / "learn-0.json").read_text())["port"]
        subscriber = WeightSubscriber(address=f"127.0.0.1:{port}")
    assert subscriber.latest_version() == args.version
    weights = subscriber.fetch(args.version)
    sampler.load_weights(weights, args.version)
    want = reference(args.version)
    equal, needed, shards = True, 0, 0
    for path, var in param_items(sampler._model):
        name, transpose = hf_name(path)
        value = var.get_value()
        full = want[name].T if transpose else want[name]
        mask = np.zeros(value.shape, bool)
        for shard in value.addressable_shards:
            got = np.asarray(shard.data)
            equal &= got.dtype == full.dtype and got.tobytes() == np.ascontiguousarray(full[shard.index]).tobytes()
            mask[shard.index] = True
            shards += 1
        needed += int(mask.sum()) * full.dtype.itemsize
    result = {
        "process": jax.process_index(), "equal": bool(equal), "shards_checked": shards, "bytes_read": weights.stats.bytes_read,
        "bytes_needed": needed, "bytes_total": sum(a.nbytes for a in want.values()), "version": sampler.version,
        # bytes over the learners' plain-TCP streams (stoker.weights.shard_stream), and reads they could not finish
        "streamed_bytes": getattr(weights.source, "streamed_bytes", 0), "stream_fallbacks": getattr(weights.source, "fallbacks", 0),
    }
    (out / f"read-{jax.process_index()}.json").write_text(json.dumps(result))
    subscriber.close()
    jax.distributed.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["learn", "read"])
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--mesh", default="1x1")
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--source", choices=["grpc", "dir"], default="grpc")
    parser.add_argument("--version", type=int, default=2)
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    from stoker import distributed

    distributed.initialize()
    return learn(args) if args.role == "learn" else read(args)


if __name__ == "__main__":
    sys.exit(main())
