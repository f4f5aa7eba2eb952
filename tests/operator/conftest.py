"""Fixtures: kmock's Kubernetes emulator on loopback, declared like a cluster with Stoker's CRD,
and the real operator (kopf) running against it in this event loop."""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import pytest
import pytest_asyncio
import yaml

from stoker.operator.cli import run_operator
from stoker.operator.settings import OperatorSettings

# (group/version/plural, kind, namespaced, subresources)
CLUSTER_RESOURCES: list[tuple[str, str, bool, tuple[str, ...]]] = [
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, ()),
    ("v1/namespaces", "Namespace", False, ()),
    ("v1/events", "Event", True, ()),
    ("v1/pods", "Pod", True, ("status",)),
    ("v1/configmaps", "ConfigMap", True, ()),
    ("v1/secrets", "Secret", True, ()),
    ("v1/services", "Service", True, ()),
    ("v1/serviceaccounts", "ServiceAccount", True, ()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, ()),
    ("apps/v1/deployments", "Deployment", True, ("status",)),
    ("batch/v1/jobs", "Job", True, ("status",)),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, ()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, ()),
    ("stoker.dev/v1alpha1/rljobs", "RLJob", True, ("status",)),
]
JOBSET_RESOURCE = ("jobset.x-k8s.io/v1alpha2/jobsets", "JobSet", True, ("status",))
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server does and kopf or the operator rely on: a
    resourceVersion bumped on every write, ``generateName``, and Secrets' ``stringData``.

    kopf relies on it to recognise (and skip) watch events older than its own last patch; without
    it, a stale event replays an edge-triggered handler with an outdated spec.
    """

    _version: int = 1
    refusals: dict[str, tuple[int, str, str]] | None = None
    """plural -> (status, reason, message): creates the API server refuses (a webhook, RBAC)."""
    hold: Any = None
    """A predicate: the next request it matches waits for ``released`` (a slow API server)."""
    held: asyncio.Event | None = None
    released: asyncio.Event | None = None

    async def _handle(self, request: Any) -> Any:
        if self.hold is not None and self.hold(request):
            self.hold = None  # one request only
            assert self.held is not None and self.released is not None
            self.held.set()
            await self.released.wait()
        if self.refusals and request.resource is not None and request.action == kmock.action.CREATE:
            refused = self.refusals.get(request.resource.plural or "")
            if refused is not None:
                raise kmock.KubernetesError(status=refused[0], reason=refused[1], message=refused[2])
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            self._version += 1
            version = str(self._version)
            if isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE and "name" not in meta and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{version}"  # kopf names its Events this way
                if request.resource.plural == "secrets" and request.data.get("stringData"):
                    # the API server stores stringData base64-encoded under data
                    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in request.data.pop("stringData").items()}
                    request.data["data"] = {**(request.data.get("data") or {}), **encoded}
            elif isinstance(request.data, list):  # JSON Patch: its own `test` ops run first
                request.data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:  # a stale resourceVersion, as the API server says it
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None


def declare(emulator: kmock.KubernetesEmulator, *, jobset: bool) -> None:
    for key, kind, namespaced, subresources in CLUSTER_RESOURCES + ([JOBSET_RESOURCE] if jobset else []):
        emulator.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources)


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


class OperatorLog(logging.Handler):
    """The last lines kopf and the operator logged (DEBUG included: kopf says there why it waits),
    printed when an ``eventually`` times out, so a failure in CI shows what the operator was doing."""

    LOGGERS = ("kopf", "stoker.operator")

    def __init__(self, lines: int = 300) -> None:
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
        self.levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> OperatorLog:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self.levels[name] = logger.level
            logger.setLevel(logging.DEBUG)
            logger.addHandler(self)
        return self

    def __exit__(self, *_: Any) -> None:
        for name, level in self.levels.items():
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(level)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.lines)[-lines:])


@dataclass
class Cluster:
    """The emulator plus helpers that act like kubectl and the controllers kmock does not run."""

    k: kmock.KubernetesEmulator
    kubeconfig: Path | None = None
    namespace: str = "research"
    log: OperatorLog | None = None
    _uids: int = 0

    def _uid(self) -> str:
        self._uids += 1
        return f"uid-{self._uids:04d}"

    async def create(self, path: str, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", self.namespace)
        meta.setdefault("uid", self._uid())
        response = await self.k.post(path.format(ns=self.namespace), json=obj)
        assert response.status == 200, await response.text()

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        response = await self.k.patch(path.format(ns=self.namespace), json=body)
        assert response.status == 200, await response.text()

    async def delete(self, path: str) -> None:
        response = await self.k.delete(path.format(ns=self.namespace))
        assert response.status == 200, await response.text()

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        wanted = kmock.resource(resource)
        for (res, ns, obj_name), obj in self.k.objects.items():
            if res == wanted and ns == self.namespace and obj_name == name and not obj.deleted:
                return dict(obj.raw)
        return None

    def names(self, resource: str) -> set[str]:
        return {
            name
            for (res, ns, name), obj in self.k.objects.items()
            if ns == self.namespace and not obj.deleted and res == kmock.resource(resource)
        }

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [dict(obj.raw) for obj in self.objects("v1/events") if obj.raw.get("reason") == reason]

    async def watching(self) -> None:
        """Wait until the operator watches RLJobs and pods.

        kmock replays existing objects when a watch starts (a real server resumes after the
        list's resourceVersion), so tests create objects only once kopf is watching.
        """
        watched = {"rljobs", "pods"}
        await self.eventually(
            lambda: watched <= {r.resource.plural for r in self.k if r.action == kmock.action.WATCH and r.resource},
            timeout=20,
            what="the operator's watches",
        )

    async def eventually(self, check: Any, timeout: float = 30.0, what: str = "condition") -> Any:
        """Poll ``check()`` until it returns something truthy (the operator acts asynchronously).

        The default bound is generous because it is only reached when the check fails: at a
        load average of 13 on two cores, kopf's finalizer round trips took over 10 s."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            await asyncio.sleep(0.05)
        logged = f"\nthe operator's last log lines:\n{self.log.tail()}" if self.log is not None else ""
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}{logged}")

    def objects(self, resource: str) -> list[Any]:
        return [obj for (res, _, _), obj in self.k.objects.items() if res == kmock.resource(resource) and not obj.deleted]


@pytest_asyncio.fixture
async def operator_factory(tmp_path: Path) -> AsyncIterator[Any]:
    """Start emulator + operator with given settings; everything stops at teardown.

    The operator runs in its own thread and event loop, as in production: kopf owns its loop
    (at exit it cancels every task left in it), while the emulator serves from the test's loop.
    """
    stack: list[tuple[threading.Event, threading.Thread, Any, Any]] = []
    log = OperatorLog()

    async def start(*, jobset: bool = True, run: bool = True, **overrides: Any) -> Cluster:
        emulator = VersionedEmulator()
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        declare(emulator, jobset=jobset)
        kubeconfig = write_kubeconfig(tmp_path / f"kubeconfig-{len(stack)}", str(server.url).rstrip("/"))
        settings = replace(
            OperatorSettings(all_namespaces=True, standalone=True, kubeconfig=str(kubeconfig)),
            status_interval_seconds=0.2,
            request_timeout_seconds=3.0,
            scale_cooldown_seconds=0.0,
            jobset_discovery_seconds=3600.0,
            **overrides,
        )
        if not run:  # the test runs the operator itself
            stack.append((threading.Event(), threading.Thread(target=lambda: None), server, emulator))
            return Cluster(emulator, kubeconfig=kubeconfig, log=log)
        stop, ready = threading.Event(), threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(run_operator(settings, stop_flag=stop, ready_flag=ready)), daemon=True
        )
        thread.start()
        stack.append((stop, thread, server, emulator))
        assert await asyncio.to_thread(ready.wait, 20), "the operator did not start"
        cluster = Cluster(emulator, kubeconfig=kubeconfig, log=log)
        await cluster.watching()
        return cluster

    with log:
        yield start
        for stop, thread, server, emulator in reversed(stack):
            stop.set()
            if thread.ident is not None:
                await asyncio.to_thread(thread.join, 30)
            await server.__aexit__(None, None, None)
            await emulator.__aexit__(None, None, None)
            assert not thread.is_alive(), f"the operator did not stop; its last log lines:\n{log.tail()}"


@pytest.fixture
def buffer_process(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A real ``stoker buffer`` on loopback: (address, token)."""
    token = "operator-test-token"
    (tmp_path / "token").write_text(token)
    ready = tmp_path / "buffer.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "buffer", "--port", "0", "--host", "127.0.0.1"]
        + ["--data-dir", str(tmp_path / "buffer"), "--ready-file", str(ready), "--token-file", str(tmp_path / "token")]
        + ["--log-format", "text"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stoker buffer did not become ready (exit code {proc.poll()})")
            time.sleep(0.05)
        yield f"127.0.0.1:{ready.read_text().strip()}", token
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
