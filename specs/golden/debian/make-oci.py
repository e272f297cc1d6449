#!/usr/bin/env python3
"""Write the Debian golden image's two-layer OCI image layout from its rootfs tarball.

    make-oci.py ROOTFS_TAR OUTDIR [--epoch N] [--change-byte PATH]

Layer 1 is ROOTFS_TAR as it is (gzip). Layer 2 is the normalisation layer: it adds
/etc/golden-release and whites out the backup copies dpkg and debconf leave behind
(``var/lib/dpkg/*-old``, ``var/cache/debconf/*-old``), which record the install run,
not the installed system. Every byte is a function of the inputs: gzip with mtime 0,
entries and JSON in a fixed order, times from ``--epoch``. umoci would stamp the
config and history with the current time, so the layout is written here.

``--change-byte PATH`` adds to layer 2 a copy of PATH from the tarball with its first
byte changed: the tampered image a test uses to show that the committed listing catches
a one-byte change in one package's file.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REF = "bookworm"
# run by-products removed by layer 2 (globs on tar member names without "./")
REMOVED = ("var/lib/dpkg/*-old", "var/cache/debconf/*-old")
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    d = _digest(data)
    (layout / "blobs" / "sha256" / d[7:]).write_bytes(data)
    return {"digest": d, "size": len(data)}


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _member(name: str, epoch: int, data: bytes = b"") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid = len(data), epoch, 0o644, 0, 0
    return ti


def _second_layer(rootfs_tar: Path, epoch: int, change: str | None) -> bytes:
    names: list[str] = []
    changed: tuple[tarfile.TarInfo, bytes] | None = None
    with tarfile.open(rootfs_tar) as tf:
        for ti in tf:
            name = ti.name.removeprefix("./")
            if any(fnmatch.fnmatchcase(name, g) for g in REMOVED):
                names.append(name)
            if change is not None and name == change.lstrip("/"):
                f = tf.extractfile(ti)
                if f is None or ti.size == 0:
                    sys.exit(f"make-oci.py: {change}: not a non-empty regular file in {rootfs_tar}")
                data = bytearray(f.read())
                data[0] ^= 0x01
                ti.name = name
                changed = (ti, bytes(data))
    if change is not None and changed is None:
        sys.exit(f"make-oci.py: {change}: not in {rootfs_tar}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        release = b"golden-debian bookworm (pinned minbase)\n"
        out.addfile(_member("etc/golden-release", epoch, release), io.BytesIO(release))
        for name in sorted(names):
            head, tail = os.path.split(name)
            out.addfile(_member(os.path.join(head, ".wh." + tail), epoch))
        if changed is not None:
            out.addfile(changed[0], io.BytesIO(changed[1]))
    return buf.getvalue()


def make_layout(rootfs_tar: Path, out: Path, epoch: int, change: str | None = None) -> None:
    """Write the layout into ``out`` (replaced atomically: built beside it, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "blobs" / "sha256").mkdir(parents=True)
    (tmp / "oci-layout").write_bytes(_json({"imageLayoutVersion": "1.0.0"}))
    raws = [rootfs_tar.read_bytes(), _second_layer(rootfs_tar, epoch, change)]
    layers = [
        {"mediaType": MT_LAYER_GZIP, **_blob(tmp, gzip.compress(raw, compresslevel=6, mtime=0))}
        for raw in raws
    ]
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "Cmd": ["/bin/bash"],
            "Env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8",
            ],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [_digest(raw) for raw in raws]},
        "history": [
            {"created": created, "created_by": "mmdebstrap --variant=minbase bookworm"},
            {"created": created, "created_by": "make-oci.py: golden-release, run by-products"},
        ],
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, **_blob(tmp, _json(config))},
        "layers": layers,
    }
    desc = {
        "mediaType": MT_MANIFEST,
        **_blob(tmp, _json(manifest)),
        "annotations": {"org.opencontainers.image.ref.name": REF},
    }
    (tmp / "index.json").write_bytes(_json({"schemaVersion": 2, "manifests": [desc]}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rootfs_tar", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--epoch", type=int, default=1700000000)
    p.add_argument("--change-byte", metavar="PATH", help="tamper: flip a bit of PATH's 1st byte")
    a = p.parse_args()
    make_layout(a.rootfs_tar, a.out, a.epoch, a.change_byte)


if __name__ == "__main__":
    main()
