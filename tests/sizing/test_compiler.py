"""The bytes a program's collectives move per device, read from compiled HLO text."""

from __future__ import annotations

from stoker.sizing.compiler import collective_traffic

# Lines in the form libtpu's compiled HLO prints them (8 devices as 2 slices of 4: ids 0-3, 4-7).
HLO = """
  %all-gather.1 = bf16[256,256]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %reduce-scatter.2 = f32[64]{0} reduce-scatter(%q), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}
  %all-reduce-start.3 = f32[8]{0} all-reduce-start(%r), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}
  %all-reduce-done.3 = f32[8]{0} all-reduce-done(%all-reduce-start.3)
  %collective-permute.4 = f32[16]{0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %add.5 = f32[16]{0} add(%collective-permute.4, %x)
"""


def test_each_collective_moves_its_ring_share_over_ici_or_dcn() -> None:
    traffic, count = collective_traffic(HLO, 8, lambda device: device // 4)
    assert count == 4  # the -done half of an async pair is not a second collective
    # all-gather over axis_0 (devices 0, 2, 4, 6: both slices): 128 KiB x 3/4 over DCN;
    # all-reduce {0, 4}: 32 bytes x 2 x 1/2 over DCN.
    assert traffic["dcn"] == 256 * 256 * 2 * 3 / 4 + 32
    # reduce-scatter over axis_1 ({0, 1}: one slice): a 256-byte shard x (2 - 1); permute 0<->1: 64 bytes.
    assert traffic["ici"] == 256 + 64
