"""Podman runs btrfs-ublk-image images lazily (issue 20, docs/containerd.md "Podman").

Podman 4.3 (Debian 12) with a private storage root and configuration per test, runc,
and docker-registry as our own child process on loopback (tests/servers.py). The Debian
minbase image (specs/golden/debian/prepare.sh's OCI layout) is built into a bundle and
pushed with `btrfs-ublk-image push --image`:

* `btrfs-ublk-snapshotter podman-store` mounts its bundle into a static additional layer
  store; `podman pull` takes the placeholder layer from there (the registry's log shows
  no GET of its blob) and `podman run` sees the image's tree (`umoci unpack` of the
  source, compared as tests/test_containerd.py does);
* `podman run --rootfs MNT:O` on a `ublkd mount` of the bundle: writes go to an overlay
  of podman's, the mount is unchanged; without `:O` the read-only mount is refused;
* teardown leaves no podman container, no store layer and no mount behind.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rootfstools import LIST_COMMAND, Listing, parse_container, tree_listing
from servers import Registry, docker_registry

from bundletools import prepare_debian_inputs

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parent.parent
# what podman needs on this kind of machine (no systemd, crun's setrlimit refused)
RUN_FLAGS = (
    "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--network", "none",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
)  # fmt: skip
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
LABEL_IMAGE_ID = "containerd.io/snapshot/btrfs-ublk-image.image-id"


def _run(*argv: str | Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    r = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0, f"{' '.join(map(str, argv))}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r.stdout


def snapshotter_bin() -> str:
    return shutil.which("btrfs-ublk-snapshotter") or str(
        REPO / "snapshotter" / "btrfs-ublk-snapshotter"
    )


def mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(prefix)]


@dataclass
class Image:
    registry: Registry
    ref: str  # the runnable image (push --image)
    plain: str  # the same OCI image as it is (skopeo copy)
    bundle: Path
    placeholder: str  # the runnable image's one layer blob
    reference_tree: Path  # umoci unpack of the source


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    assert shutil.which("podman"), "podman missing: run scripts/setup.sh"
    cache = prepare_debian_inputs()
    work = tmp_path_factory.mktemp("podman-image")
    spec = work / "spec.yaml"
    spec.write_text(
        f"version: 1\nname: podman\nlayers:\n  - oci: {{path: {cache / 'oci'}, ref: bookworm}}\n"
    )
    _run("btrfs-ublk-image", "build", spec, "-o", work / "bundle")
    _run("umoci", "unpack", "--image", f"{cache / 'oci'}:bookworm", work / "umoci")
    with docker_registry(work / "registry") as reg:
        ref = f"{reg.address}/lazy/debian:v1"
        plain = f"{reg.address}/plain/debian:v1"
        _run("btrfs-ublk-image", "push", "--image", work / "bundle", ref)
        _run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{cache / 'oci'}:bookworm",
             f"docker://{plain}")  # fmt: skip
        out = _run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}")
        layers = json.loads(out)["layers"]
        assert len(layers) == 1
        yield Image(
            reg, ref, plain, work / "bundle", layers[0]["digest"], work / "umoci" / "rootfs"
        )


class Podman:
    """podman with its own storage (graphroot, runroot), storage.conf naming the
    additional layer store `store`, and a registries.conf that allows our loopback
    registry over plain HTTP."""

    def __init__(self, work: Path, registry: Registry) -> None:
        self.work = work
        self.store = work / "als"
        self.store.mkdir()
        (work / "storage.conf").write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{work / "root"}"\n'
            f'runroot = "{work / "runroot"}"\n'
            "[storage.options]\n"
            f'additionallayerstores = ["{self.store}:ref"]\n'
        )
        (work / "registries.conf").write_text(
            f'[[registry]]\nlocation = "{registry.address}"\ninsecure = true\n'
        )
        self.env = dict(
            os.environ,
            CONTAINERS_STORAGE_CONF=str(work / "storage.conf"),
            CONTAINERS_REGISTRIES_CONF=str(work / "registries.conf"),
        )

    def __call__(self, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", "--events-backend", "none", "--tmpdir", str(self.work / "tmp"),
             *map(str, args)],
            capture_output=True, text=True, timeout=timeout, env=self.env,
        )  # fmt: skip

    def ok(self, *args: str | Path) -> str:
        r = self(*args)
        assert r.returncode == 0, f"podman {' '.join(map(str, args))}: {r.returncode}\n{r.stderr}"
        return r.stdout

    def store_cmd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [snapshotter_bin(), "podman-store", "--store", str(self.store), *args],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    def layer_dir(self, ref: str, digest: str) -> Path:
        return self.store / base64.b64encode(ref.encode()).decode() / digest

    def teardown(self) -> None:
        self("rm", "--all", "--force")
        self("rmi", "--all", "--force")
        for d in sorted(self.store.iterdir()) if self.store.exists() else []:
            ref = base64.b64decode(d.name).decode()
            r = self.store_cmd("--remove", ref)
            assert r.returncode == 0, r.stderr
        # containers/storage's overlay driver leaves its home bound onto itself
        for point in reversed(mounts_under(self.work)):
            subprocess.run(["umount", point], capture_output=True)


@pytest.fixture
def podman(image: Image, tmp_path: Path) -> Iterator[Podman]:
    pm = Podman(tmp_path, image.registry)
    try:
        yield pm
    finally:
        pm.teardown()
    assert mounts_under(tmp_path) == []
    assert list(pm.store.iterdir()) == []


# --- tree comparison (as tests/test_containerd.py) ------------------------------------------
def container_listing(podman: Podman, *run: str) -> tuple[Listing, Listing, set[str]]:
    """(listing, file digests, paths the runtime mounts over) of a container's root."""
    out = podman.ok("run", "--rm", *RUN_FLAGS, *run, "/bin/sh", "-c", LIST_COMMAND)
    listing, sums, mounted = parse_container(out)
    # podman (libpod) adds /etc/mtab -> /proc/mounts to every container's root (in the
    # container's own layer; it is why --rootfs of a read-only mount fails without :O)
    assert listing.pop("etc/mtab", "").endswith("/proc/mounts")
    mounted.add("etc/mtab")
    return listing, sums, mounted


# --- the tests ----------------------------------------------------------------------------
def test_pull_through_the_layer_store_and_run(image: Image, podman: Podman) -> None:
    r = podman.store_cmd(image.ref)
    assert r.returncode == 0, r.stderr
    layer = podman.layer_dir(image.ref, image.placeholder)
    assert (layer / "diff").is_mount() and (layer / "info").exists() and (layer / "blob").exists()
    assert str(layer / "diff") in r.stdout and "image id sha256:" in r.stdout

    since = len(image.registry.requests())
    podman.ok("pull", image.ref)
    pulled = [(q.method, q.path) for q in image.registry.requests()[since:]]
    blobs = [p for m, p in pulled if m == "GET" and "/blobs/" in p]
    assert not [p for p in blobs if p.endswith(image.placeholder)], pulled
    assert len(blobs) == 1, pulled  # the config, nothing else

    # the image's layer is the store's diff: containers/storage links its layer to it
    links = [d for d in (podman.work / "root" / "overlay").glob("*/diff") if d.is_symlink()]
    assert [os.readlink(d) for d in links] == [str(layer / "diff")]

    out = podman.ok("run", "--rm", *RUN_FLAGS, image.ref, "/bin/cat", "/etc/debian_version")
    assert out.strip().startswith("12")

    listing, sums, mounted = container_listing(podman, image.ref)
    want_listing, want_sums = tree_listing(image.reference_tree, mounted)
    assert listing == want_listing
    assert sums == want_sums


def test_ordinary_image_is_refused_by_the_store(image: Image, podman: Podman) -> None:
    r = podman.store_cmd(image.plain)
    assert r.returncode == 1
    assert "is not a btrfs-ublk-image runnable image" in r.stderr
    assert list(podman.store.iterdir()) == []


def test_bundle_id_not_what_the_image_says(image: Image, podman: Podman) -> None:
    """A runnable image whose image-id annotation names another bundle: ublkd's
    --expect-id refuses it, and the store is left empty."""
    repo, tag = image.ref.split("/", 1)[1].rsplit(":", 1)
    url = f"{image.registry.url}/v2/{repo}/manifests"
    req = urllib.request.Request(f"{url}/{tag}", headers={"Accept": MT_MANIFEST})
    with urllib.request.urlopen(req, timeout=30) as resp:
        manifest = json.loads(resp.read())
    manifest["layers"][0]["annotations"][LABEL_IMAGE_ID] = "sha256:" + "0" * 64
    req = urllib.request.Request(
        f"{url}/wrong-id",
        data=json.dumps(manifest).encode(),
        method="PUT",
        headers={"Content-Type": MT_MANIFEST},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 201
    r = podman.store_cmd(image.ref.rsplit(":", 1)[0] + ":wrong-id")
    assert r.returncode == 1
    assert "0" * 64 in r.stderr and "ublkd" in r.stderr, r.stderr
    assert list(podman.store.iterdir()) == []
    assert mounts_under(podman.store) == []


def test_remove_unmounts(image: Image, podman: Podman) -> None:
    r = podman.store_cmd(image.ref)
    assert r.returncode == 0, r.stderr
    podman.ok("pull", image.ref)
    podman.ok("rmi", image.ref)
    r = podman.store_cmd("--remove", image.ref)
    assert r.returncode == 0, r.stderr
    assert list(podman.store.iterdir()) == []
    assert mounts_under(podman.store) == []


def test_rootfs_overlay_on_a_ublkd_mount(image: Image, podman: Podman, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _run("ublkd", "mount", image.bundle, mnt)
    try:
        out = podman.ok(
            "run", "--rm", *RUN_FLAGS, "--rootfs", f"{mnt}:O", "/bin/sh", "-c",
            "echo hi > /etc/written && cat /etc/written /etc/debian_version",
        )  # fmt: skip
        assert out.splitlines()[0] == "hi" and out.splitlines()[1].startswith("12")
        assert not (mnt / "etc" / "written").exists()  # the overlay took the write
        listing, sums, mounted = container_listing(podman, "--rootfs", f"{mnt}:O")
        want_listing, want_sums = tree_listing(image.reference_tree, mounted)
        assert listing == want_listing
        assert sums == want_sums
        # without :O podman writes into the rootfs (/etc/mtab) and the mount is read-only
        r = podman("run", "--rm", *RUN_FLAGS, "--rootfs", mnt, "/bin/true")
        assert r.returncode != 0 and "read-only file system" in r.stderr, r.stderr
    finally:
        with contextlib.suppress(AssertionError):
            podman.ok("rm", "--all", "--force")
        _run("ublkd", "umount", mnt)
    assert mounts_under(mnt) == [] and not mnt.is_mount()
