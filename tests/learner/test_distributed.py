"""Multi-host start: the TPU pod environment -> jax.distributed.initialize arguments."""

from __future__ import annotations

import pytest

from stoker.learner.distributed import DistributedConfig, DistributedEnvError, from_environment


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
