"""`stoker sandbox check`: the example server passes, a broken one fails with reasons."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sandbox-server" / "server.py"

BROKEN = f'''
import importlib.util, sys
spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
from stoker.v1 import sandbox_pb2


class Broken(example.CountingSandbox):
    def Reset(self, request, context):  # accepts any task: no INVALID_ARGUMENT
        self.target, self.next = 3, 1
        return sandbox_pb2.Observation(text="count", info_json="{{}}")

    def Step(self, request, context):  # crashes on a bad action; info_json is not JSON
        int(request.action)
        return sandbox_pb2.StepResult(observation=sandbox_pb2.Observation(text="ok", info_json="ok!"))

    def Close(self, request, context):  # never exits
        return sandbox_pb2.CloseResponse()


example.CountingSandbox = Broken
sys.exit(example.main())
'''


def _serve(argv: list[str]) -> Iterator[str]:
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line.startswith("SANDBOX_READY port="), line
    yield f"127.0.0.1:{line.strip().split('=')[1]}"
    server.kill()
    server.wait()


@pytest.fixture
def example() -> Iterator[str]:
    yield from _serve([sys.executable, str(EXAMPLE), "--port", "0"])


@pytest.fixture
def broken(tmp_path: Path) -> Iterator[str]:
    script = tmp_path / "broken.py"
    script.write_text(BROKEN)
    yield from _serve([sys.executable, str(script), "--port", "0"])


def _check(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "sandbox", "check", address, *extra],
        capture_output=True, text=True, timeout=120,
    )


def test_the_example_server_passes(example: str) -> None:
    done = _check(example, "--task", "count-3", "--action", "1", "--action", "2", "--action", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 checks, 0 failed" in done.stdout and "FAIL" not in done.stdout


def test_a_broken_server_fails_with_what_is_wrong(broken: str) -> None:
    done = _check(broken, "--task", "count-3", "--exit-timeout", "2")
    assert done.returncode == 1
    out = done.stdout
    assert "PASS heartbeat" in out
    assert "FAIL reset-unknown-task: succeeded; expected INVALID_ARGUMENT or FAILED_PRECONDITION" in out
    assert "FAIL reset-and-step: Step 1: info_json is not JSON: 'ok!'" in out
    assert "FAIL bad-actions: Step('') failed with UNKNOWN" in out
    assert "FAIL exits-after-close: the server still answers 2 s after Close" in out


def test_stokers_own_sandbox_server_passes(tmp_path: Path) -> None:
    from stoker.actor.sandbox_check import run_checks

    for address in _serve([sys.executable, "-m", "stoker.actor.sandbox_server", "--port", "0"]):
        results, reachable = run_checks(address, "0", ["right"], environment="frozenlake")
        assert reachable and [r.problem for r in results] == [""] * 8


def test_nothing_listening_is_a_clear_error() -> None:
    done = _check("127.0.0.1:9", "--task", "x", "--step-timeout", "1")
    assert done.returncode == 2 and "nothing answers at 127.0.0.1:9" in done.stderr
