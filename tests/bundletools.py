"""Test helpers: materialize device 2 from a bundle, mount bundles on loop devices, list trees.

``materialize_data_device`` stands in for ublkd in writer tests: it writes
device 2 into a sparse file from the blockmap and packs (checking every chunk
digest), so the stock kernel can mount the seed from two loop devices.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import stat
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.listing import TYPES
from btrfs_ublk_image.manifest import BLOCKMAP, META_IMG, read_manifest
from btrfs_ublk_image.tree import Tree

# system.posix_acl_access: version 2; user::rwx user:1000:r-x group::r-x mask::r-x other::r--
ACL_XATTR = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perm, ident)
    for tag, perm, ident in [
        (1, 7, 0xFFFFFFFF),
        (2, 5, 1000),
        (4, 5, 0xFFFFFFFF),
        (0x10, 5, 0xFFFFFFFF),
        (0x20, 4, 0xFFFFFFFF),
    ]
)
# security.capability: VFS_CAP_REVISION_2 | effective, cap_net_raw (13) permitted
CAPABILITY_XATTR = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


def run(*cmd: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True)


def materialize_data_device(bundle: Path, out: Path) -> None:
    """Device 2 as a sparse file; every pack chunk verified (compressed ones decompressed
    into a logical copy of the pack beside ``out``, removed afterwards)."""
    manifest, _ = read_manifest(str(bundle))
    bm = bmap.decode((bundle / BLOCKMAP).read_bytes())
    packs = [bundle / p["path"] for p in manifest["packs"]]
    logical = list(packs)
    try:
        for i, (p, entry) in enumerate(zip(packs, bm.packs, strict=True)):
            if entry.compressed:
                logical[i] = out.parent / f".{out.name}.pack{i}"
            with (
                open(p, "rb") as f,
                open(logical[i], "wb") if entry.compressed else _no_file() as w,
            ):
                for n in range(len(entry.chunk_digests)):
                    try:
                        data = bmap.read_chunk(f, bm, i, n, str(p))
                    except ImageError as e:
                        raise AssertionError(f"pack {i} chunk {n}: {e}") from None
                    if w is not None:
                        w.write(data)
        with open(out, "wb") as dev, contextlib.ExitStack() as stack:
            dev.truncate(bm.device_size)
            files = [stack.enter_context(open(p, "rb")) for p in logical]
            for r in bm.ranges:
                files[r.pack].seek(r.pack_offset)
                dev.seek(r.dev_offset)
                dev.write(files[r.pack].read(r.length))
    finally:
        for p, q in zip(packs, logical, strict=True):
            if q != p:
                q.unlink(missing_ok=True)


@contextlib.contextmanager
def _no_file() -> Iterator[None]:
    yield None


@dataclass
class LoopMount:
    mountpoint: Path
    loops: list[str]


def losetup(path: Path, readonly: bool = True) -> str:
    args = ["losetup", "-f", "--show"] + (["-r"] if readonly else []) + [str(path)]
    return run(*args).stdout.strip()


@contextlib.contextmanager
def mounted_bundle(bundle: Path, work: Path, rw: Path | None = None) -> Iterator[LoopMount]:
    """Mount ``bundle`` (device 2 materialized under ``work``) read-only; sprout onto ``rw`` if given."""
    data = work / "data.img"
    if not data.exists():
        materialize_data_device(bundle, data)
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    loops: list[str] = []
    mounted = False
    try:
        loops.append(losetup(bundle / META_IMG))
        loops.append(losetup(data))
        run("btrfs", "device", "scan", *loops)
        run("mount", "-t", "btrfs", "-o", f"ro,device={loops[0]},device={loops[1]}", loops[0], mnt)
        mounted = True
        if rw is not None:
            loops.append(losetup(rw, readonly=False))
            run("btrfs", "device", "add", "-f", "-K", loops[2], mnt)
            run("mount", "-o", "remount,rw", mnt)
        yield LoopMount(mnt, loops)
    finally:
        if mounted:
            run("umount", mnt, check=False)
        for lo in loops:
            run("losetup", "-d", lo, check=False)
        # forget the unmounted devices so later scans start clean
        run("btrfs", "device", "scan", "-u", check=False)


# --- listings -------------------------------------------------------------------------
Entry = dict[str, object]


def _kind(mode: int) -> str:
    return TYPES[stat.S_IFMT(mode)]


def list_dir(root: Path, with_root: bool = False) -> dict[str, Entry]:
    """path -> attributes of every entry under ``root`` (hardlinks: 'link' = first path)."""
    out: dict[str, Entry] = {}
    first_path: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = "/" + os.path.relpath(full, root)
            out[rel] = _entry(full, rel, first_path)
    if with_root:
        out["/"] = _entry(str(root), "/", first_path)
    return _canonical_links(out)


def _canonical_links(out: dict[str, Entry]) -> dict[str, Entry]:
    """Name every hardlink group by its smallest path, whatever order the walk had."""
    groups: dict[object, list[str]] = {}
    for path, e in out.items():
        if "link" in e:
            groups.setdefault(e["link"], []).append(path)
    for paths in groups.values():
        for path in paths:
            out[path]["link"] = min(paths)
    return out


def _entry(full: str, rel: str, first_path: dict[int, str]) -> Entry:
    st = os.lstat(full)
    e: Entry = {
        "type": _kind(st.st_mode),
        "mode": oct(stat.S_IMODE(st.st_mode)),
        "uid": st.st_uid,
        "gid": st.st_gid,
    }
    if not stat.S_ISDIR(st.st_mode):
        e["mtime_ns"] = st.st_mtime_ns
    xattrs = {}
    for name in sorted(os.listxattr(full, follow_symlinks=False)):
        xattrs[name] = os.getxattr(full, name, follow_symlinks=False).hex()
    e["xattrs"] = xattrs
    if stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with open(full, "rb") as f:
            while piece := f.read(1 << 20):
                h.update(piece)
        e["sha256"] = h.hexdigest()
        e["size"] = st.st_size
        if st.st_nlink > 1:
            e["link"] = first_path.setdefault(st.st_ino, rel)
    elif stat.S_ISLNK(st.st_mode):
        e["target"] = os.readlink(full)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        e["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return e


def list_tar(path: Path) -> dict[str, Entry]:
    """The same listing as ``list_dir`` from a tarball (what extracting it as root gives)."""
    out: dict[str, Entry] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            rel = "/" + os.path.normpath(m.name).lstrip("./")
            if rel in ("/", "/."):
                continue
            if m.islnk():
                target = "/" + os.path.normpath(m.linkname).lstrip("./")
                src = out[target]
                src.setdefault("link", target)
                out[rel] = dict(src)
                continue
            e: Entry = {
                "type": {
                    tarfile.REGTYPE: "file",
                    tarfile.AREGTYPE: "file",
                    tarfile.DIRTYPE: "dir",
                    tarfile.SYMTYPE: "symlink",
                    tarfile.CHRTYPE: "char",
                    tarfile.BLKTYPE: "block",
                    tarfile.FIFOTYPE: "fifo",
                }[m.type],
                "mode": oct(m.mode & 0o7777),
                "uid": m.uid,
                "gid": m.gid,
            }
            if not m.isdir():
                mt = m.pax_headers.get("mtime")
                e["mtime_ns"] = _decimal_ns(mt) if mt else int(m.mtime) * 10**9
            xattrs = {}
            for k, v in m.pax_headers.items():
                if k.startswith("SCHILY.xattr."):
                    xattrs[k[len("SCHILY.xattr.") :]] = v.encode("utf-8", "surrogateescape").hex()
            e["xattrs"] = dict(sorted(xattrs.items()))
            if m.isreg():
                f = tf.extractfile(m)
                assert f is not None
                e["sha256"] = hashlib.sha256(f.read()).hexdigest()
                e["size"] = m.size
            elif m.issym():
                e["target"] = m.linkname
            elif m.ischr() or m.isblk():
                e["rdev"] = (m.devmajor, m.devminor)
            out[rel] = e
    return _canonical_links(out)


def _decimal_ns(text: str) -> int:
    sec, _, frac = text.partition(".")
    return int(sec) * 10**9 + int((frac + "000000000")[:9])


def dmesg_btrfs_problems(since_lines: int, devices: list[str]) -> list[str]:
    """BTRFS warnings/errors logged since ``since_lines`` about ``devices`` (other tests may
    run beside this one: their messages name other devices)."""
    names = [os.path.basename(dev) for dev in devices]
    lines = run("dmesg").stdout.splitlines()[since_lines:]
    return [
        ln
        for ln in lines
        if "BTRFS" in ln
        and any(w in ln for w in ("warning", "error", "critical"))
        and any(re.search(rf"\b{re.escape(n)}\b", ln) for n in names)
    ]


def dmesg_len() -> int:
    return len(run("dmesg").stdout.splitlines())


def list_tree(tree: Tree, packs_dir: Path | None = None) -> dict[str, Entry]:
    """The same listing from an in-memory ``Tree`` (content read back from the pack)."""
    from btrfs_ublk_image.tree import Blob, FileType, Sparse

    counts: dict[int, int] = {}
    for _, node in tree.walk():
        counts[id(node)] = counts.get(id(node), 0) + 1
    first: dict[int, str] = {}
    out: dict[str, Entry] = {}
    for path_b, node in tree.walk():
        path = os.fsdecode(path_b)
        if path == "/":
            continue
        e: Entry = {
            "type": TYPES[int(node.type)],
            "mode": oct(node.mode),
            "uid": node.uid,
            "gid": node.gid,
        }
        if node.type != FileType.DIR:
            e["mtime_ns"] = node.mtime_ns
        e["xattrs"] = {os.fsdecode(k): v.hex() for k, v in sorted(node.xattrs.items())}
        if node.type == FileType.REG:
            content = node.content
            segments = ((0, content),) if isinstance(content, Blob) else ()
            if isinstance(content, Sparse):
                segments = content.segments
            data = bytearray(content if isinstance(content, bytes) else bytes(content.size))
            for offset, blob in segments:  # holes stay zeros
                assert packs_dir is not None
                (pack,) = list(packs_dir.iterdir())
                with open(pack, "rb") as f:
                    f.seek(blob.offset)
                    data[offset : offset + blob.size] = f.read(blob.size)
            e["sha256"] = hashlib.sha256(data).hexdigest()
            e["size"] = len(data)
            if counts[id(node)] > 1:
                e["link"] = first.setdefault(id(node), path)
        elif node.type == FileType.SYMLINK:
            e["target"] = os.fsdecode(node.target)
        elif node.type in (FileType.CHR, FileType.BLK):
            e["rdev"] = (os.major(node.rdev), os.minor(node.rdev))
        out[path] = e
    return _canonical_links(out)


# --- the golden Debian minbase inputs (specs/golden/debian) ------------------------------------
GOLDEN_DEBIAN = Path(__file__).resolve().parent.parent / "specs" / "golden" / "debian"
DEBIAN_CACHE = (
    Path(os.environ.get("BUI_GOLDEN_CACHE", "/var/tmp/btrfs-ublk-image-golden")) / "debian-pinned"
)


def prepare_debian_inputs() -> Path:
    """Run specs/golden/debian/prepare.sh (pinned minbase via mmdebstrap -> rootfs tarball and OCI
    layout, cached) and return the cache directory holding the specs."""
    prep = subprocess.run(
        ["bash", str(GOLDEN_DEBIAN / "prepare.sh"), str(DEBIAN_CACHE)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert prep.returncode == 0, f"prepare.sh failed:\n{prep.stdout}{prep.stderr}"
    return DEBIAN_CACHE


def load_vm_harness() -> ModuleType:
    """tests/vm/harness.py, loaded by path: works whatever pytest's import mode and rootdir."""
    name = "bui_vm_harness"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent / "vm" / "harness.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def write_pax_tar(path: Path, files: dict[str, bytes], dirs: tuple[str, ...]) -> None:
    """A PAX tarball: the directories `dirs` (0755), then `files` (0644), all with mtime
    1,700,000,000."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for d in dirs:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tf.addfile(ti)
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1_700_000_000
            tf.addfile(ti, io.BytesIO(data))
