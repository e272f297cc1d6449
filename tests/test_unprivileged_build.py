"""Building needs no root (issue 22): the examples and the golden synthetic set's tarballs
and OCI layout, built by an unprivileged user (nobody, no capabilities, through
setpriv) in a directory it owns, give the image ids of the same builds run as root.

The user runs a copy of the package, of its extension (native/, which setup.sh builds
into the venv; the tree's Inode is its class) and of its runtime dependencies (found
through their installed metadata), so the test does not depend on where the checkout or
the virtualenv lie or who may read them.
"""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.manifest import read_manifest

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parent.parent
USER = "nobody"

if os.geteuid() != 0 or shutil.which("setpriv") is None:
    pytest.skip("switching to an unprivileged user needs root and setpriv", allow_module_level=True)


def _runtime_dists() -> list[importlib.metadata.Distribution]:
    """btrfs-ublk-image's runtime requirements and theirs (markers: extras or other
    platforms, none needed here)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [r for r in importlib.metadata.requires("btrfs-ublk-image") or [] if ";" not in r]
    while todo:
        name = re.split(r"[ <>=!~;\[]", todo.pop(), maxsplit=1)[0]
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[key] = dist
        todo += [r for r in dist.requires or [] if ";" not in r]
    return list(found.values())


def _copy_runtime(dest: Path) -> None:
    """The package (from the checkout), its extension's and its dependencies' installed
    files."""
    shutil.copytree(
        ROOT / "btrfs_ublk_image",
        dest / "btrfs_ublk_image",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    dists = _runtime_dists()
    assert {d.metadata["Name"].lower() for d in dists} >= {"pydantic", "pyyaml", "isal"}
    for dist in [*dists, importlib.metadata.distribution("btrfs_ublk_native")]:
        for f in dist.files or []:
            src = Path(str(dist.locate_file(f)))
            if f.parts[0] == ".." or "__pycache__" in f.parts or not src.is_file():
                continue  # scripts outside site-packages, bytecode
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def _as_user(*cmd: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pw = pwd.getpwnam(USER)
    return subprocess.run(
        ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
        + ["--reset-env", "--", "env", *(f"{k}={v}" for k, v in env.items()), *map(str, cmd)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _python_for_user(env: dict[str, str]) -> str:
    """An interpreter of this Python version that the user can run (this one may lie
    under root's home, as pyenv's do)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in (sys._base_executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if Path(exe).exists() and _as_user(exe, "-c", "pass", env=env).returncode == 0:
            return exe
    pytest.fail(f"no {version} that {USER} may run")


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory under /tmp (pytest's tmp_path is root's, 0700), world-readable, with a
    work directory the user owns; removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="bui-unprivileged-", dir="/tmp"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base)


def test_unprivileged_build_gives_the_root_build_image_ids(user_dir: Path) -> None:
    pw = pwd.getpwnam(USER)
    runtime = user_dir / "python"
    _copy_runtime(runtime)
    work = user_dir / "work"
    # the examples, and the golden synthetic set's tarballs (every member type, xattrs
    # in several namespaces, devices, hardlinks, gzip) and OCI layout; its dir layer is
    # left out: a directory's trusted.* xattrs are invisible to an unprivileged reader
    shutil.copytree(ROOT / "examples" / "hello", work / "hello")
    shutil.copytree(ROOT / "examples" / "webroot", work / "webroot")
    golden = ROOT / "specs" / "golden" / "synthetic"
    (work / "tarballs").mkdir()
    for name in ("rootfs.tar.gz", "overlay.tar"):
        shutil.copy2(golden / name, work / "tarballs" / name)
    shutil.copytree(golden / "oci", work / "tarballs" / "oci")
    spec = yaml.safe_load((golden / "spec.yaml").read_text())
    spec["name"] = "tarballs"
    spec["layers"] = [x for x in spec["layers"] if "dir" not in x]
    assert {next(iter(x)) for x in spec["layers"]} == {"tar", "oci", "files"}
    (work / "tarballs" / "spec.yaml").write_text(yaml.safe_dump(spec))
    for p in [work, *work.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid, follow_symlinks=False)

    env = {"PYTHONPATH": str(runtime), "HOME": str(work), "TMPDIR": str(work)}
    python = _python_for_user(env)
    r = _as_user("grep", "-E", "^(Uid|CapEff):", "/proc/self/status", env=env)
    assert r.stdout.split() == ["Uid:", *[str(pw.pw_uid)] * 4, "CapEff:", "0" * 16], r.stdout

    root_out = user_dir / "root-out"
    root_out.mkdir()
    for name in ("hello", "webroot", "tarballs"):
        spec_path = work / name / "spec.yaml"
        theirs = work / f"{name}.bundle"
        r = _as_user(
            python, "-B", "-s", "-m", "btrfs_ublk_image", "build", spec_path, "-o", theirs, env=env
        )
        assert r.returncode == 0, r.stderr
        assert all(p.stat().st_uid == pw.pw_uid for p in [theirs, *theirs.rglob("*")])
        ours = root_out / f"{name}.bundle"
        assert cli(["build", str(spec_path), "-o", str(ours)]) == 0
        assert read_manifest(str(theirs))[1] == read_manifest(str(ours))[1], name
        assert (theirs / "meta.img").read_bytes() == (ours / "meta.img").read_bytes(), name
