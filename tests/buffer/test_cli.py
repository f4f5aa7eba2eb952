"""``stoker buffer`` on the command line: settings from a manifest, token file, clear errors,
graceful shutdown; and the benchmark script still runs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stoker.buffer.client import AuthError, BufferClient
from stoker.buffer.settings import BufferSettings
from stoker.spec import RLJobSpec

REPO = Path(__file__).resolve().parents[2]


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], capture_output=True, text=True, timeout=60)


def test_settings_come_from_the_spec() -> None:
    spec = RLJobSpec.model_validate(
        {"buffer": {"capacity": 99, "groupSize": 3, "maxStaleness": 7, "sync": "none", "failedGroupPolicy": "discard",
                    "sampleOrder": "newest-first"},
         "learner": {"batchGroups": 5}}
    )  # fmt: skip
    settings = BufferSettings.from_spec(spec, lease_timeout_seconds=5)
    assert (settings.capacity, settings.group_size, settings.max_staleness, settings.batch_groups) == (99, 3, 7, 5)
    assert (settings.sync, settings.failed_group_policy, settings.lease_timeout_seconds) == ("none", "discard", 5)
    assert settings.sample_order == "newest-first"
    with pytest.raises(ValueError, match="capacity"):
        BufferSettings(capacity=0)
    with pytest.raises(ValueError, match="sample_order"):
        BufferSettings(sample_order="random")  # type: ignore[arg-type]


def test_token_file_is_enforced(buffer_process: Callable[..., Any], tmp_path: Path, make_group: Callable[..., Any]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    server = buffer_process(None, "--token-file", str(token_file))
    with BufferClient(server.address) as anonymous:
        with pytest.raises(AuthError):
            anonymous.stats()
    with BufferClient(server.address, token="tok-123") as client:
        assert client.put(make_group(2)).stored == 2
    assert server.stop() == 0  # SIGTERM: graceful


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--token-file", "/nonexistent/token"], "cannot read"),
        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
        (["--manifest", "/nonexistent/job.yaml"], "cannot read"),
    ],
)
def test_user_errors_are_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = stoker("buffer", "--port", "0", "--data-dir", str(tmp_path / "d"), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "buffer_throughput.py"), "--seconds", "1", "--rounds", "1",
         "--sizes", "64", "--writers", "1", "--window", "1", "--sample-groups", "2", "--disk-seconds", "0.2",
         "--logic-seconds", "0.2", "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    by_target = {r["target"]: r for r in report["results"]}
    assert set(by_target) == {"echo", "echo-log", "buffer"}
    for row in by_target.values():
        assert row["stored"] > 0 and row["read"] > 0 and row["put_p99_ms"] > 0
    assert report["ratios"][0]["tokens"] == 64
    disk = report["disk"]["64"]
    assert disk["append_p50_ms"] > 0 and disk["cpu_us_per_append"] > 0
    assert report["ratios"][0]["echo_log_ratio"] > 0
    assert report["logic_us_per_trajectory"]["64"] > 0 and 0 < report["ratios"][0]["logic_ceiling"] < 1
