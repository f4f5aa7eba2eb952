"""Run a script on 8 host (CPU) devices and read the JSON it prints last.

JAX fixes its device count when it starts, and the tests in this process started it with one CPU
device, so layouts over a mesh run in a subprocess with ``XLA_FLAGS`` set before jax is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_on_host_devices(script: str, *args: str, timeout: int = 280, devices: int = 8) -> Any:
    """``python -c script args...`` with ``devices`` CPU devices; its last stdout line as JSON."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
