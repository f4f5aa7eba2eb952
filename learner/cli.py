"""``stoker learner``: pull batches from the buffer, train, publish weights, checkpoint.

In ``mode: colocated`` (no ``--buffer``) it runs the synchronous loop instead, playing its own
episodes on its own chips (``stoker.runner.sync``): the operator's colocated learner pod.

    stoker learner --manifest job.yaml --buffer HOST:PORT [--token-file F] --run-dir DIR \\
                   [--weights-dir DIR] [--weights-port P [--weights-stream-port P]] [--max-steps N] [--metrics-port P]

Resumes from the latest checkpoint under the spec's ``learner.checkpoint.dir`` (relative to
``--run-dir``). SIGTERM/SIGINT stop it after the current step with a final checkpoint. Metrics go to
``RUN_DIR/learner_metrics.jsonl`` and, with ``--metrics-port``, to Prometheus.

On a multi-host slice every host runs this same command (``stoker.distributed`` reads the
topology from the environment); only process 0 connects to the buffer and writes metrics, and
weights are published sharded (each process writes or serves its own shards; ``--weights-format``). If another process dies, this one exits with ``EXIT_PEER_FAILED`` at once, without
a final checkpoint: the group restarts from the last one. A write that finds the disk full ends it
with ``EXIT_DISK_FULL`` (``stoker.learner.diskfull``): ``stoker run`` stops the run on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from stoker import chips, distributed
from stoker.distributed import EXIT_PEER_FAILED, PeerFailure
from stoker.endpoints import Address, AddressError, parse, parse_listen
from stoker.learner.diskfull import EXIT_DISK_FULL, no_space
from stoker.manifest import ManifestError, load_job
from stoker.remote_checkpoint import LEARNER

log = logging.getLogger("stoker.learner")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, metavar="FILE", help="RLJob manifest")
    parser.add_argument(
        "--buffer", metavar="ADDR", help="buffer gRPC address HOST:PORT or unix:///PATH (not needed for SFT or DPO on a dataset)"
    )
    parser.add_argument("--token-file", metavar="F", help="file holding the buffer's bearer token (also guards the weights)")
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="checkpoints, metrics and caches go here")
    # Both at once: readers may take either (the operator's pods serve, and write a weights volume).
    parser.add_argument("--weights-dir", metavar="DIR", help="publish weights into this shared directory")
    parser.add_argument(
        "--weights-port", metavar="P|ADDRESS",
        help="serve weights over gRPC on this port, HOST:PORT, or a unix socket unix:///PATH (process i > 0 of a "
        "multi-process learner adds -i to the socket's name)",
    )
    parser.add_argument(
        "--weights-format", choices=["auto", "blob", "shards"], default="auto",
        help="shards: every process publishes only its own shards (stoker.weights.publish); blob: the primary "
        "publishes one safetensors file; auto (default): shards when the learner spans several processes",
    )
    parser.add_argument(
        "--weights-stream-port", type=int, default=0, metavar="P",
        help="sharded weights: each process also streams its shards' bytes over plain TCP on this port "
        "(default 0: a free one, named in the manifest; beside a unix --weights-port, the socket NAME.stream.sock; "
        "readers fall back to gRPC); -1: off",
    )
    parser.add_argument("--max-steps", type=int, metavar="N", help="stop after N total steps (default: spec)")
    parser.add_argument(
        "--metrics-port", default="0", metavar="P|ADDRESS",
        help="serve Prometheus metrics on this port (0: off), HOST:PORT or unix:///PATH",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def process_address(address: Address, process: int) -> Address:
    """Where learner process ``process`` serves its weights: the address itself, or beside a unix
    socket ``NAME.sock`` (which only one process can bind) ``NAME-<process>.sock``."""
    if address.path is None or process == 0:
        return address
    stem = address.path.removesuffix(".sock")
    return Address(path=f"{stem}-{process}.sock")


def _fail(message: str, code: int = 2) -> int:
    print(f"stoker learner: {message}", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except (OSError, RuntimeError, ValueError) as exc:  # tensorstore and XLA wrap a failed write as these
        full = no_space(exc)
        if full is None:
            raise
        _disk_full(full)


def _disk_full(exc: BaseException) -> NoReturn:
    """Leave with ``EXIT_DISK_FULL`` at once: a normal exit would flush logs the disk has no room
    for (Python then exits 120), and ``stoker run`` tells this exit by its code."""
    try:
        print(f"stoker learner: the disk is full: {exc}", file=sys.stderr, flush=True)
    except OSError:
        pass  # the log is on the full disk too; the exit code says it
    os._exit(EXIT_DISK_FULL)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        job = load_job(args.manifest, fetch=LEARNER)
    except ManifestError as exc:
        return _fail(f"invalid manifest:\n{exc}")
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            return _fail(f"--token-file {args.token_file}: {exc.strerror or exc}")
    if args.max_steps is not None and args.max_steps < 1:
        return _fail(f"--max-steps {args.max_steps}; expected >= 1")
    try:
        if args.buffer is not None:
            parse(args.buffer, where="--buffer")
        weights_listen = (
            parse_listen(args.weights_port, where="--weights-port", default_host="0.0.0.0")
            if args.weights_port is not None else None
        )
        metrics_listen = (
            None if args.metrics_port in ("0", "") else parse_listen(args.metrics_port, where="--metrics-port", default_host="0.0.0.0")
        )
        chips.check_free("stoker learner")  # a held TPU: say who holds it, not libtpu's lockfile error
    except (AddressError, chips.ChipHeld) as exc:
        return _fail(str(exc))
    spec = job.spec
    dataset_only = spec.algorithm.trains_on_dataset
    colocated = spec.mode == "colocated" and args.buffer is None and not dataset_only
    if args.buffer is None and not dataset_only and not colocated:
        return _fail("--buffer is required (only SFT, DPO on a dataset file, or mode: colocated, train without one)")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    if colocated:  # the learner plays its own episodes, on its own chips (runner/sync.py)
        try:
            several = distributed.from_environment() is not None
        except distributed.DistributedEnvError as exc:
            return _fail(f"TPU environment: {exc}")
        if several:
            return _fail("mode: colocated runs on one host; a learner slice of several hosts needs mode: disaggregated")
        # Here, not at the top: the sync loop brings the actors, and JAX, which --help never needs.
        from stoker.runner.sync import run_colocated

        return run_colocated(job, Path(args.manifest), run_dir, args.max_steps)

    try:  # multi-host TPU pods: before anything touches a JAX backend
        topology = distributed.initialize()
    except distributed.DistributedEnvError as exc:
        return _fail(f"TPU environment: {exc}")
    primary = topology is None or topology.process_id == 0

    # Here, not at the top: stoker.cli loads this module to parse the command line, and JAX, Flax
    # and gRPC would slow every `stoker learner` start (--help, a bad manifest) by seconds.
    from stoker.buffer.client import BufferClient, BufferClientError, BufferUnavailableError
    from stoker.learner.batches import DatasetError
    from stoker.learner.loop import Learner
    from stoker.learner.metrics import MetricsSink
    from stoker.learner.samples import attach_samples
    from stoker.learner.settings import LearnerSettings
    from stoker.weights.channel import WeightPublisher
    from stoker.weights.publish import ShardedPublisher

    overrides = {"max_steps": args.max_steps} if args.max_steps is not None else {}
    settings = LearnerSettings.from_spec(spec, run_dir=run_dir, **overrides)
    try:
        learner = Learner(settings)
    except ValueError as exc:  # a mesh that does not fit the devices, a bad model checkpoint
        return _fail(str(exc))

    source = None
    if args.buffer is not None and primary:
        source = BufferClient(args.buffer, token, learner_id="learner")
        try:
            source.wait_ready(timeout=120.0)
        except BufferUnavailableError as exc:
            learner.close()
            return _fail(f"buffer {args.buffer}: {exc}", 1)
    publisher: Any = None
    weights_address = None
    if weights_listen is not None:
        weights_address = process_address(weights_listen, 0 if topology is None else topology.process_id).target
    sharded = args.weights_format == "shards" or (args.weights_format == "auto" and topology is not None)
    if (args.weights_dir or weights_address) and sharded:  # every process serves/writes its own shards
        publisher = ShardedPublisher(directory=args.weights_dir, address=weights_address, auth_token=token,
                                     stream=args.weights_stream_port >= 0, stream_port=max(0, args.weights_stream_port))
    elif (args.weights_dir or weights_address) and primary:
        publisher = WeightPublisher(directory=args.weights_dir, address=weights_address, auth_token=token)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping after this step", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if primary:
            with MetricsSink(run_dir / "learner_metrics.jsonl", serve=metrics_listen) as sink:
                attach_samples(sink, spec, run_dir)
                made = learner.run(source, publisher, sink=sink, stop=stop)
        else:
            made = learner.run(None, publisher, stop=stop)  # a sharded publisher publishes from every process
    except PeerFailure as exc:
        _peer_failed(str(exc), learner.steps)
    except DatasetError as exc:
        return _fail(str(exc))
    except BufferClientError as exc:  # the buffer stayed unreachable past the client's retry deadline
        if topology is not None:  # a checkpoint is a collective the peers are not making
            _peer_failed(f"buffer {args.buffer}: {exc}", learner.steps)
        learner.save()
        return _fail(f"buffer {args.buffer}: {exc} (checkpointed at step {learner.steps})", 1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        learner.close()
        if publisher is not None:
            publisher.close()
    log.info("stopped at step %d, policy version %d (%d updates this run)", learner.steps, learner.version, made)
    return 0


def _peer_failed(message: str, step: int) -> NoReturn:
    """Leave now: any further collective (a checkpoint, JAX's shutdown barrier) would wait for a
    process that is gone. Its last complete checkpoint is where the restarted group resumes."""
    print(f"stoker learner: {message}\nstoker learner: exiting at step {step} without a final checkpoint", file=sys.stderr)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_PEER_FAILED)
