"""`stoker run` on a host that refuses inet sockets, as the lent TPU VM does (errno 97 even on
loopback): a network namespace whose loopback is down, and socket(AF_INET/AF_INET6) refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# socket() for AF_INET/AF_INET6 fails as it does on that host, for Python and for the C libraries
# below it (gRPC's core makes its own sockets), in every process started with it preloaded.
REFUSE_INET_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>

int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
"""


def _isolated(tmp_path: Path, jax_cache_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a process on such a host."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("needs unshare -n (a new network namespace): root or user namespaces")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler for the socket() shim")
    source, shim = tmp_path / "no_inet.c", tmp_path / "no_inet.so"
    source.write_text(REFUSE_INET_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True)
    return ["unshare", "-n"], {**os.environ, **jax_cache_env, "LD_PRELOAD": str(shim)}


def test_the_harness_refuses_inet_sockets_in_python_and_in_grpc(tmp_path: Path, jax_cache_env: dict[str, str]) -> None:
    prefix, env = _isolated(tmp_path, jax_cache_env)
    probe = "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print(e.errno)"
    refused = subprocess.run([*prefix, sys.executable, "-c", probe], env=env, capture_output=True, text=True, errors="replace", cwd=tmp_path)
    assert refused.stdout.strip() == "97", refused.stderr[-2000:]
    grpc_probe = (
        "import grpc, concurrent.futures as f\ns = grpc.server(f.ThreadPoolExecutor(1))\n"
        "try:\n    print(s.add_insecure_port('127.0.0.1:0'))\nexcept RuntimeError:\n    print('refused')"
    )
    refused = subprocess.run([*prefix, sys.executable, "-c", grpc_probe], env=env, capture_output=True, text=True, errors="replace", cwd=tmp_path)
    assert refused.stdout.strip() in ("0", "refused"), refused.stderr[-2000:]
    unix = "import socket\ns = socket.socket(socket.AF_UNIX)\nprint('unix ok')"
    assert "unix ok" in subprocess.run([*prefix, sys.executable, "-c", unix], env=env, capture_output=True, text=True, errors="replace",
                                       cwd=tmp_path).stdout


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run's own bound is 600 s; an asynchronous run's steps vary from run to run
def test_the_frozenlake_example_reaches_0_9_with_no_inet_socket(tmp_path: Path, jax_cache_env: dict[str, str]) -> None:
    prefix, env = _isolated(tmp_path, jax_cache_env)
    run = subprocess.run(
        [*prefix, sys.executable, "-m", "stoker.cli", "run", str(ROOT / "examples" / "frozenlake.yaml"),
         "--run-dir", str(tmp_path / "run"), "--target-success", "0.9", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "servers on unix sockets" in run.stderr
    assert "success rate reached 0.9" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_tcp_on_such_a_host_fails_at_once_with_the_reason(tmp_path: Path, jax_cache_env: dict[str, str]) -> None:
    prefix, env = _isolated(tmp_path, jax_cache_env)
    run = subprocess.run(
        [*prefix, sys.executable, "-m", "stoker.cli", "run", str(ROOT / "examples" / "frozenlake.yaml"),
         "--run-dir", str(tmp_path / "run"), "--transport", "tcp", "--max-steps", "1", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert run.returncode != 0
    assert "buffer exited with code 2" in run.stderr and "cannot start on 127.0.0.1:0" in run.stderr, run.stderr[-3000:]
