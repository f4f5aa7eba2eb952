"""How long an RLJob's name may be, from the names its learner's pods get.

JobSet's admission webhook (``ValidateCreate`` in JobSet's ``pkg/webhooks/jobset_webhook.go``, the
same rule from v0.8 to today) refuses a JobSet whose longest pod name is not an RFC 1035 label:
``<jobset>-<replicatedJob>-<last job index>-<last pod index>`` plus a generated 6-character
suffix (``-abcde``) must be at most 63 characters. The learner JobSet is ``<job>-learner`` with
one replicated job ``slice``, so the limit depends on the digits of the last slice and host
index. Every other child name (``<job>-sandbox-manager`` the longest) and the Indexed-Job
fallback's pod names are shorter than that, so this one rule keeps them all valid.
"""

from __future__ import annotations

LEARNER_SUFFIX = "-learner"
"""The learner's JobSet (and the fallback's headless Service) is ``<job>-learner``."""
REPLICATED_JOB = "slice"
DNS_LABEL_MAX = 63
GENERATED_SUFFIX = len("-abcde")
# <job> + "-learner" + "-slice-" + <slice> + "-" + <host> + "-abcde"
FIXED_OVERHEAD = len(LEARNER_SUFFIX) + len(f"-{REPLICATED_JOB}-") + len("-") + GENERATED_SUFFIX


def max_name_length(num_slices: int, hosts_per_slice: int) -> int:
    """The longest RLJob name whose learner JobSet's webhook accepts its pod names."""
    return DNS_LABEL_MAX - FIXED_OVERHEAD - len(str(num_slices - 1)) - len(str(hosts_per_slice - 1))


def name_problems(name: str, num_slices: int, hosts_per_slice: int) -> list[str]:
    """Why ``name`` cannot name an RLJob with this learner shape (Services need a leading letter)."""
    problems = []
    limit = max_name_length(num_slices, hosts_per_slice)
    if len(name) > limit:
        problems.append(
            f"got {len(name)} characters; expected at most {limit} for {num_slices} slice(s) of "
            f"{hosts_per_slice} host(s), so the learner's pod names stay DNS labels (JobSet's rule)"
        )
    if not name[:1].isalpha():
        problems.append(f"got {name!r}; expected a name starting with a letter (it names Services)")
    return problems


ROLLOUT_SUFFIX = "-rollout"
"""The rollout tier's Deployment and Service are ``<job>-rollout``; a multi-host TPU tier runs one
JobSet per server, ``<job>-rollout-<server>``, each with one replicated job ``slice``."""
# <job> + "-rollout-" + <server> + "-slice-" + "0" + "-" + <host> + "-abcde"
ROLLOUT_FIXED_OVERHEAD = len(ROLLOUT_SUFFIX) + len("-") + len(f"-{REPLICATED_JOB}-") + len("0") + len("-") + GENERATED_SUFFIX


def max_rollout_name_length(max_replicas: int, hosts_per_server: int) -> int:
    """The longest RLJob name whose multi-host rollout JobSets' pod names JobSet's webhook accepts."""
    return DNS_LABEL_MAX - ROLLOUT_FIXED_OVERHEAD - len(str(max_replicas - 1)) - len(str(hosts_per_server - 1))


def rollout_name_problems(name: str, max_replicas: int, hosts_per_server: int) -> list[str]:
    """Why ``name`` cannot name an RLJob whose rollout servers span ``hosts_per_server`` TPU hosts."""
    limit = max_rollout_name_length(max_replicas, hosts_per_server)
    if len(name) <= limit:
        return []
    return [
        f"got {len(name)} characters; expected at most {limit} for up to {max_replicas} rollout server(s) of "
        f"{hosts_per_server} host(s), so the rollout pods' names stay DNS labels (JobSet's rule)"
    ]
