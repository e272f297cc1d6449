"""Golden images: every spec in specs/golden/*/ is built and must give exactly its committed
listing (expected.listing) and image id (expected-id).

A deliberate change (writer, sources, builder version) changes them: review the printed
diff, then rewrite the expected files with

    BUI_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py

and commit them with the change that caused them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from btrfs_ublk_image import listing
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.manifest import read_manifest

from bundletools import (
    DEBIAN_CACHE,
    dmesg_btrfs_problems,
    dmesg_len,
    mounted_bundle,
    prepare_debian_inputs,
    run,
)

GOLDEN = Path(__file__).resolve().parent.parent / "specs" / "golden"
# specs with committed inputs; a golden dir with a prepare.sh (inputs made at test time,
# e.g. the Debian image) has its own test
SPECS = sorted(
    p.parent.name for p in GOLDEN.glob("*/spec.yaml") if not (p.parent / "prepare.sh").exists()
)
UPDATE = os.environ.get("BUI_UPDATE_GOLDEN") == "1"


def build_golden(name: str, out: Path) -> tuple[str, str]:
    """Build specs/golden/NAME; returns (listing text, image id).

    A golden dir with a generate.py (inputs git cannot carry: modes, mtimes, xattrs,
    sockets) is copied next to ``out`` and its ``generate(copy)`` runs first."""
    spec = GOLDEN / name / "spec.yaml"
    gen = GOLDEN / name / "generate.py"
    if gen.exists():
        work = out.parent / f"{out.name}-inputs"
        shutil.copytree(GOLDEN / name, work)
        module = importlib.util.spec_from_file_location(f"golden_{name}_generate", gen)
        assert module is not None and module.loader is not None
        mod = importlib.util.module_from_spec(module)
        module.loader.exec_module(mod)
        mod.generate(work)
        spec = work / "spec.yaml"
    return build_spec(spec, out)


def build_spec(spec: Path, out: Path) -> tuple[str, str]:
    """Build ``spec`` into ``out``; returns (listing text, image id)."""
    assert cli(["build", str(spec), "-o", str(out)]) == 0
    _, image_id = read_manifest(str(out))
    return listing.format_listing(listing.from_bundle(str(out))), image_id


def listing_changes(name: str, text: str) -> list[str]:
    """The differences (expected -> built) between specs/golden/NAME/expected.listing and
    ``text``."""
    path = GOLDEN / name / "expected.listing"
    assert path.exists(), f"{path} missing (BUI_UPDATE_GOLDEN=1)"
    want = listing.parse_listing(path.read_text(), str(path))
    return listing.diff(want, listing.parse_listing(text, "built"))


def check_against_expected(name: str, text: str, image_id: str) -> None:
    d = GOLDEN / name
    if UPDATE:
        (d / "expected.listing").write_text(text)
        (d / "expected-id").write_text(image_id + "\n")
        return
    changes = listing_changes(name, text)
    hint = "\n(if intended: BUI_UPDATE_GOLDEN=1 pytest tests/test_golden.py, review, commit)"
    assert not changes, (
        f"{name}: the listing changed (expected -> built):\n" + "\n".join(changes) + hint
    )
    assert text == (d / "expected.listing").read_text(), f"{name}: listing text differs" + hint
    want_id = (d / "expected-id").read_text().strip()
    assert image_id == want_id, f"{name}: image id {want_id} -> {image_id}" + hint


@pytest.mark.unit
@pytest.mark.parametrize("name", SPECS)
def test_golden_listing_and_id(name: str, tmp_path: Path) -> None:
    text, image_id = build_golden(name, tmp_path / "bundle")
    check_against_expected(name, text, image_id)
    # a second build is the same image, byte for byte
    _, again = build_golden(name, tmp_path / "again")
    assert again == image_id


@pytest.mark.root
@pytest.mark.parametrize("name", SPECS)
def test_golden_mounted_equals_listing(name: str, tmp_path: Path) -> None:
    """The kernel's view of the golden image is its expected listing; btrfs check passes."""
    bundle = tmp_path / "bundle"
    text, _ = build_golden(name, bundle)
    check = run("btrfs", "check", "--readonly", bundle / "meta.img", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    before = dmesg_len()
    with mounted_bundle(bundle, tmp_path) as m:
        kernel = listing.from_directory(str(m.mountpoint))
        loops = m.loops
    assert listing.diff(listing.parse_listing(text), kernel) == []
    assert dmesg_btrfs_problems(before, loops) == []


# --- the Debian image: real-world acceptance -------------------------------------------------
ROOT = GOLDEN.parent.parent
CHROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


def _ublkd_binary() -> str | None:
    if os.environ.get("UBLKD"):
        return os.environ["UBLKD"]
    built = ROOT / "ublkd" / "target" / "release" / "ublkd"
    return str(built) if built.exists() else shutil.which("ublkd")


def _oci_layers(layout: Path, ref: str) -> list[str]:
    """The media types of the layers of ``ref`` in an OCI image layout (read directly, not
    through our source, so the test does not trust the code under test)."""
    index = json.loads((layout / "index.json").read_text())
    (desc,) = [
        d
        for d in index["manifests"]
        if d.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref
    ]
    algo, hexdigest = desc["digest"].split(":", 1)
    manifest = json.loads((layout / "blobs" / algo / hexdigest).read_text())
    return [layer["mediaType"] for layer in manifest["layers"]]


def _sh(*cmd: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=CHROOT_ENV
    )


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["spec.yaml", "spec-oci.yaml"])
def test_debian_acceptance(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mmdebstrap minbase (pinned) -> bundle -> `ublkd mount --rw` -> chroot: `dpkg --verify` reports
    nothing, `apt-cache policy` and a shell script work; the bundle's listing (read without
    mounting) equals the walk of the mounted tree."""
    ublkd = _ublkd_binary()
    if os.geteuid() != 0 or ublkd is None or shutil.which("mmdebstrap") is None:
        pytest.skip("needs root, a built ublkd and mmdebstrap")
    prepare_debian_inputs()
    bundle = tmp_path / "bundle"
    assert cli(["build", str(DEBIAN_CACHE / spec), "-o", str(bundle)]) == 0
    ours = listing.from_bundle(str(bundle))
    paths = {e.path for e in ours}
    assert b"/usr/bin/dpkg" in paths and b"/usr/local/bin/acceptance.sh" in paths
    if spec == "spec-oci.yaml":  # the second OCI layer: one file added, two whited out
        gzip_layer = "application/vnd.oci.image.layer.v1.tar+gzip"
        assert _oci_layers(DEBIAN_CACHE / "oci", "bookworm") == [gzip_layer, gzip_layer]
        assert b"/etc/golden-release" in paths
        assert b"/var/lib/dpkg/status-old" not in paths
    assert cli(["ls", str(bundle), "/usr/bin/dpkg"]) == 0

    monkeypatch.setenv("UBLKD_RUN_DIR", str(tmp_path / "ublkd-run"))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        [
            ublkd,
            "mount",
            str(bundle),
            str(mnt),
            "--rw",
            str(tmp_path / "rw.img"),
            "--rw-size",
            "4G",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    proc_mounted = False
    try:
        walked = listing.from_directory(str(mnt))
        assert listing.diff(ours, walked) == []
        assert _sh("mount", "-t", "proc", "proc", mnt / "proc").returncode == 0
        proc_mounted = True
        verify = _sh("chroot", mnt, "dpkg", "--verify")
        assert verify.returncode == 0 and verify.stdout == "", verify.stdout + verify.stderr
        policy = _sh("chroot", mnt, "apt-cache", "policy")
        assert policy.returncode == 0, policy.stderr
        assert "/var/lib/dpkg/status" in policy.stdout
        script = _sh("chroot", mnt, "/usr/local/bin/acceptance.sh")
        assert script.returncode == 0, script.stdout + script.stderr
        assert "acceptance ok" in script.stdout
    finally:
        if proc_mounted:
            _sh("umount", mnt / "proc")
        u = subprocess.run([ublkd, "umount", str(mnt)], capture_output=True, text=True, timeout=120)
        assert u.returncode == 0, u.stdout + u.stderr


# --- the Debian golden image: committed listing and id (specs/golden/debian) -------------------
def _needs_mmdebstrap() -> None:
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        pytest.skip("needs root and mmdebstrap (scripts/setup.sh installs it)")


@pytest.mark.root
@pytest.mark.slow
def test_debian_golden_from_scratch_twice(tmp_path: Path) -> None:
    """Two builds from the committed inputs, each from nothing (a fresh prepare.sh run, no
    cache), give the committed listing and image id."""
    _needs_mmdebstrap()
    ids = []
    for n in (1, 2):
        inputs = tmp_path / f"inputs-{n}"
        prep = subprocess.run(
            ["bash", str(GOLDEN / "debian" / "prepare.sh"), str(inputs)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert prep.returncode == 0, f"prepare.sh failed:\n{prep.stdout}{prep.stderr}"
        text, image_id = build_spec(inputs / "spec-oci.yaml", tmp_path / f"bundle-{n}")
        check_against_expected("debian", text, image_id)
        ids.append(image_id)
        shutil.rmtree(inputs)
    assert ids[0] == ids[1]


@pytest.mark.root
@pytest.mark.slow
def test_debian_golden_one_byte_change_fails(tmp_path: Path) -> None:
    """The same image with the first byte of one package's file changed (in the second OCI
    layer) fails the listing check, which names exactly that file."""
    _needs_mmdebstrap()
    cache = prepare_debian_inputs()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(cache / "spec-oci.yaml", inputs)
    shutil.copytree(cache / "overlay", inputs / "overlay", symlinks=True)
    run(
        "python3",
        GOLDEN / "debian" / "make-oci.py",
        cache / "rootfs.tar",
        inputs / "oci",
        "--change-byte",
        "/usr/bin/dpkg",
    )
    text, image_id = build_spec(inputs / "spec-oci.yaml", tmp_path / "bundle")
    changes = listing_changes("debian", text)
    assert len(changes) == 1 and "/usr/bin/dpkg" in changes[0], changes
    assert image_id != (GOLDEN / "debian" / "expected-id").read_text().strip()
