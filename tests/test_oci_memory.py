"""Memory: a build streams every layer once; peak RSS does not grow with the data size."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from ocitools import Layout

pytestmark = [pytest.mark.unit, pytest.mark.slow]


def _image(root: Path, size: int) -> None:
    """Two uncompressed layers, each one file of ``size`` random bytes plus 500 small files."""
    lay = Layout(root)
    descs, diff_ids = [], []
    for i in range(2):
        blob = root / f"layer{i}.tar"
        with tarfile.open(blob, "w", format=tarfile.PAX_FORMAT) as tf:
            ti = tarfile.TarInfo(f"l{i}/big")
            ti.size = size
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child: stream random bytes
                os.close(r)
                left = size
                while left:
                    left -= os.write(w, os.urandom(min(left, 1 << 20)))
                os._exit(0)
            os.close(w)
            with os.fdopen(r, "rb") as src:
                tf.addfile(ti, src)
            os.waitpid(pid, 0)
            for j in range(500):
                small = tarfile.TarInfo(f"l{i}/small/{j}")
                tf.addfile(small)
        h = hashlib.sha256()
        with open(blob, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        d = "sha256:" + h.hexdigest()
        blob.rename(root / "blobs" / "sha256" / d[7:])
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                      "size": (root / "blobs" / "sha256" / d[7:]).stat().st_size})  # fmt: skip
        diff_ids.append(d)
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()  # fmt: skip
    manifest = json.dumps({"schemaVersion": 2, "config": {
        "mediaType": "application/vnd.oci.image.config.v1+json", "digest": lay.blob(cfg),
        "size": len(cfg)}, "layers": descs}).encode()  # fmt: skip
    lay.tag({"mediaType": "application/vnd.oci.image.manifest.v1+json",
             "digest": lay.blob(manifest), "size": len(manifest)}, "t")  # fmt: skip


def _peak_rss_kib(spec: Path, out: Path) -> int:
    res = subprocess.run(
        [
            "/usr/bin/time",
            "-f",
            "%M",
            sys.executable,
            "-m",
            "btrfs_ublk_image",
            "build",
            str(spec),
            "-o",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    return int(res.stderr.strip().splitlines()[-1])


def test_peak_memory_does_not_follow_data_size(tmp_path: Path) -> None:
    rss = {}
    for name, size in (("small", 1 << 20), ("big", 512 << 20)):
        _image(tmp_path / name, size)
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(f"version: 1\nname: m\nlayers:\n  - oci: {{path: {name}, ref: t}}\n")
        rss[name] = _peak_rss_kib(spec, tmp_path / f"{name}.bundle")
    print(f"\npeak RSS: 2 x 1 MiB layers {rss['small']} KiB, 2 x 512 MiB layers {rss['big']} KiB")
    assert rss["big"] - rss["small"] < 16 * 1024, rss
