"""``stoker operator`` as a user runs it: argument errors, and a real process against kmock."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stoker.cli import build_parser
from stoker.operator.cli import settings_from_args


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stoker.cli", "operator", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_scope_is_required() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "--namespace" in result.stderr and "--all-namespaces" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli("-A", "--kubeconfig", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "no Kubernetes credentials" in result.stderr and "Traceback" not in result.stderr


def test_arguments_map_onto_settings() -> None:
    args = build_parser(["operator"]).parse_args(
        ["operator", "-n", "a", "-n", "b", "--standalone", "--image", "img:1", "--status-interval", "3"]
    )
    settings = settings_from_args(args)
    assert settings.namespaces == ("a", "b") and not settings.all_namespaces and settings.standalone
    assert settings.image == "img:1" and settings.status_interval_seconds == 3.0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_operator_process_reconciles_an_rljob(operator_factory: Any) -> None:
    """The installed entry point, as its own process: watches, creates children, stops on SIGTERM."""
    c = await operator_factory(run=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stoker.cli", "operator", "--all-namespaces", "--standalone",
        "--kubeconfig", str(c.kubeconfig), "--status-interval", "0.5", "--metrics-port", str(metrics_port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await c.watching()
        await c.create("/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs",
                       {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "cli"}, "spec": {}})
        await c.eventually(lambda: {"cli-actor", "cli-buffer"} <= c.names("apps/v1/deployments"), timeout=20,
                           what="children from the CLI process")
        await c.eventually(lambda: (c.get("stoker.dev/v1alpha1/rljobs", "cli") or {}).get("status", {}).get("phase"),
                           timeout=20, what="a status phase")

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                return response.read().decode()

        # actors.replicas unset: as many as admission keeps busy, up to maxReplicas (8).
        series = 'stoker_rljob_actors_desired{namespace="research",rljob="cli"} 8.0'
        for _ in range(200):  # the first look ends once the (unreachable) buffer's Stats time out
            if series in await asyncio.to_thread(scrape):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{series} never appeared in /metrics")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()[-2000:]
