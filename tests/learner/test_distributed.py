"""Multi-host start: the TPU pod environment -> jax.distributed.initialize arguments."""

from __future__ import annotations

import pytest

from stoker.distributed import (
    DistributedConfig, DistributedEnvError, Processes, broadcast_int, from_environment, padded_size,
)


def test_single_host_needs_no_distributed_init() -> None:
    assert from_environment({}) is None
    assert from_environment({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "host-0"}) is None


def test_one_slice_of_four_hosts() -> None:
    env = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc,w-2.svc,w-3.svc"}
    assert from_environment(env) == DistributedConfig("w-0.svc:8482", 4, 2)


def test_multislice_process_ids_are_slice_major() -> None:
    env = {
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "a,b",
        "MEGASCALE_SLICE_ID": "2",
        "MEGASCALE_NUM_SLICES": "3",
        "MEGASCALE_COORDINATOR_ADDRESS": "job-slice-0-0.job:8080",
    }
    # process id = worker + slice * hosts_per_slice = 1 + 2 * 2
    assert from_environment(env) == DistributedConfig("job-slice-0-0.job:8482", 6, 5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TPU_WORKER_ID": "4", "TPU_WORKER_HOSTNAMES": "a,b"}, "TPU_WORKER_ID=4; expected 0..1"),
        ({"TPU_WORKER_ID": "x", "TPU_WORKER_HOSTNAMES": "a,b"}, "expected an integer"),
        ({"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "0"}, "MEGASCALE_COORDINATOR_ADDRESS is unset"),
        ({"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID=2; expected 0..1"),
    ],
)
def test_inconsistent_environments_are_explained(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistributedEnvError, match=message):
        from_environment(env)


def test_an_explicit_topology_wins_over_the_tpu_variables() -> None:
    env = {
        "STOKER_NUM_PROCESSES": "2", "STOKER_PROCESS_ID": "1", "STOKER_COORDINATOR_ADDRESS": "127.0.0.1:5000",
        "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "a,b,c,d",
    }
    assert from_environment(env) == DistributedConfig("127.0.0.1:5000", 2, 1)
    assert from_environment({"STOKER_NUM_PROCESSES": "1"}) is None


def test_the_heartbeat_timeout_bounds_failure_detection_and_is_configurable() -> None:
    from stoker.distributed import HEARTBEAT_TIMEOUT_SECONDS

    env = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "a,b"}
    assert from_environment(env).heartbeat_timeout_seconds == HEARTBEAT_TIMEOUT_SECONDS  # type: ignore[union-attr]
    tuned = from_environment({**env, "STOKER_HEARTBEAT_TIMEOUT_SECONDS": "15"})
    assert tuned is not None and tuned.heartbeat_timeout_seconds == 15


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STOKER_NUM_PROCESSES": "2", "STOKER_PROCESS_ID": "2", "STOKER_COORDINATOR_ADDRESS": "h:1"},
         "STOKER_PROCESS_ID=2; expected 0..1"),
        ({"STOKER_NUM_PROCESSES": "2", "STOKER_PROCESS_ID": "0"}, "STOKER_COORDINATOR_ADDRESS is unset"),
        ({"STOKER_HEARTBEAT_TIMEOUT_SECONDS": "0"}, "expected >= 1"),
    ],
)
def test_bad_explicit_topologies_are_explained(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistributedEnvError, match=message):
        from_environment(env)


def test_one_process_shares_nothing() -> None:
    from stoker.learner import multihost

    one = Processes()
    assert one.primary and not one.multi
    batch = object()
    assert multihost.share_step(one, batch, False) == (False, batch)  # type: ignore[arg-type]
    assert multihost.share_step(one, None, True) == (True, None)
    assert broadcast_int(one, 7) == 7
    # Payloads pad to powers of two: a handful of broadcast programs per run, not one per batch.
    assert [padded_size(n) for n in (0, 1, 4096, 4097, 100_000)] == [4096, 4096, 4096, 8192, 131072]
