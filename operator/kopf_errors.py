"""API failures in kopf's terms: retried later (``kopf.TemporaryError``) or final (``kopf.PermanentError``).

The handlers raise what these return; kopf calls the handler again after a TemporaryError's delay
and not after a PermanentError until the job changes.
"""

from __future__ import annotations

from datetime import datetime, timezone

import kopf

from stoker.operator import kube as kubeapi
from stoker.operator.jobstatus import failed_status
from stoker.operator.settings import OperatorSettings


def kopf_error(exc: kubeapi.ApiError) -> Exception:
    """Map API failures to kopf's retry semantics."""
    if exc.retriable or exc.status in (401, 403):  # 403: RBAC may be fixed while we wait
        return kopf.TemporaryError(str(exc), delay=30)
    return kopf.PermanentError(str(exc))


def refused_child_error(
    exc: kubeapi.ApiError, body: kopf.Body, status: kopf.Status, patch: kopf.Patch, generation: int | None,
    retry: int, settings: OperatorSettings,
) -> Exception:
    """The API server refused a child: the job shows Failed with why, at once.

    Server-side and connectivity errors heal by themselves and are retried quietly. A 401/403
    may be fixed by an admin granting RBAC, so it is retried ``forbidden_retries`` times (the job
    Failed meanwhile, saying so), then given up; anything else (422 from a webhook, 400) is final
    until the spec changes.
    """
    if exc.retriable:
        patch.status["message"] = f"applying children: {exc}"
        return kopf.TemporaryError(str(exc), delay=30)
    forbidden = exc.status in (401, 403)
    retrying = forbidden and retry < settings.forbidden_retries
    message = f"the API server refused {exc}"
    if retrying:
        message += f"; retrying in {settings.forbidden_retry_seconds:g}s ({retry + 1}/{settings.forbidden_retries})"
    elif forbidden:
        message += f"; gave up after {retry + 1} attempts (fix the operator's RBAC, then edit or re-apply the RLJob)"
    reason = "Forbidden" if forbidden else "CreateRejected"
    patch.status.update(failed_status(message, reason, dict(status), datetime.now(timezone.utc), generation))
    kopf.warn(body, reason=reason, message=message)
    if retrying:
        return kopf.TemporaryError(message, delay=settings.forbidden_retry_seconds)
    return kopf.PermanentError(message)
