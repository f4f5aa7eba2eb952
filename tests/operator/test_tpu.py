"""TPU slice shapes: the table GKE provisions from, including topologies it cannot."""

from __future__ import annotations

import pytest

from stoker.operator.tpu import SliceShape, TopologyError, slice_shape

# (accelerator, topology, chips, hosts, chips per host)
VALID = [
    ("tpu-v4-podslice", "2x2x1", 4, 1, 4),
    ("tpu-v4-podslice", "2x2x2", 8, 2, 4),
    ("tpu-v4-podslice", "2x2x4", 16, 4, 4),
    ("tpu-v4-podslice", "2x4x4", 32, 8, 4),
    ("tpu-v4-podslice", "4x4x8", 128, 32, 4),
    ("tpu-v5p-slice", "2x2x1", 4, 1, 4),
    ("tpu-v5p-slice", "2x2x2", 8, 2, 4),
    ("tpu-v5p-slice", "4x4x4", 64, 16, 4),
    ("tpu-v5p-slice", "8x8x16", 1024, 256, 4),
    ("tpu-v5-lite-podslice", "1x1", 1, 1, 1),
    ("tpu-v5-lite-podslice", "2x2", 4, 1, 4),
    ("tpu-v5-lite-podslice", "2x4", 8, 1, 8),
    ("tpu-v5-lite-podslice", "4x4", 16, 4, 4),
    ("tpu-v5-lite-podslice", "16x16", 256, 64, 4),
    ("tpu-v6e-slice", "1x1", 1, 1, 1),
    ("tpu-v6e-slice", "2x4", 8, 1, 8),
    ("tpu-v6e-slice", "4x8", 32, 8, 4),
    ("tpu-v6e-slice", "8x16", 128, 32, 4),
]

# (accelerator, topology, words the message must contain)
INVALID = [
    ("tpu-v4-podslice", "2x4", ["2 dimensions", "3-D"]),  # v4 is 3-D
    ("tpu-v5p-slice", "4x4x6", ["multiples of 4"]),
    ("tpu-v5p-slice", "2x2x3", ["multiples of 4"]),
    ("tpu-v4-podslice", "16x16x32", ["at most 4096"]),
    ("tpu-v5-lite-podslice", "2x2x1", ["3 dimensions", "2-D"]),  # v5e is 2-D
    ("tpu-v6e-slice", "3x3", ["expected one of"]),
    ("tpu-v6e-slice", "4x2", ["expected one of"]),  # GKE names it 2x4
    ("tpu-v6e-slice", "32x32", ["expected one of"]),
    ("tpu-v6e-slice", None, ["needs learner.topology"]),
    ("tpu-v7-nonexistent", "2x2", ["not a TPU"]),
]


@pytest.mark.parametrize(("accelerator", "topology", "chips", "hosts", "per_host"), VALID)
def test_valid_topologies(accelerator: str, topology: str, chips: int, hosts: int, per_host: int) -> None:
    shape = slice_shape(accelerator, topology)
    assert shape == SliceShape(chips=chips, hosts=hosts, chips_per_host=per_host)
    assert shape.hosts * shape.chips_per_host == shape.chips
    assert shape.multi_host == (hosts > 1)


@pytest.mark.parametrize(("accelerator", "topology", "words"), INVALID)
def test_invalid_topologies_say_why(accelerator: str, topology: str | None, words: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        slice_shape(accelerator, topology)
    for word in words:
        assert word in str(caught.value)
