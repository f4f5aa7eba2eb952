"""kopf's own setup for the operator, at startup: its settings (watching, persistence, posting,
workers) and its login, with the credentials of the operator's own API client.

``handlers.register`` wires both in, beside the per-job handlers.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from stoker.labels import JOB_LABEL
from stoker.operator.reconcile import Runtime

FINALIZER = "stoker.dev/operator"
ANNOTATION_PREFIX = "stoker.dev"
EXITING_LOOK_POLL_SECONDS = 1.0  # how often a deletion checks whether the job's status look has ended


def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    runtime: Runtime = memo["runtime"]
    ours = runtime.settings
    settings.watching.server_timeout = ours.watch_server_timeout_seconds
    settings.watching.client_timeout = ours.watch_server_timeout_seconds + 30
    # Only pods of Stoker jobs, filtered by the API server: without it every pod event in the
    # cluster (or watched namespaces) would stream into the operator to be dropped client-side.
    settings.watching.label_selectors["", "v1", "pods"] = JOB_LABEL
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Events are posted explicitly (lifecycle, scaling, reaping, errors; stoker.operator.lifecycle):
    # at INFO, every handler log line of every look would become an Event.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    # A status look still running when its job is deleted holds the finalizer until its thread
    # ends; kopf then re-checks only on the job's next watch event or after this poll (60 s by
    # default), and a look that writes nothing makes no event: the deletion would wait a minute.
    settings.background.cancellation_polling = EXITING_LOOK_POLL_SECONDS


def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the same credentials as the operator's own API client."""
    runtime: Runtime = memo["runtime"]
    config = runtime.kube.api.configuration
    # Through the prefix getter: in-cluster, it re-reads the rotated service account token.
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, token = (header.split(" ", 1) if " " in header else (None, header)) if header else (None, None)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        username=config.username or None,
        password=config.password or None,
    )
