"""A thin, dict-in/dict-out Kubernetes client over the official ``kubernetes`` library.

The operator creates a dozen kinds of children and only ever needs create/get/patch/delete on
plain dicts, so instead of a typed API class per group (and model objects the builders never
use) this wraps the library's own request path (``param_serialize`` -> ``call_api``, as its
dynamic client does) with a static table of the resources it touches. Authentication, TLS and
kubeconfig handling stay the library's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
            if subresource is not None:
                base += f"/{subresource}"
        return base


# (apiVersion, kind) -> resource, for every kind the operator creates or reads.
RESOURCES: dict[tuple[str, str], Resource] = {
    ("v1", "ConfigMap"): Resource("", "v1", "configmaps"),
    ("v1", "Secret"): Resource("", "v1", "secrets"),
    ("v1", "Service"): Resource("", "v1", "services"),
    ("v1", "ServiceAccount"): Resource("", "v1", "serviceaccounts"),
    ("v1", "PersistentVolumeClaim"): Resource("", "v1", "persistentvolumeclaims"),
    ("v1", "Pod"): Resource("", "v1", "pods"),
    ("apps/v1", "Deployment"): Resource("apps", "v1", "deployments"),
    ("batch/v1", "Job"): Resource("batch", "v1", "jobs"),
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): Resource("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    ("rbac.authorization.k8s.io/v1", "Role"): Resource("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): Resource("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("networking.k8s.io/v1", "NetworkPolicy"): Resource("networking.k8s.io", "v1", "networkpolicies"),
    ("stoker.dev/v1alpha1", "RLJob"): Resource("stoker.dev", "v1alpha1", "rljobs"),
}


def resource_of(api_version: str, kind: str) -> Resource:
    try:
        return RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no resource known for {api_version} {kind}") from None


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


class ApiError(Exception):
    """Any other API failure; ``status`` is the HTTP code (0 when the server was unreachable)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message

    @property
    def retriable(self) -> bool:
        """Server-side, throttling and connectivity errors heal by themselves; 4xx do not."""
        return self.status == 0 or self.status == 429 or self.status >= 500


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster service account credentials, else the kubeconfig (``$KUBECONFIG``, ~/.kube/config)."""
    config = kubernetes.client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=config)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    return config


def _message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        return str(exc.reason)
    return str(body.get("message") or exc.reason) if isinstance(body, dict) else str(exc.reason)


class Kube:
    """Create/get/patch/delete/list plain-dict objects; errors as ``NotFound``/``Conflict``/``ApiError``."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: float = 10.0):
        self.api = kubernetes.client.ApiClient(configuration)
        self.timeout = timeout

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self.api.call_api(*serialized, _request_timeout=self.timeout)
            response.read()
            if not 200 <= response.status <= 299:
                self.api.response_deserialize(response, {})  # raises the typed ApiException
        except ApiException as exc:
            if exc.status == 404:
                raise NotFound(_message(exc)) from None
            if exc.status == 409:
                raise Conflict(_message(exc)) from None
            raise ApiError(exc.status or 0, _message(exc)) from None
        except OSError as exc:  # urllib3's connection errors derive from OSError
            raise ApiError(0, f"cannot reach the API server: {exc}") from None
        return json.loads(response.data) if response.data else None

    def create(self, obj: Manifest) -> Manifest:
        res = resource_of(obj["apiVersion"], obj["kind"])
        return dict(self.request("POST", res.path(obj["metadata"].get("namespace")), obj))

    def get(self, res: Resource, namespace: str, name: str) -> Manifest:
        return dict(self.request("GET", res.path(namespace, name)))

    def patch(self, res: Resource, namespace: str, name: str, patch: Manifest, subresource: str | None = None) -> Manifest:
        path = res.path(namespace, name, subresource)
        return dict(self.request("PATCH", path, patch, content_type="application/merge-patch+json"))

    def delete(self, res: Resource, namespace: str, name: str, *, propagation: str = "Background") -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        self.request("DELETE", res.path(namespace, name), body)

    def list(self, res: Resource, namespace: str, label_selector: str | None = None) -> list[Manifest]:
        query = [("labelSelector", label_selector)] if label_selector else None
        return list(self.request("GET", res.path(namespace), query=query).get("items", []))

    def serves(self, group: str, version: str, plural: str) -> bool:
        """API discovery: whether the server serves ``group/version`` ``plural``."""
        try:
            found = self.request("GET", f"/apis/{group}/{version}")
        except NotFound:
            return False
        return any(item.get("name") == plural for item in found.get("resources", []))
