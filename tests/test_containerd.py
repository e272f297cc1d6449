"""Containers from a registry through btrfs-ublk-snapshotter (issue 20, docs/containerd.md).

Real containerd (Debian's 1.6, and 2.x built by scripts/setup.sh), runc and
docker-registry run as our own child processes on loopback (tests/containerdtools.py,
tests/servers.py). The Debian minbase image (specs/golden/debian/prepare.sh: an OCI
layout of two layers) goes to the registry twice: as it is (`skopeo copy`) and as a
bundle with its runnable image (`btrfs-ublk-image push --image`). Oracles: `umoci
unpack` of the same layout for the tree, the registry's access log for what was
fetched, /proc/self/mountinfo and `ublkd status` for what is left behind.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from containerdtools import (
    FLAVOURS,
    SNAPSHOTTER,
    Stack,
    busybox_bundle,
    containerd_binaries,
    containerd_stack,
    mounts_under,
)
from rootfstools import LIST_COMMAND, Listing, parse_container, tree_listing
from servers import Registry, docker_registry, htpasswd_auth

from bundletools import prepare_debian_inputs

pytestmark = pytest.mark.root

MT_PACK = "application/vnd.btrfs-ublk-image.pack.v1"
LABEL_IMAGE_ID = "containerd.io/snapshot/btrfs-ublk-image.image-id"


@dataclass
class Images:
    registry: Registry
    ours: str  # the runnable image of the bundle (push --image)
    plain: str  # the same OCI image as it is
    image_id: str
    bundle_manifest: dict[str, object]
    placeholder: str  # the runnable image's one layer blob
    reference_tree: Path  # umoci unpack of the source


def _run(*argv: str | Path, timeout: float = 600) -> str:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r.stdout


def raw_manifest(registry: Registry, repo: str, ref: str) -> tuple[bytes, dict[str, object]]:
    req = urllib.request.Request(
        f"{registry.url}/v2/{repo}/manifests/{ref}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        data: bytes = resp.read()
    doc: dict[str, object] = json.loads(data)
    return data, doc


def put_manifest(registry: Registry, repo: str, tag: str, data: bytes) -> None:
    req = urllib.request.Request(
        f"{registry.url}/v2/{repo}/manifests/{tag}",
        data=data,
        method="PUT",
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 201


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    for flavour in FLAVOURS:
        assert Path(containerd_binaries(flavour)[0]).exists(), (
            f"containerd {flavour} missing: run scripts/setup.sh"
        )
    cache = prepare_debian_inputs()
    work = tmp_path_factory.mktemp("ctd-images")
    spec = work / "spec.yaml"
    spec.write_text(  # 256 KiB chunks: what a container start fetches (docs/containerd.md)
        "version: 1\nname: ctd\npack_chunk_size: 262144\nlayers:\n"
        f"  - oci: {{path: {cache / 'oci'}, ref: bookworm}}\n"
    )
    _run("btrfs-ublk-image", "build", spec, "-o", work / "bundle")
    image_id = (
        "sha256:" + hashlib.sha256((work / "bundle" / "manifest.json").read_bytes()).hexdigest()
    )
    _run("umoci", "unpack", "--image", f"{cache / 'oci'}:bookworm", work / "umoci")
    with docker_registry(work / "registry") as reg:
        ours = f"{reg.address}/ours/debian:v1"
        plain = f"{reg.address}/plain/debian:v1"
        _run("btrfs-ublk-image", "push", "--image", work / "bundle", ours)
        _run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{cache / 'oci'}:bookworm",
             f"docker://{plain}")  # fmt: skip
        _, bundle = raw_manifest(reg, "ours/debian", "v1-bundle")
        _, runnable = raw_manifest(reg, "ours/debian", "v1")
        layers = runnable["layers"]
        assert isinstance(layers, list) and len(layers) == 1
        yield Images(
            reg, ours, plain, image_id, bundle, layers[0]["digest"], work / "umoci" / "rootfs"
        )


@pytest.fixture(params=FLAVOURS)
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    with containerd_stack(request.param) as st:
        yield st


def pack_bytes_fetched(images: Images, since: int) -> tuple[int, int]:
    """(pack bytes the registry sent since request number ``since``, all pack bytes)."""
    layers = images.bundle_manifest["layers"]
    assert isinstance(layers, list)
    packs = {d["digest"]: d["size"] for d in layers if d["mediaType"] == MT_PACK}
    sent = sum(
        r.bytes_sent
        for r in images.registry.requests()[since:]
        if r.method == "GET" and r.path.rsplit("/", 1)[-1] in packs
    )
    return sent, sum(packs.values())


def container_listing(st: Stack, ref: str, name: str) -> tuple[Listing, Listing, set[str]]:
    """(listing, file digests, paths runc mounts over) of a container's root filesystem."""
    out = st.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, ref, name, "/bin/sh", "-c",
                 LIST_COMMAND).stdout  # fmt: skip
    return parse_container(out)


# --- the tests ----------------------------------------------------------------------------
def test_run_from_registry_lazily(images: Images, stack: Stack) -> None:
    since = len(images.registry.requests())
    stack.pull(images.ours)
    out = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, images.ours, "first",
                    "/bin/cat", "/etc/debian_version").stdout  # fmt: skip
    assert out.startswith("12.")
    fetched, total = pack_bytes_fetched(images, since)
    assert 0 < fetched <= total // 10, f"{fetched} of {total} pack bytes fetched"
    # containerd never fetched the placeholder layer: the snapshotter served it
    got = [r.path for r in images.registry.requests()[since:] if r.method == "GET"]
    assert not any(p.endswith(images.placeholder) for p in got), got
    st = stack.status()
    lazy = st["lazy"]
    assert isinstance(lazy, list) and len(lazy) == 1
    assert lazy[0]["image_id"] == images.image_id and lazy[0]["mounted"]
    assert st["downloaded"] == []
    assert (
        f"image id {images.image_id}" in stack.snapshotter.output()
        or images.image_id in stack.snapshotter.output()
    )
    assert "served lazily" in stack.snapshotter.output()


def test_container_tree_is_the_image(images: Images, stack: Stack) -> None:
    stack.pull(images.ours)
    inside, inside_sums, mounted = container_listing(stack, images.ours, "tree")
    want, want_sums = tree_listing(images.reference_tree, mounted)
    assert len(want) > 6000
    assert inside == want
    assert inside_sums == want_sums


def test_ordinary_image_uses_overlayfs(images: Images, stack: Stack) -> None:
    """A plain image through the same snapshotter: containerd downloads and unpacks its
    layers (said in status and the log), beside a lazily served one."""
    stack.pull(images.plain)
    stack.pull(images.ours)
    out = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, images.plain, "plain",
                    "/bin/cat", "/etc/golden-release").stdout  # fmt: skip
    assert out.strip()
    out2 = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, images.ours, "ours",
                     "/bin/cat", "/etc/golden-release").stdout  # fmt: skip
    assert out == out2
    st = stack.status()
    downloaded, lazy = st["downloaded"], st["lazy"]
    assert isinstance(downloaded, list) and isinstance(lazy, list)
    assert len(downloaded) == 2 and len(lazy) == 1
    assert "ordinary layer" in stack.snapshotter.output()


def test_snapshotter_and_containerd_restarts(images: Images, stack: Stack) -> None:
    stack.pull(images.ours)
    stack.ctr("run", "-d", "--snapshotter", SNAPSHOTTER, images.ours, "long", "/bin/sleep", "600")
    stack.snapshotter.kill()
    # the running container still reads (its data comes from ublkd, not the snapshotter)
    out = stack.ctr("task", "exec", "--exec-id", "e1", "long", "/bin/cat", "/etc/os-release").stdout
    assert "bookworm" in out
    stack.start_snapshotter()
    lazy = stack.status()["lazy"]
    assert isinstance(lazy, list) and len(lazy) == 1 and lazy[0]["mounted"]
    out = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, images.ours, "after",
                    "/bin/cat", "/etc/debian_version").stdout  # fmt: skip
    assert out.startswith("12.")
    stack.restart_containerd()
    out = stack.ctr("task", "exec", "--exec-id", "e2", "long", "/usr/bin/md5sum", "/bin/ls").stdout
    assert "/bin/ls" in out
    out = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, images.ours, "after2",
                    "/bin/cat", "/etc/debian_version").stdout  # fmt: skip
    assert out.startswith("12.")


def test_image_removal_unmounts(images: Images, stack: Stack) -> None:
    stack.pull(images.ours)
    root = stack.snapshotter_root
    assert any(str(root) in line for line in Path("/proc/self/mounts").read_text().splitlines())
    stack.ctr("image", "rm", "--sync", images.ours)
    deadline = time.monotonic() + 20
    while any(str(root) in ln for ln in Path("/proc/self/mounts").read_text().splitlines()):
        assert time.monotonic() < deadline, "bundle still mounted after the image was removed"
        time.sleep(0.1)
    assert stack.status()["lazy"] == []
    assert "bundle unmounted" in stack.snapshotter.output()


# --- many containers, one mount -------------------------------------------------------------
BIG = 64 << 20  # a file every container reads: its page cache must exist once


@pytest.fixture(scope="module")
def big_image(images: Images, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Debian image with /big (64 MiB of random bytes) on top, pushed with --image."""
    work = tmp_path_factory.mktemp("ctd-big")
    (work / "top").mkdir()
    (work / "top" / "big").write_bytes(os.urandom(BIG))
    cache = prepare_debian_inputs()
    spec = work / "spec.yaml"
    spec.write_text(
        "version: 1\nname: ctd-big\nlayers:\n"
        f"  - oci: {{path: {cache / 'oci'}, ref: bookworm}}\n"
        f"  - dir: {{path: {work / 'top'}, uid: 0, gid: 0}}\n"
    )
    _run("btrfs-ublk-image", "build", spec, "-o", work / "bundle")
    ref = f"{images.registry.address}/ours/debian-big:v1"
    _run("btrfs-ublk-image", "push", "--image", work / "bundle", ref)
    return ref


def page_cache_charged(stack: Stack, name: str) -> int:
    """Bytes of page cache charged to container ``name``'s memory cgroup (the kernel
    charges a page to the cgroup that brought it in: a reader that finds the page cached
    adds nothing). Per container, so other work on the machine does not count."""
    pid = next(
        ln.split()[1] for ln in stack.ctr("task", "ls").stdout.splitlines() if ln.split()[0] == name
    )
    # /proc/PID/cgroup: "ID:CONTROLLERS:PATH" per hierarchy; v2's one hierarchy is "0::PATH"
    groups = {
        controllers: path
        for _, controllers, path in (
            ln.split(":", 2) for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        )
    }
    v1 = next((path for c, path in groups.items() if "memory" in c.split(",")), None)
    if v1 is not None:  # cgroup v1's memory controller: memory.stat "cache"
        stat, key = Path("/sys/fs/cgroup/memory", v1.lstrip("/"), "memory.stat"), "cache"
    else:  # cgroup v2: memory.stat "file"
        stat, key = Path("/sys/fs/cgroup", groups[""].lstrip("/"), "memory.stat"), "file"
    for line in stat.read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    raise AssertionError(f"no {key} in {stat}")


@pytest.mark.parametrize("stack", ["1.6"], indirect=True)
def test_sixteen_containers_share_one_mount(big_image: str, stack: Stack) -> None:
    stack.pull(big_image)
    names = [f"c{i}" for i in range(16)]
    for n in names:
        stack.ctr("run", "-d", "--snapshotter", SNAPSHOTTER, big_image, n, "/bin/sleep", "600")
    btrfs = [m for m in mounts_under(stack.snapshotter_root)]
    assert len(btrfs) == 1, btrfs  # the bundle, mounted once; each container is an overlay on it
    mine = [
        m
        for m in json.loads(_run("ublkd", "status", "--json"))
        if m["mountpoint"].startswith(str(stack.snapshotter_root) + "/")
    ]
    assert len(mine) == 1 and mine[0]["server_alive"], mine  # one server

    # the first container's read fetches and caches the file (and, on the way, the
    # registry's blob, ublkd's disk cache: other page cache that is not the point here)
    stack.ctr("task", "exec", "--exec-id", "r0", names[0], "/bin/sh", "-c", "cat /big > /dev/null")
    lower = Path(btrfs[0]) / "big"
    resident = _run("fincore", "--bytes", "--noheadings", "--output", "RES", lower).split()
    one = int(resident[0])
    assert one >= BIG * 9 // 10, f"{lower}: {one} bytes resident after one container's read"
    before = {n: page_cache_charged(stack, n) for n in names[1:]}
    for i, n in enumerate(names[1:]):
        stack.ctr("task", "exec", "--exec-id", f"r{i + 1}", n, "/bin/sh", "-c",
                  "cat /big > /dev/null")  # fmt: skip
    extra = sum(page_cache_charged(stack, n) - before[n] for n in names[1:])
    print(f"page cache: first reader {one}, 15 more readers charged {extra}")
    # one page cache for all: 15 more readers add at most a fifth of the file (an overlay
    # with a page cache of its own would add the whole file for each)
    assert one + extra <= one * 1.2, f"16 containers: {one + extra} bytes cached, one: {one}"


# --- bad input ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_bundle(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small image of its own (host busybox), whose registry blobs the tests may break."""
    return busybox_bundle(tmp_path_factory.mktemp("ctd-small"))


def _nothing_left(stack: Stack) -> None:
    assert mounts_under(stack.snapshotter_root) == []
    lazy = stack.status()["lazy"]
    assert lazy == []


def _blob_file(images: Images, digest: str) -> Path:
    hex_ = digest.removeprefix("sha256:")
    return (
        images.registry.workdir
        / "storage/docker/registry/v2/blobs/sha256"
        / hex_[:2]
        / hex_
        / "data"
    )


def test_bundle_id_not_what_the_image_says(
    images: Images, small_bundle: Path, stack: Stack
) -> None:
    repo = f"bad/id-{stack.flavour.replace('.', '')}"
    ref = f"{images.registry.address}/{repo}:v1"
    _run("btrfs-ublk-image", "push", "--image", small_bundle, ref)
    _, m = raw_manifest(images.registry, repo, "v1")
    wrong = "sha256:" + "ab" * 32
    m["layers"][0]["annotations"][LABEL_IMAGE_ID] = wrong  # type: ignore[index]
    put_manifest(images.registry, repo, "v2", json.dumps(m).encode())
    r = stack.pull(f"{images.registry.address}/{repo}:v2", check=False)
    assert r.returncode != 0
    assert wrong in r.stdout + r.stderr, r.stdout + r.stderr
    _nothing_left(stack)


def test_registry_serves_a_wrong_blob(images: Images, small_bundle: Path, stack: Stack) -> None:
    """meta.img changed in the registry's storage: the mount is refused (the pull fails);
    a pack chunk changed: the file's read fails with EIO, the rest of the image works."""
    repo = f"bad/blob-{stack.flavour.replace('.', '')}"
    ref = f"{images.registry.address}/{repo}:v1"
    _run("btrfs-ublk-image", "push", "--image", small_bundle, ref)
    _, bundle = raw_manifest(images.registry, repo, "v1-bundle")
    layers = bundle["layers"]
    assert isinstance(layers, list)
    meta = _blob_file(images, layers[0]["digest"])
    good = meta.read_bytes()
    flip = len(good) // 2  # a byte inside the zstd frame: ublkd refuses what it decompresses to
    meta.write_bytes(good[:flip] + bytes([good[flip] ^ 1]) + good[flip + 1 :])
    try:
        r = stack.pull(ref, check=False)
        assert r.returncode != 0
        assert "meta.img" in r.stdout + r.stderr, r.stdout + r.stderr
        _nothing_left(stack)
    finally:
        meta.write_bytes(good)
    largest = max(layers[2:], key=lambda d: int(d["size"]))  # busybox's pack
    pack = _blob_file(images, largest["digest"])
    good = pack.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 1
    pack.write_bytes(bytes(data))
    try:
        stack.pull(ref)
        # busybox's chunk fails verification: its exec fails with EIO, nothing runs
        r = stack.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, ref, "eio", "/bin/sh", "-c",
                      "echo hi", check=False)  # fmt: skip
        assert r.returncode != 0 and "hi" not in r.stdout, r
        assert "input/output error" in r.stderr.lower(), r
    finally:
        pack.write_bytes(good)


def test_unreachable_registry(images: Images, small_bundle: Path, stack: Stack) -> None:
    with docker_registry(images.registry.workdir.parent / f"gone-{stack.flavour}") as reg:
        ref = f"{reg.address}/gone/small:v1"
        _run("btrfs-ublk-image", "push", "--image", small_bundle, ref)
    r = stack.pull(ref, check=False)
    assert r.returncode != 0
    assert reg.address in r.stdout + r.stderr
    _nothing_left(stack)


@pytest.mark.parametrize("stack", ["1.6"], indirect=True)
def test_pull_without_annotations_is_refused(images: Images, stack: Stack) -> None:
    """containerd 1.6's own `ctr image pull` passes no layer annotations: the placeholder
    would be unpacked as an ordinary layer (a container of one file); the commit is
    refused with what to do instead."""
    r = stack.ctr("image", "pull", "--plain-http", "--snapshotter", SNAPSHOTTER, images.ours,
                  check=False)  # fmt: skip
    assert r.returncode != 0
    assert "passed no layer annotations" in r.stdout + r.stderr, r.stdout + r.stderr
    assert images.image_id in r.stdout + r.stderr
    _nothing_left(stack)


def test_ublkd_mounts_a_runnable_image(images: Images, tmp_path: Path) -> None:
    """`ublkd mount oci://REPO:TAG` of a runnable image follows it to its bundle."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = _run("ublkd", "mount", "--cache-dir", tmp_path / "cache", f"oci://{images.ours}", mnt)
    try:
        assert images.image_id in out
        assert (mnt / "etc" / "debian_version").read_text().startswith("12.")
    finally:
        _run("ublkd", "umount", mnt)


def test_registry_with_credentials(small_bundle: Path, tmp_path: Path) -> None:
    """A registry that wants Basic auth: ublkd (run by the snapshotter) and the 1.6 pull
    client read docker's config.json; containerd 2.x's ctr gets --user."""
    with docker_registry(tmp_path / "reg", auth=htpasswd_auth(tmp_path, "u", "s3cret")) as reg:
        ref = f"{reg.address}/auth/small:v1"
        env = dict(os.environ, BUI_REGISTRY_AUTH="u:s3cret")
        subprocess.run(["btrfs-ublk-image", "push", "--image", str(small_bundle), ref],
                       check=True, capture_output=True, env=env)  # fmt: skip
        docker = tmp_path / "docker"
        docker.mkdir()
        (docker / "config.json").write_text(
            json.dumps({"auths": {reg.address: {"auth": base64.b64encode(b"u:s3cret").decode()}}})
        )
        for flavour in FLAVOURS:
            with containerd_stack(flavour, extra_env={"DOCKER_CONFIG": str(docker)}) as st:
                st.pull(ref, user="u:s3cret" if flavour != "1.6" else "")
                out = st.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, ref, "auth",
                             "/bin/cat", "/etc/motd").stdout  # fmt: skip
                assert out == "small\n"
