"""A minimal container environment: any process serving ``stoker.v1.Sandbox`` can be one.

    python examples/sandbox-server/server.py --port 50051
    stoker sandbox check 127.0.0.1:50051

The game: reset gives a task "count to N"; each step must answer the next number. Written in
Python against the stubs Stoker ships (``stoker.v1``); in another language, generate stubs from
``protos/stoker/v1/sandbox.proto`` and keep the same behaviour:

- ``Reset`` starts a fresh episode (an unknown task is ``INVALID_ARGUMENT``);
- ``Step`` before ``Reset`` is ``FAILED_PRECONDITION``; a bad action is an ordinary step with
  reward 0 and a hint, never a crash;
- ``info_json`` is a JSON object (``{"metrics": {"success": 1.0}}`` feeds the success rate);
- ``Close`` ends the episode and the process exits; ``Heartbeat`` answers at any time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc

from stoker.v1 import sandbox_pb2, sandbox_pb2_grpc

TASKS = {"count-3": 3, "count-5": 5}


class CountingSandbox(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, closed: threading.Event):
        self.closed = closed
        self.started = time.monotonic()
        self.target = 0
        self.next = 0
        self.lock = threading.Lock()

    def Reset(self, request, context):  # noqa: N802 - the gRPC method name
        with self.lock:
            if request.task_id not in TASKS:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown task {request.task_id!r}; expected {sorted(TASKS)}")
            self.target, self.next = TASKS[request.task_id], 1
            return sandbox_pb2.Observation(text=f"count from 1 to {self.target}, one number per turn", info_json="{}")

    def Step(self, request, context):  # noqa: N802
        with self.lock:
            if self.next == 0:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "step before reset")
            if request.action.strip() != str(self.next):
                info = {"metrics": {"success": 0.0}}
                text = f"expected {self.next}"
                return sandbox_pb2.StepResult(observation=sandbox_pb2.Observation(text=text, info_json=json.dumps(info)))
            done = self.next == self.target
            self.next += 1
            info = {"metrics": {"success": 1.0 if done else 0.0}}
            observation = sandbox_pb2.Observation(text="done" if done else "next", info_json=json.dumps(info))
            return sandbox_pb2.StepResult(observation=observation, reward=1.0 if done else 0.0, terminated=done)

    def Close(self, request, context):  # noqa: N802
        self.closed.set()
        return sandbox_pb2.CloseResponse()

    def Heartbeat(self, request, context):  # noqa: N802
        return sandbox_pb2.HeartbeatResponse(uptime_seconds=time.monotonic() - self.started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    args = parser.parse_args()
    closed = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sandbox_pb2_grpc.add_SandboxServicer_to_server(CountingSandbox(closed), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"SANDBOX_READY port={port}", flush=True)
    closed.wait()
    server.stop(grace=1.0).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
