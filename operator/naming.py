"""Deterministic child names and the labels every child carries.

Names are derived from the RLJob's name alone, so a retried create finds the object it made before
(409 Conflict is success) and nothing needs ``generateName``. How long the RLJob's name may be is
``stoker.jobname``'s rule (the learner JobSet's pod names are the longest).
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.labels import JOB_LABEL, ROLE_LABEL
from stoker.jobname import LEARNER_SUFFIX, ROLLOUT_SUFFIX

MANAGED_BY = "stoker-operator"

ROLE_LEARNER = "learner"
ROLE_ACTOR = "actor"
ROLE_BUFFER = "buffer"
ROLE_ROLLOUT = "rollout"


@dataclass(frozen=True)
class Names:
    job: str

    @property
    def learner(self) -> str:
        return f"{self.job}{LEARNER_SUFFIX}"  # stoker.jobname's name limit is built on it

    def learner_slice_job(self, slice_index: int) -> str:
        """One Indexed Job per slice in the no-JobSet fallback."""
        return f"{self.job}-learner-{slice_index}"

    @property
    def learner_run(self) -> str:
        """PersistentVolumeClaim of a single-host learner's run directory."""
        return f"{self.job}-learner-run"

    @property
    def weights(self) -> str:
        """The Service actors fetch weights from: the learner's first host."""
        return f"{self.job}-weights"

    @property
    def actors(self) -> str:
        return f"{self.job}-actor"

    @property
    def rollout(self) -> str:
        """The rollout tier's Service (what actors call) and its single-host Deployment."""
        return f"{self.job}{ROLLOUT_SUFFIX}"

    def rollout_server(self, index: int) -> str:
        """One multi-host rollout server's JobSet (stoker.jobname's rollout name limit)."""
        return f"{self.job}{ROLLOUT_SUFFIX}-{index}"

    @property
    def buffer(self) -> str:
        return f"{self.job}-buffer"

    @property
    def buffer_token(self) -> str:
        return f"{self.job}-buffer-token"

    @property
    def buffer_control(self) -> str:
        return f"{self.job}-buffer-control"

    @property
    def spec_config(self) -> str:
        return f"{self.job}-spec"

    @property
    def sandbox_manager(self) -> str:
        """ServiceAccount, Role and RoleBinding of the pods that create sandbox pods."""
        return f"{self.job}-sandbox-manager"

    @property
    def sandbox_policy(self) -> str:
        return f"{self.job}-sandboxes"


def labels(job: str, role: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The common labels: the two Stoker keys everything selects on, plus the recommended ones."""
    return {
        **(extra or {}),
        JOB_LABEL: job,
        ROLE_LABEL: role,
        "app.kubernetes.io/name": "stoker",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector(job: str, role: str) -> dict[str, str]:
    """The immutable part of the labels, used in selectors."""
    return {JOB_LABEL: job, ROLE_LABEL: role}
