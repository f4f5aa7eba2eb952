"""The single-blob format: one version as one safetensors blob of Hugging Face-named arrays, with
its size and sha256, checked before decoding so truncated or damaged bytes raise
``WeightsCorrupt`` instead of loading silently wrong."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from stoker.model.hf import CheckpointError, decode_safetensors, encode_safetensors
from stoker.weights.errors import WeightsCorrupt


@dataclass(frozen=True)
class WeightsInfo:
    version: int
    sha256: str
    size_bytes: int
    sharded: bool = False  # a ``stoker.weights.shards`` manifest rather than one blob


@dataclass(frozen=True)
class Blob:
    """One encoded version, the same bytes for every transport."""

    info: WeightsInfo
    data: bytes


def encode_weights(version: int, flat: Mapping[str, np.ndarray]) -> Blob:
    data = encode_safetensors(flat, metadata={"policy_version": str(version)})
    return Blob(WeightsInfo(version, hashlib.sha256(data).hexdigest(), len(data)), data)


def decode_weights(info: WeightsInfo, data: bytes) -> dict[str, np.ndarray]:
    """Check ``data`` against ``info`` and decode it."""
    if len(data) != info.size_bytes:
        raise WeightsCorrupt(f"version {info.version}: got {len(data)} bytes, expected {info.size_bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise WeightsCorrupt(f"version {info.version}: sha256 {digest[:12]}... != published {info.sha256[:12]}...")
    try:
        return decode_safetensors(data)
    except CheckpointError as err:
        raise WeightsCorrupt(f"version {info.version}: {err}") from err
