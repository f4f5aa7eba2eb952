"""The whole desired state of one RLJob: which children exist, given its mode and suspension."""

from __future__ import annotations

from stoker.operator.learner_workload import build_learner, build_learner_run_pvc, build_weights_service
from stoker.operator.manifests import (
    JobContext,
    Manifest,
    build_actor_deployment,
    build_buffer_control_configmap,
    build_buffer_deployment,
    build_buffer_pvc,
    build_buffer_service,
    build_sandbox_manager_account,
    build_sandbox_network_policy,
    build_spec_configmap,
)
from stoker.operator.rollout_workload import build_rollout


def desired_children(ctx: JobContext) -> list[Manifest]:
    """Every child except the generated token Secret (random, so created separately, once), in
    creation order.

    ``disaggregated``: learner, actors, buffer, the rollout tier (with ``spec.rollout``) and the
    sandbox plumbing; for a job that trains on a dataset file (SFT, DPO on pairs) the learner
    only. ``colocated``: the learner
    samples and steps environments itself, so only the learner and its sandbox plumbing.
    A suspended job has no learner and zero actors; the buffer (and its data) and the learner's
    run volume stay.
    """
    children: list[Manifest] = [build_spec_configmap(ctx), *build_sandbox_manager_account(ctx)]
    children += build_learner_run_pvc(ctx)
    children.append(build_sandbox_network_policy(ctx))
    # The learner comes before the buffer and actors: the learner is what the cluster is likeliest
    # to refuse (JobSet's webhook, quota, Kueue), and actors with no learner would only burn CPU.
    if not ctx.spec.suspend:
        children += build_learner(ctx)
    if ctx.streams:  # not for a job that trains on a dataset file: the learner alone
        children += [
            build_buffer_control_configmap(ctx),
            build_buffer_pvc(ctx),
            build_buffer_service(ctx),
            build_buffer_deployment(ctx),
            *build_rollout(ctx),  # before the actors, which call it
            build_actor_deployment(ctx),
            build_weights_service(ctx),
        ]
    return children
