"""The shared weights volume (``spec.learner.weightsVolume``) in the learner's and the rollout
servers' pods: the learner mounts it read-write and publishes sharded versions into it
(``--weights-dir``, ``--weights-format shards``), the rollout servers mount it read-only and read
by slice from it (``--weights DIR``). docs/gke.md, "Weights at scale"."""

from __future__ import annotations

from typing import Any

from stoker.spec import WeightsVolumeSpec

WEIGHTS_MOUNT = "/var/lib/stoker/weights"
VOLUME_NAME = "weights"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
# GKE injects the FUSE sidecar into pods that carry this annotation.
GCSFUSE_ANNOTATION = "gke-gcsfuse/volumes"
# Shards live under per-version folders that are never created as objects of their own.
GCSFUSE_MOUNT_OPTIONS = "implicit-dirs"


def learner_args(volume: WeightsVolumeSpec | None) -> list[str]:
    return [] if volume is None else ["--weights-dir", WEIGHTS_MOUNT, "--weights-format", "shards"]


def weights_volume_annotations(volume: WeightsVolumeSpec | None) -> dict[str, str]:
    """The pod template's annotations the volume needs (the FUSE sidecar's, for a bucket)."""
    return {GCSFUSE_ANNOTATION: "true"} if volume is not None and volume.gcs_bucket is not None else {}


def add_weights_volume(
    volume: WeightsVolumeSpec | None, pod: dict[str, Any], container: dict[str, Any], *, read_only: bool
) -> None:
    """Add the volume to ``pod`` and its mount to ``container``."""
    if volume is None:
        return
    source: dict[str, Any]
    if volume.gcs_bucket is not None:
        source = {"csi": {
            "driver": GCSFUSE_DRIVER, "readOnly": read_only,
            "volumeAttributes": {"bucketName": volume.gcs_bucket, "mountOptions": GCSFUSE_MOUNT_OPTIONS},
        }}
    else:
        source = {"persistentVolumeClaim": {"claimName": volume.persistent_volume_claim, "readOnly": read_only}}
    pod.setdefault("volumes", []).append({"name": VOLUME_NAME, **source})
    container.setdefault("volumeMounts", []).append({"name": VOLUME_NAME, "mountPath": WEIGHTS_MOUNT, "readOnly": read_only})
