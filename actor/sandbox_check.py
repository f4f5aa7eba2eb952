"""``stoker sandbox check ADDRESS``: does a server keep the ``stoker.v1.Sandbox`` contract?

Runs, against one fresh server (it serves one episode and exits after Close): Heartbeat, Step
before Reset, Reset of an unknown task, Reset and Steps of a real task, bad actions, a Step whose
deadline expires, Close after all those failures, and the exit after Close. Prints one PASS or
FAIL line per check, with what was wrong; exit 0 when all pass, 1 when any fails, 2 when nothing
answers at ADDRESS. ``examples/sandbox-server/`` is a minimal server that passes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from stoker.channels import channel_options
from stoker.v1 import sandbox_pb2, sandbox_pb2_grpc

REJECTIONS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
BAD_ACTIONS = ("", "x" * 20000, "\x00\ufffd\u202e garbage \U0001f600", "\n\n\n")


class CheckFailed(Exception):
    pass


@dataclass
class Result:
    name: str
    problem: str = ""

    def __str__(self) -> str:
        return f"PASS {self.name}" if not self.problem else f"FAIL {self.name}: {self.problem}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sandbox_command", metavar="COMMAND", required=True)
    check = sub.add_parser("check", help="run the conformance checks against a running sandbox server")
    check.add_argument("address", metavar="ADDRESS", help="host:port of a fresh sandbox server")
    check.add_argument("--task", required=True, help="a task id the server knows")
    check.add_argument("--action", action="append", default=[], help="an action to play (repeatable, in order)")
    check.add_argument("--environment", default="", help="ResetRequest.environment")
    check.add_argument("--options", default="{}", help="ResetRequest.options_json")
    check.add_argument("--step-timeout", type=float, default=30.0, help="seconds each call may take")
    check.add_argument("--exit-timeout", type=float, default=10.0, help="seconds the server may take to exit after Close")


def main(args: argparse.Namespace) -> int:
    results, reachable = run_checks(
        args.address, args.task, args.action or ["1"], args.environment, args.options, args.step_timeout, args.exit_timeout
    )
    if not reachable:
        print(f"stoker sandbox check: nothing answers at {args.address}", file=sys.stderr)
        return 2
    for result in results:
        print(result)
    failed = [r for r in results if r.problem]
    print(f"{len(results)} checks, {len(failed)} failed")
    return 1 if failed else 0


def run_checks(
    address: str, task: str, actions: list[str], environment: str = "", options_json: str = "{}",
    step_timeout: float = 30.0, exit_timeout: float = 10.0,
) -> tuple[list[Result], bool]:
    channel = grpc.insecure_channel(address, options=channel_options())
    try:
        grpc.channel_ready_future(channel).result(timeout=min(step_timeout, 10.0))
    except grpc.FutureTimeoutError:
        return [], False
    stub = sandbox_pb2_grpc.SandboxStub(channel)
    results: list[Result] = []

    def reset_request(task_id: str) -> Any:
        return sandbox_pb2.ResetRequest(environment=environment, options_json=options_json, task_id=task_id, seed=0)

    def alive() -> None:
        try:
            stub.Heartbeat(sandbox_pb2.HeartbeatRequest(), timeout=5.0)
        except grpc.RpcError as err:
            raise CheckFailed(f"the server stopped answering Heartbeat afterwards ({_code(err)})") from None

    def check(name: str, body: Callable[[], None]) -> None:
        try:
            body()
        except CheckFailed as exc:
            results.append(Result(name, str(exc)))
        else:
            results.append(Result(name))

    def heartbeat() -> None:
        reply = _call(stub.Heartbeat, sandbox_pb2.HeartbeatRequest(), step_timeout)
        if not math.isfinite(reply.uptime_seconds) or reply.uptime_seconds < 0:
            raise CheckFailed(f"uptime_seconds is {reply.uptime_seconds}; expected a finite number >= 0")

    def step_before_reset() -> None:
        _expect_rejection(lambda: stub.Step(sandbox_pb2.StepRequest(action=actions[0]), timeout=step_timeout))
        alive()

    def unknown_task() -> None:
        _expect_rejection(lambda: stub.Reset(reset_request("stoker-check-no-such-task"), timeout=step_timeout))
        alive()

    def reset_and_steps() -> None:
        observation = _call(stub.Reset, reset_request(task), step_timeout)
        if not observation.text:
            raise CheckFailed("Reset returned an empty observation text")
        _info(observation.info_json, "Reset")
        for index, action in enumerate(actions):
            _step_result(_call(stub.Step, sandbox_pb2.StepRequest(action=action), step_timeout), f"Step {index + 1}")

    def bad_actions() -> None:
        _call(stub.Reset, reset_request(task), step_timeout)
        for action in BAD_ACTIONS:
            try:
                _step_result(stub.Step(sandbox_pb2.StepRequest(action=action), timeout=step_timeout), "a bad action")
            except grpc.RpcError as err:
                if err.code() not in REJECTIONS:
                    raise CheckFailed(f"Step({_short(action)}) failed with {_code(err)}; expected a StepResult, "
                                      "or INVALID_ARGUMENT / FAILED_PRECONDITION") from None
        alive()

    def expired_deadline() -> None:
        _call(stub.Reset, reset_request(task), step_timeout)
        try:
            stub.Step(sandbox_pb2.StepRequest(action=actions[0]), timeout=0.001)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED and err.code() not in REJECTIONS:
                raise CheckFailed(f"a Step with an expired deadline failed with {_code(err)}") from None
        alive()
        _call(stub.Reset, reset_request(task), step_timeout)  # a fresh episode still starts

    def close_after_failure() -> None:
        _call(stub.Close, sandbox_pb2.CloseRequest(), step_timeout)

    def exits_after_close() -> None:
        deadline = time.monotonic() + exit_timeout
        while time.monotonic() < deadline:
            try:
                stub.Heartbeat(sandbox_pb2.HeartbeatRequest(), timeout=1.0)
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    return
            time.sleep(0.2)  # polling the server's exit, a wait with a deadline
        raise CheckFailed(f"the server still answers {exit_timeout:g} s after Close; expected it to exit")

    check("heartbeat", heartbeat)
    check("step-before-reset", step_before_reset)
    check("reset-unknown-task", unknown_task)
    check("reset-and-step", reset_and_steps)
    check("bad-actions", bad_actions)
    check("step-deadline", expired_deadline)
    check("close-after-failure", close_after_failure)
    if not results[-1].problem:
        check("exits-after-close", exits_after_close)
    channel.close()
    return results, True


def _call(rpc: Any, request: Any, timeout: float) -> Any:
    started = time.monotonic()
    try:
        return rpc(request, timeout=timeout)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise CheckFailed(f"no answer within {timeout:g} s") from None
        raise CheckFailed(f"failed with {_code(err)} after {time.monotonic() - started:.1f} s") from None


def _expect_rejection(call: Callable[[], Any]) -> None:
    try:
        call()
    except grpc.RpcError as err:
        if err.code() not in REJECTIONS:
            raise CheckFailed(f"failed with {_code(err)}; expected INVALID_ARGUMENT or FAILED_PRECONDITION") from None
        return
    raise CheckFailed("succeeded; expected INVALID_ARGUMENT or FAILED_PRECONDITION")


def _info(info_json: str, what: str) -> None:
    if not info_json:
        return
    try:
        info = json.loads(info_json)
    except json.JSONDecodeError:
        raise CheckFailed(f"{what}: info_json is not JSON: {_short(info_json)}") from None
    if not isinstance(info, dict):
        raise CheckFailed(f"{what}: info_json is {type(info).__name__}; expected a JSON object")
    metrics = info.get("metrics", {})
    if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
        raise CheckFailed(f"{what}: info_json.metrics must map names to numbers")


def _step_result(result: Any, what: str) -> None:
    if not math.isfinite(result.reward):
        raise CheckFailed(f"{what}: reward is {result.reward}; expected a finite number")
    _info(result.observation.info_json, what)


def _code(err: grpc.RpcError) -> str:
    details = err.details() if hasattr(err, "details") else ""
    return f"{err.code().name}{': ' + _short(details) if details else ''}"


def _short(text: str, limit: int = 80) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
