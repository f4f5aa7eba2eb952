"""Sharded weights: every learner process publishes only its own shards, readers fetch by slice.

A version is a *manifest* (``ShardManifest``): per tensor (Hugging Face names and layout, as in
the single blob) its global shape, dtype and shards, each a box of index ranges, the learner
process holding it and a crc32 per block of rows. The bytes of one shard are its C-order array.
A version exists for readers only once its manifest is committed, which happens after every
process wrote its part; the format, the commit and why this is not Orbax:
docs/architecture.md, "Sharded weights".

One import for the pieces, which live in their own modules: the format and its manifest
(``shard_format``), reading by slice and staging (``shard_read``), a model's layout
(``shard_layout``), the shared-directory transport (``shard_directory``) and the in-process
hand-over (``device_weights``).
"""

from stoker.weights.device_weights import DeviceWeights
from stoker.weights.shard_directory import LATEST_FILE, ShardDirectory, fsync_file
from stoker.weights.shard_format import (
    BLOCK_BYTES, FORMAT, MANIFEST_PREFIX, READ_THREADS, RUN_BYTES, BlockGeometry, Box, ShardManifest, ShardRecord,
    ShardsCorrupt, ShardsMissing, TensorRecord, as_bytes, block_rows, checksums, crc32, dtype_of, folder_name, geometry,
    intersect, manifest_name, rows_of,
)
from stoker.weights.shard_layout import ParamSlot, layout_of
from stoker.weights.shard_read import ReadStats, ShardedWeights, ShardSource, StagedWeights

__all__ = [
    "BLOCK_BYTES", "FORMAT", "LATEST_FILE", "MANIFEST_PREFIX", "READ_THREADS", "RUN_BYTES", "BlockGeometry", "Box",
    "DeviceWeights", "ParamSlot", "ReadStats", "ShardDirectory", "ShardManifest", "ShardRecord", "ShardSource",
    "ShardedWeights", "ShardsCorrupt", "ShardsMissing", "StagedWeights", "TensorRecord", "as_bytes", "block_rows",
    "checksums", "crc32", "dtype_of", "folder_name", "fsync_file", "geometry", "intersect", "layout_of",
    "manifest_name", "rows_of",
]
