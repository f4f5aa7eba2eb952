"""Operator: kopf reconciles RLJobs into learners, actors, the buffer and sandboxes.

Pure parts (unit-tested without a cluster):

* ``tpu`` — accelerator + topology -> slice shape (hosts, chips per host);
* ``manifests``, ``learner_workload``, ``children`` — spec -> desired child manifests;
* ``observe``, ``jobstatus`` — children and buffer Stats -> ``status`` and conditions;
* ``control`` — staleness/starvation -> actor replicas and buffer admission;
* ``zombies`` — pods -> sandbox pods to delete;
* ``rbac`` — the permissions the operator needs, as data (the Helm chart's source).

API-facing parts: ``kube`` (a thin dict client), ``bufferstats`` (Stats over gRPC),
``reconcile`` (apply/observe children), ``job_targets`` (a look's actor target and builder
context), ``handlers`` (thin kopf handlers), ``kopf_setup`` (kopf's settings and login),
``kopf_errors`` (API failures as kopf's retries), ``metrics``,
``settings`` (``OperatorSettings``) and ``cli`` (``stoker operator``). Never imports JAX.
"""
