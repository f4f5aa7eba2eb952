"""How the operator wires the weight path beyond the learner's Service: rollout servers that relay
sharded weights to each other (registering with the learner, no stable pod names needed), and
actors that read from the learner's weights volume. Every child validated against the real
Kubernetes and JobSet schemas; every command line parsed by the real CLI."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.cli import build_parser
from stoker.operator.children import desired_children
from stoker.operator.weights_volume import GCSFUSE_ANNOTATION, WEIGHTS_MOUNT
from stoker.rollout.cli import relay_problem

from .test_manifests import GPU_SERVER, TPU_SERVER, _pods, check_all, make_ctx

MULTI_HOST_LEARNER = {"accelerator": "tpu-v5p-slice", "topology": "2x2x2"}  # 2 hosts: publishes sharded


def _expanded(args: list[str], pod_ip: str = "10.8.0.7") -> list[str]:
    """``args`` as the kubelet runs them: ``$(POD_IP)`` replaced by the pod's address."""
    return [a.replace("$(POD_IP)", pod_ip) for a in args]


@pytest.mark.parametrize(("jobset_api", "server"), [(True, GPU_SERVER), (True, TPU_SERVER), (False, GPU_SERVER)])
def test_servers_of_a_sharded_learner_relay_and_register_with_its_weights_server(jobset_api: bool, server: dict[str, Any]) -> None:
    ctx = make_ctx(jobset_api=jobset_api, rollout={"replicas": 2, **server}, rollout_replicas=2, learner=MULTI_HOST_LEARNER)
    children = desired_children(ctx)
    check_all(children)
    servers = _pods(children, "rollout")
    assert len(servers) == (2 if server is TPU_SERVER else 1)  # a JobSet per multi-host server, one Deployment
    for _, pod in servers:
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # what $(POD_IP) expands to
        assert {"name": "weights-relay", "containerPort": 50054, "protocol": "TCP"} in container["ports"]
        assert {"name": "relay-stream", "containerPort": 50056, "protocol": "TCP"} in container["ports"]
        args = build_parser(container["args"]).parse_args(_expanded(container["args"]))
        assert args.command == "rollout" and args.weights == "lake-weights:50052"  # registers with the learner
        assert args.weights_relay_port == "50054" and args.weights_relay_advertise == "10.8.0.7:50054"
        assert args.weights_relay_stream_port == 50056  # the stream the servers below read first
        assert args.weights_relay_from == []  # upstreams come from the registry, per version
        assert relay_problem(args) is None


@pytest.mark.parametrize(
    "learner",
    [
        {"accelerator": "cpu"},  # one process: a single blob, fetched whole
        {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"},  # one host
        {**MULTI_HOST_LEARNER, "weightsVolume": {"gcsBucket": "lake-weights"}},  # the volume serves every reader
    ],
)
def test_servers_do_not_relay_when_the_learner_does_not_serve_sharded_weights_itself(learner: dict[str, Any]) -> None:
    ctx = make_ctx(rollout={"replicas": 2, **GPU_SERVER}, rollout_replicas=2, learner=learner)
    for _, pod in _pods(desired_children(ctx), "rollout"):
        (container,) = pod["containers"]
        assert not [a for a in container["args"] if a.startswith("--weights-relay")]
        assert "weights-relay" not in {p["name"] for p in container["ports"]}


@pytest.mark.parametrize(("port", "relay", "stream"), [(50054, 50055, 50056), (50056, 50054, 50057)])
def test_the_relay_ports_step_aside_for_a_server_port_that_takes_one(port: int, relay: int, stream: int) -> None:
    ctx = make_ctx(rollout={"replicas": 1, "port": port, **GPU_SERVER}, rollout_replicas=1, learner=MULTI_HOST_LEARNER)
    children = desired_children(ctx)
    check_all(children)
    ((_, pod),) = _pods(children, "rollout")
    args = build_parser(pod["containers"][0]["args"]).parse_args(_expanded(pod["containers"][0]["args"]))
    assert args.port == port and args.weights_relay_port == str(relay) and args.weights_relay_advertise == f"10.8.0.7:{relay}"
    assert args.weights_relay_stream_port == stream
    assert sorted(p["containerPort"] for p in pod["containers"][0]["ports"]) == sorted([port, relay, stream, 9090])


@pytest.mark.parametrize("learner", [{"accelerator": "cpu"}, {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"}, MULTI_HOST_LEARNER])
def test_learner_pods_stream_shards_on_a_pinned_declared_port_a_network_policy_can_name(learner: dict[str, Any]) -> None:
    children = desired_children(make_ctx(learner=learner))
    check_all(children)
    pods = _pods(children, "learner")
    assert pods
    for _, pod in pods:
        (container,) = pod["containers"]
        args = build_parser(container["args"]).parse_args(container["args"])
        assert args.command == "learner" and args.weights_port == "50052" and args.weights_stream_port == 50055
        assert {"name": "weights-stream", "containerPort": 50055, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize(
    ("volume", "source"), [({"gcsBucket": "lake-weights"}, "csi"), ({"persistentVolumeClaim": "lake-weights"}, "persistentVolumeClaim")]
)
def test_actors_sampling_in_process_read_weights_from_the_volume_read_only(volume: dict[str, str], source: str) -> None:
    ctx = make_ctx(learner={**MULTI_HOST_LEARNER, "weightsVolume": volume})
    children = desired_children(ctx)
    check_all(children)
    ((meta, pod),) = _pods(children, "actor")
    (container,) = pod["containers"]
    (weights,) = [v for v in pod["volumes"] if v["name"] == "weights"]
    assert {"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True} in container["volumeMounts"]
    assert weights[source]["readOnly"] is True
    assert (meta["annotations"].get(GCSFUSE_ANNOTATION) == "true") is (source == "csi")  # GKE's FUSE sidecar
    args = build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "actor" and args.weights == WEIGHTS_MOUNT


def test_actors_of_a_rollout_tier_or_without_a_volume_keep_the_learners_service() -> None:
    served = make_ctx(rollout={"replicas": 1, **GPU_SERVER}, rollout_replicas=1,
                      learner={**MULTI_HOST_LEARNER, "weightsVolume": {"gcsBucket": "lake-weights"}})
    for ctx in (served, make_ctx(learner=MULTI_HOST_LEARNER)):
        ((meta, pod),) = _pods(desired_children(ctx), "actor")
        (container,) = pod["containers"]
        assert "weights" not in {v["name"] for v in pod["volumes"]}
        assert GCSFUSE_ANNOTATION not in meta["annotations"]
        assert build_parser(container["args"]).parse_args(container["args"]).weights == "lake-weights:50052"
