"""The runnable OCI image that lets containerd pull a bundle lazily (docs/containerd.md).

containerd unpacks an image layer by layer into snapshots. A pushed bundle (the artifact of
push.py) is not something it can pull: its layers are meta.img, the blockmap and packs.
So `push --image` puts a small ordinary image beside it: an OCI image config (the
bundle's `image_config`: entrypoint, env, user, workdir) and ONE placeholder layer whose
descriptor annotations name the bundle. containerd passes `containerd.io/snapshot/*`
annotations to the snapshotter's Prepare; ours (btrfs-ublk-snapshotter) mounts the bundle
for that layer and answers "already exists", so the placeholder blob is never fetched.

The placeholder layer holds one file naming the image id, so its diff id (and therefore
containerd's chain id) is unique to the bundle: two bundles never share a snapshot, and
a plain image never collides with one. Pulled with any other snapshotter the image
unpacks to just that file, whose text says what is needed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from typing import Any

from btrfs_ublk_image.errors import ImageError

MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
# containerd hands descriptor annotations with this prefix to the snapshotter as labels
SNAPSHOT_LABEL_PREFIX = "containerd.io/snapshot/btrfs-ublk-image."
LABEL_BUNDLE = SNAPSHOT_LABEL_PREFIX + "bundle"  # digest of the bundle artifact manifest
LABEL_IMAGE_ID = SNAPSHOT_LABEL_PREFIX + "image-id"
LABEL_LOCATION = SNAPSHOT_LABEL_PREFIX + "location"  # oci://REG/REPO@sha256:… as pushed
ANNOTATION_BUNDLE = "dev.btrfs-ublk-image.bundle"  # the same digest, on the image manifest
PLACEHOLDER_NAME = ".btrfs-ublk-image"
BUNDLE_TAG_SUFFIX = "-bundle"  # the bundle artifact's tag beside the image's tag


def bundle_tag(tag: str) -> str:
    """The tag the bundle artifact gets beside a runnable image tagged ``tag``."""
    out = tag + BUNDLE_TAG_SUFFIX
    if len(out) > 128:
        raise ImageError(f"tag {tag!r}: too long to add {BUNDLE_TAG_SUFFIX!r} (128 at most)")
    return out


def placeholder_layer(image_id: str) -> tuple[bytes, str]:
    """The placeholder layer for ``image_id``: (gzip blob, diff id). Deterministic: a
    ustar archive with fixed times and owners, gzip without name or mtime."""
    text = (
        f"{image_id}\n"
        "This image is a btrfs-ublk-image bundle. Its files are served lazily by the\n"
        "btrfs-ublk-snapshotter containerd snapshotter; this layer only names the bundle.\n"
    ).encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PLACEHOLDER_NAME)
        info.size, info.mode, info.mtime = len(text), 0o444, 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(text))
    tar_bytes = raw.getvalue()
    gz = gzip.compress(tar_bytes, compresslevel=9, mtime=0)
    return gz, "sha256:" + hashlib.sha256(tar_bytes).hexdigest()


def image_config(kept: Any, image_id: str, diff_id: str, platform: str) -> bytes:
    """The runnable image's config: ``kept``, the bundle manifest's ``image_config``
    (from its OCI source: env, entrypoint, user, ...; None for other sources), over one
    placeholder layer. ``platform`` is ``os/arch[/variant]``, used where none was kept."""
    kept = kept if isinstance(kept, dict) else {}
    os_name, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    config: dict[str, Any] = {
        "architecture": kept.get("architecture") or arch,
        "os": kept.get("os") or os_name,
    }
    if kept.get("variant") or variant:
        config["variant"] = kept.get("variant") or variant
    runtime = kept.get("config")
    config["config"] = runtime if isinstance(runtime, dict) else {}
    config["rootfs"] = {"type": "layers", "diff_ids": [diff_id]}
    config["history"] = [{"created_by": f"btrfs-ublk-image bundle {image_id}"}]
    return json.dumps(config, separators=(",", ":"), sort_keys=True).encode()


def layer_annotations(image_id: str, bundle_digest: str, location: str) -> dict[str, str]:
    return {
        LABEL_BUNDLE: bundle_digest,
        LABEL_IMAGE_ID: image_id,
        LABEL_LOCATION: location,
    }
