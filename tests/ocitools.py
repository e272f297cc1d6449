"""Test helpers: write OCI image layouts, oci-archives and docker-archives from Python."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import zstandard

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"

Member = tuple[tarfile.TarInfo, bytes]


def entry(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    *,
    mode: int | None = None,
    mtime: int = 1_700_000_000,
    linkname: str = "",
    uid: int = 0,
    gid: int = 0,
) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode if mode is not None else (0o755 if kind == tarfile.DIRTYPE else 0o644)
    ti.mtime, ti.linkname, ti.uid, ti.gid = mtime, linkname, uid, gid
    ti.size = len(data) if kind == tarfile.REGTYPE else 0
    return ti, data


def tar_bytes(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if ti.size else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def compress(data: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


class Layout:
    """An OCI image layout being written: blobs, manifests, an index."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes) -> str:
        d = sha(data)
        (self.root / "blobs" / "sha256" / d[7:]).write_bytes(data)
        return d

    def image(
        self,
        layers: list[list[Member]],
        *,
        compression: str = "gzip",
        config: dict[str, Any] | None = None,
        arch: str = "amd64",
        diff_ids: list[str] | None = None,
    ) -> dict[str, Any]:
        """Write layers, config and manifest; returns the manifest descriptor (not yet indexed)."""
        descs, ids = [], []
        for members in layers:
            raw = tar_bytes(members)
            blob = compress(raw, compression)
            mt = MT_LAYER + ("" if compression == "none" else "+" + compression)
            descs.append({"mediaType": mt, "digest": self.blob(blob), "size": len(blob)})
            ids.append(sha(raw))
        cfg = {
            "architecture": arch,
            "os": "linux",
            "config": config or {"Env": ["PATH=/usr/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids if diff_ids is not None else ids},
        }
        cdata = json.dumps(cfg).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": {"mediaType": MT_CONFIG, "digest": self.blob(cdata), "size": len(cdata)},
            "layers": descs,
        }
        mdata = json.dumps(manifest).encode()
        return {
            "mediaType": MT_MANIFEST,
            "digest": self.blob(mdata),
            "size": len(mdata),
            "platform": {"os": "linux", "architecture": arch},
        }

    def tag(self, desc: dict[str, Any], ref: str | None) -> None:
        d = dict(desc)
        if ref is not None:
            d["annotations"] = {"org.opencontainers.image.ref.name": ref}
        self.index.append(d)
        self.write_index()

    def multi(self, descs: list[dict[str, Any]]) -> dict[str, Any]:
        data = json.dumps({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": descs}).encode()
        return {"mediaType": MT_INDEX, "digest": self.blob(data), "size": len(data)}

    def write_index(self) -> None:
        (self.root / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "manifests": self.index})
        )


def archive(directory: Path, out: Path) -> None:
    """Tar a directory (an oci-archive of a layout), uncompressed."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath) / name
                tf.add(full, str(full.relative_to(directory)))


def docker_archive(out: Path, layers: list[list[Member]], tag: str, config: dict[str, Any]) -> str:
    """A docker-save style archive; returns the config digest."""
    raws = [tar_bytes(m) for m in layers]
    cfg = dict(config)
    cfg["rootfs"] = {"type": "layers", "diff_ids": [sha(r) for r in raws]}
    cdata = json.dumps(cfg).encode()
    cdig = sha(cdata)
    files: dict[str, bytes] = {cdig[7:] + ".json": cdata}
    names = []
    for r in raws:
        name = sha(r)[7:] + "/layer.tar"
        files[name] = r
        names.append(name)
    files["manifest.json"] = json.dumps(
        [{"Config": cdig[7:] + ".json", "RepoTags": [tag], "Layers": names}]
    ).encode()
    with tarfile.open(out, "w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return cdig
