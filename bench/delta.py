"""Delta section (issue 24): what v2 of an image moves when v1 is already there.

v1 is the Debian minbase tarball; v2 is v1 with every 100th regular file larger than
4 KiB given new bytes of the same size (1% of those files). Measured:

* ours: v1 bundle, v2 bundle built with ``--base`` v1; pushed to docker-registry on
  loopback (v1, then v2), and mounted over nginx (v1 read whole, then v2 read whole on
  the same host: ublkd finds v2's reused chunks in v1's cache);
* baseline: the ordinary OCI image of each tarball (one layer), re-pushed with
  ``skopeo copy --dest-compress`` (gzip) after v1's; and the best case of layers, v2 as
  v1's layer plus a layer holding the changed files.

Pushed bytes: the sizes of the blobs that appeared in the registry's storage during v2's
push (the same count for both). Fetched bytes, v2 after v1 on one host: ours from
nginx's access log (``ublkd mount`` of the HTTP bundle) and from the registry's log
(``ublkd mount oci://``), packs and metadata; OCI from the registry's log while ``skopeo
copy`` pulls v2 into an OCI layout that already holds v1 (skopeo skips the blobs the
layout has).
"""

from __future__ import annotations

import random
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from bench.inputs import write_oci_layout
from bench.measure import remove
from bench.mounts import Ublkd
from tests.servers import Registry, docker_registry, nginx_serving

EVERY = 100  # every EVERY-th regular file > 4 KiB changes
REF = "delta"


def make_v2_tar(v1: Path, v2: Path, changed_tar: Path) -> tuple[int, int, int]:
    """v2 = v1 with every EVERY-th regular file > 4 KiB rewritten (same size, new bytes);
    ``changed_tar`` holds only the rewritten files. -> (files, changed files, changed bytes)."""
    files = changed = nbytes = 0
    big = 0
    with (
        tarfile.open(v1) as src,
        tarfile.open(v2, "w", format=tarfile.PAX_FORMAT) as dst,
        tarfile.open(changed_tar, "w", format=tarfile.PAX_FORMAT) as diff,
    ):
        for m in src:
            f = src.extractfile(m) if m.isreg() else None
            files += m.isreg()
            if f is not None and m.size > 4096:
                big += 1
                if big % EVERY == 0:
                    data = random.Random(m.name).randbytes(m.size)
                    changed += 1
                    nbytes += m.size
                    dst.addfile(m, _Bytes(data))
                    diff.addfile(m, _Bytes(data))
                    continue
            dst.addfile(m, f)
    return files, changed, nbytes


# a few packages "replaced" by make_v2_packages_tar: small to mid-sized, as a day's updates
PACKAGES = ("gzip", "sed", "grep", "tar", "libzstd1:amd64")


def make_v2_packages_tar(
    v1: Path, v2: Path, packages: tuple[str, ...] = PACKAGES
) -> tuple[int, int, int]:
    """v2 = v1 with ``packages`` replaced by another version, made up: each regular file the
    package lists (/var/lib/dpkg/info/PKG.list) rewritten with new bytes 90-110 % of its
    size, its last listed file removed, a new file (/usr/share/doc/PKG/NEWS.v2) added.
    -> (files in v2, changed or added files, their bytes)."""
    with tarfile.open(v1) as src:
        members = src.getmembers()
        by_name = {m.name.lstrip("./").lstrip("/"): m for m in members}
        owned: dict[str, str] = {}  # path -> package
        removed: set[str] = set()
        for pkg in packages:
            listed = by_name[f"var/lib/dpkg/info/{pkg}.list"]
            f = src.extractfile(listed)
            assert f is not None
            files = [n.lstrip("/") for n in f.read().decode().split("\n")]
            regular = [n for n in files if n in by_name and by_name[n].isreg()]
            removed.add(regular[-1])
            owned.update((n, pkg) for n in regular[:-1])
        files = changed = nbytes = 0
        with tarfile.open(v2, "w", format=tarfile.PAX_FORMAT) as dst:
            for m in members:
                name = m.name.lstrip("./").lstrip("/")
                if name in removed:
                    continue
                files += m.isreg()
                pkg = owned.get(name)
                if pkg is None:
                    dst.addfile(m, src.extractfile(m) if m.isreg() else None)
                    continue
                rnd = random.Random(name)
                data = rnd.randbytes(max(1, m.size * rnd.randint(90, 110) // 100))
                m.size = len(data)
                dst.addfile(m, _Bytes(data))
                changed += 1
                nbytes += len(data)
            for pkg in packages:
                doc = f"usr/share/doc/{pkg.split(':')[0]}"
                data = random.Random(pkg).randbytes(3000)
                info = tarfile.TarInfo(f"./{doc}/NEWS.v2")
                info.size, info.mtime, info.mode = len(data), 1700000000, 0o644
                dst.addfile(info, _Bytes(data))
                files += 1
                changed += 1
                nbytes += len(data)
    return files, changed, nbytes


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        out = self.data[self.pos : end]
        self.pos += len(out)
        return out


def _blobs(reg: Registry) -> dict[str, int]:
    root = reg.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256"
    return {p.parent.name: p.stat().st_size for p in root.glob("*/*/data")}


def _pushed(reg: Registry, push: list[str]) -> int:
    """Bytes of the blobs the registry gained from running ``push``."""
    before = _blobs(reg)
    subprocess.run(push, check=True, capture_output=True, timeout=1800)
    return sum(n for d, n in _blobs(reg).items() if d not in before)


def _bui(*args: str | Path) -> list[str]:
    return [
        str(Path(__file__).resolve().parent.parent / ".venv/bin/btrfs-ublk-image"),
        *map(str, args),
    ]


def _spec(path: Path, tar: str) -> Path:
    path.write_text(
        f"version: 1\nname: {path.stem}\nsource_date_epoch: 1700000000\n"
        f"layers:\n  - tar: {{path: {tar}}}\n"
    )
    return path


def _read_all(mnt: Path) -> None:
    subprocess.run(
        ["find", str(mnt), "-xdev", "-type", "f", "-exec", "cat", "{}", "+"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=1800,
    )


def measure_delta(v1_tar: Path, work: Path, ublkd: Ublkd) -> dict[str, Any]:
    remove(work)
    work.mkdir(parents=True)
    site = work / "site"
    site.mkdir()
    v1, v2, diff = work / "v1.tar", work / "v2.tar", work / "changed.tar"
    v1.hardlink_to(v1_tar) if v1_tar.stat().st_dev == work.stat().st_dev else subprocess.run(
        ["cp", v1_tar, v1], check=True
    )
    files, changed, changed_bytes = make_v2_tar(v1, v2, diff)
    b1, b2 = site / "v1.bundle", site / "v2.bundle"
    subprocess.run(_bui("build", _spec(work / "v1.yaml", "v1.tar"), "-o", b1), check=True)
    subprocess.run(
        _bui("build", _spec(work / "v2.yaml", "v2.tar"), "-o", b2, "--base", b1), check=True
    )
    delta = subprocess.run(
        _bui("diff", "--delta", b1, b2), capture_output=True, text=True, timeout=600
    ).stdout
    predicted = {k: int(v) for k, v in (line.split(": ") for line in delta.splitlines())}
    layouts = {}
    for name, tars in (("v1", [v1]), ("v2", [v2]), ("v2-layered", [v1, diff])):
        layouts[name] = work / f"oci-{name}"
        write_oci_layout(layouts[name], tars[0], REF, extra_layers=tars[1:])
    out: dict[str, Any] = {
        "files": files,
        "changed_files": changed,
        "changed_bytes": changed_bytes,
        "diff_delta": predicted,
    }
    mnt = work / "mnt"
    mnt.mkdir()
    with docker_registry(work / "registry") as reg:
        a = reg.address
        out["ours_push_v1"] = _pushed(reg, _bui("push", b1, f"{a}/ours:v1"))
        out["ours_push_v2"] = _pushed(reg, _bui("push", b2, f"{a}/ours:v2"))
        sk = ["skopeo", "copy", "-q", "--dest-tls-verify=false", "--dest-compress"]
        for name in ("v1", "v2", "v2-layered"):
            out[f"oci_push_{name}"] = _pushed(
                reg, [*sk, f"oci:{layouts[name]}:{REF}", f"docker://{a}/oci:{name}"]
            )
        # pulls of v2 by a host that holds v1: skopeo into one OCI layout, ours mounted
        pulled = work / "oci-pulled"
        for name in ("v1", "v2", "v2-layered"):
            out[f"oci_pull_{name}"] = _registry_get_bytes(reg, [
                "skopeo", "copy", "-q", "--src-tls-verify=false",
                f"docker://{a}/oci:{name}", f"oci:{pulled}:{name}"])  # fmt: skip
        for name in ("v1", "v2"):
            before = len(reg.requests())
            _mount_read(ublkd, f"oci://{a}/ours:{name}", mnt, work / "cache-oci")
            reqs = reg.requests()[before:]
            out[f"ours_oci_fetch_{name}_all"] = sum(r.bytes_sent for r in reqs if r.method == "GET")
    with nginx_serving(site, work / "nginx") as web:
        for name in ("v1", "v2"):
            web.clear_log()
            st = _mount_read(ublkd, f"{web.url}/{name}.bundle/manifest.json", mnt, work / "cache")
            reqs = web.requests()
            out[f"ours_fetch_{name}"] = sum(r.bytes_sent for r in reqs if "/packs/" in r.path)
            # bodies of answered requests (a 404 for an absent prefetch.trace has a body)
            out[f"ours_fetch_{name}_all"] = sum(
                r.bytes_sent for r in reqs if r.status in (200, 206)
            )
            out[f"ours_shared_{name}"] = int(st.get("disk_cache_shared_bytes", 0))
    remove(work)
    return out


def _mount_read(ublkd: Ublkd, location: str, mnt: Path, cache: Path) -> dict[str, Any]:
    """Mount ``location``, read every file, unmount; -> the mount's settled status."""
    ublkd.run(["mount", location, str(mnt), "--frontend", "fuse", "--cache-dir", str(cache)])
    try:
        _read_all(mnt)
        return ublkd.settled_status(mnt)
    finally:
        ublkd.umount(mnt)


def _registry_get_bytes(reg: Registry, cmd: list[str]) -> int:
    """Body bytes the registry sent for GETs while ``cmd`` ran (its access log)."""
    before = len(reg.requests())
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    return sum(r.bytes_sent for r in reg.requests()[before:] if r.method == "GET")


def delta_table(d: dict[str, Any]) -> str:
    from bench.report import human

    push = f"{human(d['ours_push_v1'])} | {human(d['ours_push_v2'])}"
    rows = [
        "| how | push of v1 | push of v2 after v1 | fetch of v2 on a host that read v1 |",
        "|---|---:|---:|---:|",
        f"| ours: `build --base`, `push`, `ublkd mount` over HTTP (nginx) | {push}"
        f" | {human(d['ours_fetch_v2_all'])} ({human(d['ours_fetch_v2'])} of packs) |",
        f"| ours: the same, `ublkd mount oci://` (registry) | {push}"
        f" | {human(d['ours_oci_fetch_v2_all'])} |",
        f"| OCI, one layer, `skopeo copy --dest-compress`; pulled with `skopeo copy` into"
        f" a layout holding v1 | {human(d['oci_push_v1'])} | {human(d['oci_push_v2'])}"
        f" | {human(d['oci_pull_v2'])} |",
        f"| OCI, v1's layer + a layer of the changed files | {human(d['oci_push_v1'])}"
        f" | {human(d['oci_push_v2-layered'])} | {human(d['oci_pull_v2-layered'])} |",
    ]
    return "\n".join(rows) + "\n"


def delta_section(doc: dict[str, Any]) -> str:
    from bench.report import human, machine_line

    d = doc["delta"]
    p = d["diff_delta"]
    bound = d["changed_bytes"] * 11 // 10
    return (
        f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}.\n\n"
        f"v1: the Debian minbase tarball ({d['files']:,} regular files); v2: v1 with"
        f" {d['changed_files']} of its files larger than 4 KiB rewritten (every 100th,"
        f" {d['changed_bytes']:,} bytes). `diff --delta v1 v2`: {p['changed']} changed,"
        f" fetch {p['fetch_bytes']:,} bytes in {p['fetch_chunks']} chunks plus"
        f" {p['meta_bytes']:,} of metadata (manifest.json and the meta.img and blockmap"
        f" patches), push {p['push_bytes']:,}. The bound (changed bytes + 10 %):"
        f" {bound:,} bytes; ours pushed {d['ours_push_v2']:,} and fetched"
        f" {d['ours_fetch_v2_all']:,} (HTTP) and {d['ours_oci_fetch_v2_all']:,} (OCI)."
        " Pushed: blobs the registry gained during v2's push; fetched: nginx's and the"
        " registry's access logs (bodies of GETs), v2 read whole after v1 on the same host"
        f" ({human(d['ours_shared_v2'])} of pack chunks found in v1's chunk cache, v1's"
        " meta.img and blockmap found as v2's patch base); v1 for reference: pushed"
        f" {human(d['ours_push_v1'])}, fetched {human(d['ours_fetch_v1_all'])}.\n\n"
        + delta_table(d)
    )
