"""Synthetic benchmark input: many small files plus a few large ones, as ONE pax tarball.

The tree is generated deterministically from a seed (names, sizes, kinds, modes,
owners, times and the bytes themselves), packed with GNU tar (``--format=pax
--sort=name``, without the pax atime and ctime records: a file's ctime is the time it was
generated, so with it each machine's tarball, and the image id, differed) and cached
under the work directory, keyed by the parameters and ``GENERATOR_VERSION``; the
extracted tree is deleted once the tarball exists.

Shape of the small-file set (``InputParams.files`` entries, not counting directories):

* sizes 0..16 KiB: 5% empty, otherwise half log-uniform (many tiny files), half
  uniform (mean about 5 KiB);
* ~10% duplicates: their content comes from a pool of shared blobs, so groups of
  identical files exist (reflink/dedup candidates);
* ~1% symlinks (absolute or same-directory targets), ~1% hardlinks to earlier files;
* spread over 10-way nested directories about 100 entries per leaf (three levels
  for 100k entries) plus one big directory holding 5% of the entries;
* 10% executable, 10% owned by 1000:1000 (when generated as root), mtimes with
  nanoseconds.

The large files (``large_count`` of them, ``large_bytes`` in total) are
incompressible: AES-CTR keystream from ``openssl enc`` when available (fast),
otherwise ``random.randbytes``.

``ensure_oci_layout`` adds, once and cached beside the tarball, an OCI image layout
of it (``oci/``, ref ``latest``): one uncompressed layer whose blob IS the tarball (a
hardlink), its config (``rootfs.diff_ids``), manifest and ``index.json``; the input of
the ``umoci unpack`` baseline and of our build from ``oci:``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from btrfs_ublk_image.hashing import file_sha256

GENERATOR_VERSION = 2
OCI_REF = "latest"  # the ref name of the synthetic input's OCI layout
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
           "s390x": "s390x", "riscv64": "riscv64"}  # fmt: skip
MAX_SMALL = 16 * 1024
_BASE_MTIME_NS = 1_700_000_000 * 1_000_000_000
_EXTS = ("", ".txt", ".py", ".so", ".conf", ".h", ".json", ".gz")


@dataclass(frozen=True)
class InputParams:
    files: int
    large_bytes: int
    large_count: int = 4
    seed: int = 1

    @property
    def key(self) -> str:
        return (
            f"v{GENERATOR_VERSION}-f{self.files}-l{self.large_bytes}"
            f"x{self.large_count}-s{self.seed}"
        )


@dataclass
class InputStats:
    """What the tarball holds; ``entries`` (every name but the root) is the files/s base."""

    entries: int = 0
    directories: int = 0
    regular_names: int = 0  # regular files, counting every hardlink name
    regular_inodes: int = 0
    hardlinks: int = 0  # extra names of an inode
    symlinks: int = 0
    duplicate_files: int = 0  # inodes whose content equals another inode's
    small_bytes: int = 0  # content of the small regular inodes
    large_files: int = 0
    large_bytes: int = 0
    content_bytes: int = 0  # small_bytes + large_bytes: the MB/s base
    unique_bytes: int = 0  # content_bytes counting identical contents once
    tar_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Inputs:
    params: InputParams
    directory: Path
    tar: Path
    spec: Path
    stats: InputStats


def _small_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.525:
        return min(MAX_SMALL, int(math.exp(rng.uniform(0.0, math.log(MAX_SMALL + 1)))))
    return rng.randint(1, MAX_SMALL)


def _leaf_dirs(n_entries: int) -> list[str]:
    """10-way nested directory names with about 100 entries per leaf."""
    leaves = max(1, n_entries // 100)
    depth = max(1, math.ceil(math.log10(leaves))) if leaves > 1 else 1
    out = []
    for i in range(leaves):
        digits = f"{i:0{depth}d}"
        out.append("/".join(f"d{c}{j}" for j, c in enumerate(digits)))
    return out


def _write_random(path: Path, size: int, seed: int) -> None:
    """Incompressible, deterministic bytes: AES-128-CTR keystream over zeros if openssl exists."""
    if shutil.which("openssl") and shutil.which("head"):
        cmd = (
            f"head -c {size} /dev/zero | openssl enc -aes-128-ctr -nosalt -pbkdf2"
            f" -pass pass:btrfs-ublk-image-bench-{seed}"
        )
        with open(path, "wb") as f:
            subprocess.run(["sh", "-c", cmd], stdout=f, check=True)
        if path.stat().st_size == size:
            return
    rng = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 4 << 20)
            f.write(rng.randbytes(n))
            left -= n


def generate_tree(root: Path, params: InputParams) -> InputStats:
    """Write the synthetic tree into the (existing, empty) directory ``root``."""
    rng = random.Random(params.seed)
    as_root = os.geteuid() == 0
    st = InputStats()
    leaves = _leaf_dirs(params.files)
    dirs: set[str] = set()

    def ensure_dir(rel: str) -> None:
        parts = rel.split("/")
        for k in range(1, len(parts) + 1):
            d = "/".join(parts[:k])
            if d not in dirs:
                os.mkdir(root / d)
                dirs.add(d)

    pool = [rng.randbytes(_small_size(rng)) for _ in range(max(1, params.files // 200))]
    pool_used: set[int] = set()
    regulars: list[str] = []  # relative paths of regular files, for links
    unique_small = 0
    for i in range(params.files):
        d = "big" if rng.random() < 0.05 else rng.choice(leaves)
        ensure_dir(d)
        rel = f"{d}/file-{i:06d}{rng.choice(_EXTS)}"
        path = root / rel
        kind = rng.random()
        if kind < 0.01 and regulars:
            target = rng.choice(regulars)
            if rng.random() < 0.5:
                link = "/" + target
            elif target.rsplit("/", 1)[0] == d:
                link = target.rsplit("/", 1)[1]
            else:
                link = "../" * (d.count("/") + 1) + target
            os.symlink(link, path)
            st.symlinks += 1
            os.utime(path, ns=(_BASE_MTIME_NS, _BASE_MTIME_NS + i), follow_symlinks=False)
            continue
        if kind < 0.02 and regulars:
            os.link(root / rng.choice(regulars), path)
            st.hardlinks += 1
            st.regular_names += 1
            continue
        if kind < 0.12:
            k = rng.randrange(len(pool))
            data = pool[k]
            st.duplicate_files += 1
            if k not in pool_used:
                pool_used.add(k)
                unique_small += len(data)
        else:
            data = rng.randbytes(_small_size(rng))
            unique_small += len(data)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755 if rng.random() < 0.1 else 0o644)
        if as_root and rng.random() < 0.1:
            os.chown(path, 1000, 1000)
        mtime = _BASE_MTIME_NS + rng.randrange(10**16)
        os.utime(path, ns=(mtime, mtime))
        regulars.append(rel)
        st.regular_names += 1
        st.regular_inodes += 1
        st.small_bytes += len(data)

    if params.large_count and params.large_bytes:
        ensure_dir("large")
        each, extra = divmod(params.large_bytes, params.large_count)
        for k in range(params.large_count):
            size = each + (1 if k < extra else 0)
            blob = root / "large" / f"blob-{k}.bin"
            _write_random(blob, size, params.seed * 1000 + k)
            os.utime(blob, ns=(_BASE_MTIME_NS, _BASE_MTIME_NS))
            st.large_files += 1
            st.large_bytes += size
        st.regular_names += params.large_count
        st.regular_inodes += params.large_count

    for d in sorted(dirs, key=lambda s: -s.count("/")):
        os.utime(root / d, ns=(_BASE_MTIME_NS, _BASE_MTIME_NS))
    os.utime(root, ns=(_BASE_MTIME_NS, _BASE_MTIME_NS))  # the tarball's "." entry
    st.directories = len(dirs)
    st.entries = st.directories + st.regular_names + st.symlinks
    st.content_bytes = st.small_bytes + st.large_bytes
    st.unique_bytes = unique_small + st.large_bytes
    return st


def spec_text(tar_name: str) -> str:
    return f"version: 1\nname: bench\nlayers:\n  - tar: {{path: {tar_name}}}\n"


def ensure_inputs(workdir: Path, params: InputParams, log: Any = None) -> Inputs:
    """The cached input for ``params`` under ``workdir/inputs``, generated on first use."""
    base = workdir / "inputs"
    base.mkdir(parents=True, exist_ok=True)
    final = base / params.key
    meta = final / "input.json"
    if not meta.exists():
        if log:
            log(f"generating input {params.key} (cached in {final}) ...")
        tmp = Path(tempfile.mkdtemp(prefix=f".{params.key}.", dir=base))
        try:
            tree = tmp / "tree"
            tree.mkdir()
            stats = generate_tree(tree, params)
            tar = tmp / "input.tar"
            subprocess.run(
                [
                    "tar",
                    "--format=pax",
                    "--pax-option=delete=atime,delete=ctime",
                    "--sort=name",
                    "-cf",
                    str(tar),
                    "-C",
                    str(tree),
                    ".",
                ],
                check=True,
            )
            shutil.rmtree(tree)
            stats.tar_bytes = tar.stat().st_size
            (tmp / "spec.yaml").write_text(spec_text(tar.name))
            (tmp / "input.json").write_text(
                json.dumps({"params": asdict(params), "stats": stats.to_json()}, indent=2) + "\n"
            )
            os.chmod(tmp, 0o755)
            if final.exists():  # a half-written leftover without input.json
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    doc = json.loads(meta.read_text())
    return Inputs(
        params=params,
        directory=final,
        tar=final / "input.tar",
        spec=final / "spec.yaml",
        stats=InputStats(**doc["stats"]),
    )


def tar_stats(tar: Path) -> InputStats:
    """Entry counts and content bytes of any tarball (for an input we did not generate)."""
    st = InputStats(tar_bytes=tar.stat().st_size)
    with tarfile.open(tar) as tf:
        for m in tf:
            if m.name.strip("/") in ("", "."):
                continue
            st.entries += 1
            if m.isdir():
                st.directories += 1
            elif m.issym():
                st.symlinks += 1
            elif m.islnk():
                st.hardlinks += 1
                st.regular_names += 1
            elif m.isfile():
                st.regular_names += 1
                st.regular_inodes += 1
                st.content_bytes += m.size
    st.small_bytes = st.content_bytes
    return st


def _put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` as a blob of ``layout``; its digest and size (a descriptor's core)."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def write_oci_layout(layout: Path, tar: Path, ref: str, extra_layers: Sequence[Path] = ()) -> None:
    """An OCI image layout at ``layout`` (must not exist) whose uncompressed layers are
    ``tar`` (and ``extra_layers`` above it) themselves, hardlinked into ``blobs/`` (same
    filesystem; nothing copied)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}\n')
    layers = []
    for t in (tar, *extra_layers):
        diff_id = file_sha256(str(t))  # uncompressed layer: blob digest == diff_id
        if not (blobs / diff_id.split(":", 1)[1]).exists():
            os.link(t, blobs / diff_id.split(":", 1)[1])
        layers.append({"mediaType": LAYER_TAR, "digest": diff_id, "size": t.stat().st_size})
    config = {
        "architecture": _GOARCH.get(platform.machine(), platform.machine()),
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in layers]},
        "history": [{"created_by": f"bench/inputs.py: {t.name} as one layer"}
                    for t in (tar, *extra_layers)],
    }  # fmt: skip
    cfg = _put_blob(layout, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, **cfg},
        "layers": layers,
    }
    man = _put_blob(layout, json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": MANIFEST, **man,
             "annotations": {"org.opencontainers.image.ref.name": ref}}
        ],
    }  # fmt: skip
    (layout / "index.json").write_text(json.dumps(index, sort_keys=True) + "\n")


def ensure_oci_layout(data: Inputs, log: Any = None) -> Path:
    """The OCI layout of ``data``'s tarball (``data.directory/oci``, ref ``OCI_REF``),
    made on first use: in a temporary directory renamed into place (a concurrent maker's
    layout wins; both are the same bytes)."""
    final = data.directory / "oci"
    if (final / "index.json").exists():
        return final
    if log:
        log(f"writing the OCI layout of {data.tar} (cached in {final}) ...")
    tmp = Path(tempfile.mkdtemp(prefix=".oci.", dir=data.directory))
    try:
        write_oci_layout(tmp / "oci", data.tar, OCI_REF)
        os.chmod(tmp / "oci", 0o755)
        try:
            os.rename(tmp / "oci", final)
        except OSError:  # made meanwhile, or a half-written leftover without index.json
            if not (final / "index.json").exists():
                shutil.rmtree(final)
                os.rename(tmp / "oci", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def layout_layers(layout: Path, ref: str) -> list[dict[str, Any]]:
    """Media type and size of each layer of the image ``ref`` of an OCI layout (for the
    report: what the umoci baseline and our ``oci:`` build read)."""
    index = json.loads((layout / "index.json").read_text())
    for d in index["manifests"]:
        if d.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref:
            blob = layout / "blobs" / "sha256" / d["digest"].split(":", 1)[1]
            manifest = json.loads(blob.read_text())
            return [{"media_type": x["mediaType"], "size": x["size"]} for x in manifest["layers"]]
    raise ValueError(f"{layout}: no image with ref {ref!r} in index.json")
