"""``stoker actor``: run episodes in sandboxes and stream trajectories to the buffer.

    stoker actor --manifest job.yaml --buffer HOST:PORT [--token-file F] \\
                 --weights HOST:PORT|DIR --actor-id ID [--max-groups N]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from stoker.manifest import load_job
from stoker.remote_checkpoint import ACTOR

log = logging.getLogger("stoker.actor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, metavar="FILE", help="RLJob manifest")
    parser.add_argument("--buffer", required=True, metavar="ADDR", help="buffer gRPC address host:port")
    parser.add_argument("--token-file", metavar="F", help="file holding the buffer's bearer token")
    parser.add_argument(
        "--weights", metavar="ADDR_OR_DIR", help="learner weight channel: gRPC host:port or a shared directory"
    )
    parser.add_argument(
        "--actor-id",
        default=os.environ.get("POD_NAME") or os.uname().nodename,
        help="this actor's id (default: the pod/host name)",
    )
    parser.add_argument(
        "--rollout",
        default=os.environ.get("STOKER_ROLLOUT_ADDRESS") or None,
        metavar="ADDR",
        help="rollout server host:port to sample from (default: $STOKER_ROLLOUT_ADDRESS; unset: sample in-process)",
    )
    parser.add_argument("--max-groups", type=int, metavar="N", help="stop after starting N groups")
    parser.add_argument(
        "--stats-file", type=Path, metavar="FILE",
        help="keep a JSON snapshot of generation throughput and failure reasons here (stoker run reads it)",
    )
    parser.add_argument("--job", help="job name for sandbox pod labels (default: the manifest's metadata.name)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    job = load_job(args.manifest, fetch=ACTOR)  # ManifestError is reported by the dispatcher
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            print(f"stoker actor: --token-file {args.token_file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.max_groups is not None and args.max_groups < 1:
        print(f"stoker actor: --max-groups: got {args.max_groups}; expected >= 1", file=sys.stderr)
        return 2
    # Here, not at the top: the actor's wiring loads gRPC, NumPy and the tokenizers (a few tenths of
    # a second), which `stoker actor --help` does not need.
    from stoker.actor.wiring import ActorSetupError, build_and_run
    from stoker.buffer.client import AuthError
    from stoker.conversation.tokenization import TokenizerProblem

    try:
        stats = asyncio.run(
            build_and_run(
                job,
                actor_id=args.actor_id,
                buffer_address=args.buffer,
                token=token,
                weights=args.weights,
                rollout_address=args.rollout,
                max_groups=args.max_groups,
                job_name=args.job or job.metadata.name,
                install_signals=_install_signals,
                stats_path=args.stats_file,
            )
        )
    except (TokenizerProblem, ActorSetupError) as exc:
        print(f"stoker actor: {exc}", file=sys.stderr)
        return 2
    except AuthError as exc:
        print(f"stoker actor: the buffer at {args.buffer} refused our token: {exc}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - process top level: log it, exit non-zero
        log.exception("actor %s failed", args.actor_id)
        return 1
    log.info("actor %s done: %d groups, %d episodes", args.actor_id, stats.groups_submitted, stats.episodes)
    if stats.abandoned_groups:
        log.warning("actor %s: %d finished groups not submitted (buffer unreachable while stopping)",
                    args.actor_id, stats.abandoned_groups)
    return 0


def _install_signals(stop: object) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)  # type: ignore[arg-type]
