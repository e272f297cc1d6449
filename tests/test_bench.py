"""The build benchmark's own code (bench/): input generator, measurement, report. Not a speed test."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import inputs  # noqa: E402
from bench.build import Job, _read_and_write_floor, _steps, in_turn  # noqa: E402
from bench.build import main as bench_main  # noqa: E402
from bench.measure import Result, Sample, pipeline, run_measured, tree_size  # noqa: E402
from bench.pairs import build_command, disk_bytes  # noqa: E402
from bench.report import (  # noqa: E402
    TAR_BASELINE,
    UMOCI_BASELINE,
    build_inputs,
    build_section,
    build_summary,
    build_table,
    update_doc,
)

pytestmark = pytest.mark.unit

TINY = inputs.InputParams(files=50, large_bytes=1 << 20, large_count=2, seed=7)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_generator_makes_a_cached_pax_tarball(tmp_path: Path) -> None:
    data = inputs.ensure_inputs(tmp_path, TINY)
    st = data.stats
    assert data.tar.is_file() and data.spec.is_file()
    assert st.regular_names + st.symlinks + st.directories == st.entries
    assert st.large_files == 2 and st.large_bytes == 1 << 20
    assert st.content_bytes == st.small_bytes + st.large_bytes
    assert st.tar_bytes == data.tar.stat().st_size
    assert not (data.directory / "tree").exists()  # the extracted tree is not kept

    with tarfile.open(data.tar) as tf:
        members = tf.getmembers()
    assert len(members) == st.entries + 1  # + "."
    assert all(m.size <= inputs.MAX_SMALL for m in members if "/large/" not in m.name)
    names = {m.name for m in members}
    assert "./large/blob-0.bin" in names and "./large/blob-1.bin" in names
    assert sum(m.isfile() for m in members) == st.regular_inodes
    assert sum(m.islnk() for m in members) == st.hardlinks
    assert sum(m.issym() for m in members) == st.symlinks
    assert sum(m.size for m in members if m.isfile()) == st.content_bytes

    # the second call reuses the cache
    mtime = data.tar.stat().st_mtime_ns
    again = inputs.ensure_inputs(tmp_path, TINY)
    assert again.tar.stat().st_mtime_ns == mtime and again.stats == st


def test_generator_is_deterministic(tmp_path: Path) -> None:
    small = inputs.InputParams(files=300, large_bytes=4096, large_count=1, seed=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sa = inputs.generate_tree(tmp_path / "a", small)
    sb = inputs.generate_tree(tmp_path / "b", small)
    assert sa == sb
    assert sa.symlinks + sa.hardlinks > 0 and sa.duplicate_files > 0
    assert sa.directories > 1
    for dirpath, _dirs, files in os.walk(tmp_path / "a"):
        for name in files:
            a = Path(dirpath) / name
            b = tmp_path / "b" / a.relative_to(tmp_path / "a")
            if a.is_symlink():
                assert os.readlink(a) == os.readlink(b)
            else:
                assert a.read_bytes() == b.read_bytes()


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_generator_makes_the_same_tarball_bytes_twice(tmp_path: Path) -> None:
    # every time in the tarball is the generator's own (a file's ctime, the time it was
    # made, is left out): the same parameters give the same bytes, hence the same image id
    small = inputs.InputParams(files=200, large_bytes=8192, large_count=2, seed=5)
    digests = [
        hashlib.sha256(inputs.ensure_inputs(tmp_path / d, small).tar.read_bytes()).hexdigest()
        for d in ("a", "b")
    ]
    assert digests[0] == digests[1]


def test_ours_and_the_baseline_builder_take_turns_going_first() -> None:
    steps = [s for s in _steps() if s.name.startswith(("sha256", "ours"))]
    names = [s.name for s in steps]
    assert [s.name for s in in_turn(steps, 0)] == names
    odd = [s.name for s in in_turn(steps, 1)]
    assert sorted(odd) == sorted(names)
    assert odd.index("ours_baseline") < odd.index("ours_baseline_warm") < odd.index("ours")
    assert odd.index("ours") < odd.index("ours_warm")
    assert odd[: odd.index("ours_baseline")] == names[: names.index("ours")]  # floors first
    alone = [s for s in steps if not s.name.startswith("ours_baseline")]
    assert in_turn(alone, 1) == alone  # no baseline builder: nothing to swap


def test_the_summary_gives_each_repeats_own_ratio_to_the_floor() -> None:
    def result(name: str, walls: list[float]) -> Result:
        return Result(name, name, [], [Sample(w, 1000, 0) for w in walls])

    # the floor's disk is slow in the second repeat: ours too, in the same repeat
    results = [
        result("sha256_floor", [4.0, 6.0, 4.2]),
        result("ours", [5.0, 7.2, 5.46]),
        result("sha256_floor_warm", [2.0, 2.0, 2.0]),
        result("ours_warm", [3.0, 3.6, 4.0]),
    ]
    lines = build_summary(results, 1000)
    cold = next(x for x in lines if x.startswith("ours cold / the floor cold"))
    # medians 5.46 / 4.2 = 1.30x; repeats 1.25, 1.20, 1.30
    assert "1.30x of the medians, per repeat 1.25x (1.20-1.30x, 3 repeats)" in cold
    warm = next(x for x in lines if x.startswith("ours warm / the floor warm"))
    assert "1.80x of the medians, per repeat 1.80x (1.50-2.00x, 3 repeats)" in warm
    assert not any("io_floor" in x or "tar -x" in x for x in lines)  # rows not run


def test_run_measured_and_tree_size(tmp_path: Path) -> None:
    log = tmp_path / "log"
    s = run_measured([sys.executable, "-c", "print('hi')"], log)
    assert s.returncode == 0 and s.wall_s > 0 and s.maxrss_kib > 0
    assert b"hi" in log.read_bytes()
    assert run_measured(["sh", "-c", "exit 3"], log).returncode == 3
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 5000)
    os.link(tmp_path / "d" / "f", tmp_path / "d" / "g")
    assert tree_size(tmp_path / "d")[0] == 5000


def test_io_floor_reads_the_input_and_writes_its_content_durably(tmp_path: Path) -> None:
    """The `io_floor` row: the input hashed while its content size (rounded up to 4 MiB
    blocks) is written with O_DIRECT and fsynced beside it."""
    tar = tmp_path / "in.tar"
    tar.write_bytes(os.urandom(1 << 16))
    job = Job(tar, None, "", tmp_path / "t", tmp_path / "u", pack_bytes=(5 << 20) + 1)
    out = tmp_path / "io-floor.bin"
    s = run_measured(_read_and_write_floor(job, out), tmp_path / "log")
    assert s.returncode == 0, (tmp_path / "log").read_text()
    assert out.stat().st_size == 8 << 20
    missing = Job(tmp_path / "nope.tar", None, "", tmp_path / "t", tmp_path / "u", 1)
    assert run_measured(_read_and_write_floor(missing, out), tmp_path / "log").returncode != 0


def test_pairs_runs_a_checkout_with_its_venv_or_a_bare_one_on_pythonpath(tmp_path: Path) -> None:
    spec, out = tmp_path / "spec.yaml", tmp_path / "out"
    bare = tmp_path / "bare"
    cmd, env = build_command(bare, spec, out)
    assert cmd == [
        sys.executable,
        "-P",
        "-m",
        "btrfs_ublk_image",
        "build",
        str(spec),
        "-o",
        str(out),
    ]
    assert env["PYTHONPATH"] == str(bare)
    script = tmp_path / "co" / ".venv/bin/btrfs-ublk-image"
    script.parent.mkdir(parents=True)
    script.write_text("")
    cmd, env = build_command(tmp_path / "co", spec, out)
    assert cmd == [str(script), "build", str(spec), "-o", str(out)]
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_pairs_reads_a_devices_bytes_from_diskstats() -> None:
    text = (
        " 254       0 vda 16402254 12413478 3772896562 16430814 13631060 32949252 11501642440"
        " 71169561 0 9224572 92022969 25321358 294 11255086312 4220018 1970707 202574\n"
        " 253       0 zram0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
    )
    assert disk_bytes(text, os.makedev(254, 0)) == (3772896562 * 512, 11501642440 * 512)
    assert disk_bytes(text, os.makedev(253, 0)) == (0, 0)
    assert disk_bytes(text, os.makedev(8, 1)) is None


def _res(name: str, walls: list[float], rss: int, out: int | None = None) -> Result:
    r = Result(name, name, ["true"], [Sample(w, rss, 0) for w in walls])
    r.output_bytes = r.output_alloc_bytes = out
    return r


def test_report_table_json_and_doc_section(tmp_path: Path) -> None:
    ours = _res("ours", [2.0, 1.0, 3.0], 50_000, 10 << 20)
    ours_oci = _res("ours_oci", [2.5, 2.5, 2.5], 60_000, 10 << 20)
    umoci = _res("umoci_unpack", [6.0, 6.0, 7.0], 30_000)
    mkfs_u = _res("mkfs_btrfs_umoci", [3.0, 3.0, 4.0], 20_000, 12 << 20)
    tar_x = _res("tar_x", [1.0, 1.0, 1.0], 2_000)
    mkfs = _res("mkfs_btrfs", [3.0, 3.0, 4.0], 20_000, 12 << 20)
    ubase = pipeline(UMOCI_BASELINE, "umoci baseline", [umoci, mkfs_u])
    base = pipeline(TAR_BASELINE, "tar baseline", [tar_x, mkfs])
    broken = Result("mkfs_erofs", "mkfs.erofs", ["x"], error="exit status 1")
    assert base.walls == [4.0, 4.0, 5.0] and base.peak_rss_kib == 20_000
    assert ubase.walls == [9.0, 9.0, 11.0] and ubase.peak_rss_kib == 30_000
    assert base.output_bytes == 12 << 20
    results = [ours, ours_oci, umoci, mkfs_u, ubase, tar_x, mkfs, base, broken]

    table = build_table(results, 100_000_000, 1000)
    lines = table.splitlines()
    assert len(lines) == 2 + 9
    assert lines[0].endswith("| umoci + mkfs.btrfs / this | tar -x + mkfs.btrfs / this |")
    assert lines[1].count("|") == lines[0].count("|")
    # ours: median 2.0; umoci baseline 9.0 / 2.0, tar baseline 4.0 / 2.0
    assert lines[2].startswith("| ours | 1.00 | 2.00 | 2.00 | 50.0 | 500 |")
    assert lines[2].endswith("| 4.50x | 2.00x |")
    assert lines[3].endswith("| 3.60x | 1.60x |")  # ours from OCI: 9.0 / 2.5, 4.0 / 2.5
    assert lines[6].endswith("| 1.00x | 0.44x |")  # the umoci baseline itself
    assert lines[9].endswith("| 2.25x | 1.00x |")
    assert "exit status 1" in lines[10] and lines[10].count("|") == lines[0].count("|")
    # without an umoci baseline (a JSON from before it) its column is left out
    old = build_table([ours, tar_x, mkfs, base], 100_000_000, 1000).splitlines()
    assert old[0].endswith("| output | tar -x + mkfs.btrfs / this |")

    summary = build_summary(results, 1000)
    assert summary[0] == (
        "ours: 2.00x vs tar -x + mkfs.btrfs (2.00x with writeback,"
        " target 3x missed); 4.50x vs umoci + mkfs.btrfs (4.50x with writeback);"
        " 51,200 B peak RSS per entry"
    )
    assert summary[1].startswith("ours_oci: 3.60x vs umoci + mkfs.btrfs")  # its own baseline first
    assert len(summary) == 2

    j = ours.to_json(100_000_000, 1000)
    assert j["wall_median_s"] == 2.0 and j["mb_per_s"] == 50.0 and j["files_per_s"] == 500.0
    assert j["rss_bytes_per_file"] == 50_000 * 1024 / 1000
    json.dumps(broken.to_json(1, 1))

    stats = inputs.InputStats(entries=1000, content_bytes=100_000_000, tar_bytes=1 << 27)
    layers = [{"media_type": "application/vnd.oci.image.layer.v1.tar+gzip", "size": 5 << 20}]
    doc = {
        "machine": {"date": "today", "nproc": 2, "tools": {"tar": "tar 1"}},
        "build": {
            "command": "bench/run --quick",
            "repeats": 3,
            "cache_policy": "cold.",
            "inputs": {
                name: {
                    "label": label,
                    "repeats": 3,
                    "input": {
                        "tar": f"/x/{name}.tar",
                        "stats": stats.to_json(),
                        "oci": {"layout": "/x/oci", "ref": "r", "layers": layers},
                    },
                    "results": {r.name: r.to_json(100_000_000, 1000) for r in results},
                    "skipped": {"mksquashfs": "mksquashfs not installed"},
                }
                for name, label in (("synthetic", "Synthetic set"), ("debian", "Debian image"))
            },
        },
    }
    body = build_section(doc)
    assert body.count(table.strip()) == 2 and "bench/run --quick" in body
    assert "**Synthetic set** (3 repeats each)" in body and "**Debian image**" in body
    assert "`debian.tar` (128.0 MiB) holding 1,000 entries" in body
    assert "OCI layout `/x/oci`, ref `r`: 1 layer (5.0 MiB tar+gzip)." in body
    assert f"* {summary[0]}" in body and "* skipped mksquashfs: mksquashfs not installed" in body

    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n## Build\n\n<!-- bench:build:begin -->\nold\n"
                  "<!-- bench:build:end -->\n\n## Mount\n")  # fmt: skip
    update_doc(md, "build", body)
    text = md.read_text()
    assert "\nold\n" not in text and table.strip() in text
    assert text.startswith("# Benchmarks\n") and text.endswith("## Mount\n")
    update_doc(md, "build", body)
    assert md.read_text() == text


def test_from_json_renders_a_build_json_from_before_the_oci_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A saved JSON of one input (``input``/``results`` at the top) still renders."""
    saved = ROOT / "bench" / "results" / "build-2026-11-22-quiet.json"
    b = json.loads(saved.read_text())["build"]
    (one,) = build_inputs(b).values()
    assert one["results"] == b["results"]
    assert bench_main(["--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| output | tar -x + mkfs.btrfs / this |" in out
    assert "ours: btrfs-ublk-image build: 1.46x vs tar -x + mkfs.btrfs" in out


@pytest.mark.parametrize(
    ("sections", "made"),
    [("delta", False), ("delta,containerd", False), ("randread", True), ("build", True)],
)  # fmt: skip
def test_bench_run_makes_the_synthetic_set_only_for_sections_that_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sections: str, made: bool
) -> None:
    """`bench/run --sections delta` (and the others that never read it) does not generate
    the synthetic input; mount, randread and the build section's synthetic rows do. The
    sections themselves are stubbed: what is checked is the input made before them."""
    import bench.build
    import bench.runtime

    calls: list[inputs.InputParams] = []

    class Made(Exception):
        pass

    def ensure_inputs(workdir: Path, params: inputs.InputParams, log: object) -> None:
        calls.append(params)
        raise Made  # (generating it is what is avoided)

    monkeypatch.setattr(bench.build.inp, "ensure_inputs", ensure_inputs)
    monkeypatch.setattr(bench.build, "drop_caches", lambda: False)
    monkeypatch.setattr(bench.build, "_check_disk", lambda *a: None)
    monkeypatch.setattr(bench.runtime, "run_runtime", lambda *a: {})
    argv = ["--quick", "--workdir", str(tmp_path), "--sections", sections]
    if made:
        with pytest.raises(Made):
            bench_main(argv)
        assert calls == [bench.build.QUICK]
    else:
        assert bench_main(argv) == 0
        assert calls == []


def test_oci_layout_of_an_input_is_the_tarball_hardlinked(tmp_path: Path) -> None:
    data = inputs.ensure_inputs(tmp_path, TINY)
    layout = inputs.ensure_oci_layout(data)
    assert layout == data.directory / "oci"
    index = json.loads((layout / "index.json").read_text())
    (desc,) = index["manifests"]
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == inputs.OCI_REF
    blobs = layout / "blobs" / "sha256"
    for blob in blobs.iterdir():  # every blob's name is its sha256
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    manifest = json.loads((blobs / desc["digest"].split(":")[1]).read_text())
    assert desc["size"] == (blobs / desc["digest"].split(":")[1]).stat().st_size
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    assert layer["size"] == data.stats.tar_bytes
    layer_blob = blobs / layer["digest"].split(":")[1]
    assert layer_blob.stat().st_ino == data.tar.stat().st_ino  # a hardlink, not a copy
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_text())
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer["digest"]]}
    assert inputs.layout_layers(layout, inputs.OCI_REF) == [
        {"media_type": layer["mediaType"], "size": data.stats.tar_bytes}
    ]
    with pytest.raises(ValueError, match="no image with ref 'nope'"):
        inputs.layout_layers(layout, "nope")

    # cached: the second call writes nothing; a half-written leftover is replaced
    mtime = (layout / "index.json").stat().st_mtime_ns
    assert inputs.ensure_oci_layout(data) == layout
    assert (layout / "index.json").stat().st_mtime_ns == mtime
    (layout / "index.json").unlink()
    assert (inputs.ensure_oci_layout(data) / "index.json").read_text() == json.dumps(
        index, sort_keys=True
    ) + "\n"
    assert [p.name for p in data.directory.iterdir() if p.name.startswith(".oci.")] == []


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci not installed")
def test_umoci_unpacks_the_layout_into_the_input_tree(tmp_path: Path) -> None:
    """External oracle: umoci (the baseline's own tool) reads the layout we write and
    unpacks exactly the tarball's names, sizes and symlink targets."""
    data = inputs.ensure_inputs(tmp_path, TINY)
    layout = inputs.ensure_oci_layout(data)
    bundle = tmp_path / "bundle"
    subprocess.run(
        ["umoci", "unpack", "--rootless", "--image", f"{layout}:{inputs.OCI_REF}", str(bundle)],
        check=True,
        capture_output=True,
    )
    rootfs = bundle / "rootfs"
    with tarfile.open(data.tar) as tf:
        members = [m for m in tf.getmembers() if m.name != "."]
    assert len(members) == data.stats.entries
    for m in members:
        p = rootfs / m.name
        if m.issym():
            assert os.readlink(p) == m.linkname
        elif m.isdir():
            assert p.is_dir()
        elif m.islnk():
            assert os.path.samefile(p, rootfs / m.linkname)
        else:
            assert p.read_bytes() == tf_bytes(data.tar, m)
    unpacked = sum(len(d) + len(f) for _, d, f in os.walk(rootfs))
    assert unpacked == data.stats.entries


def tf_bytes(tar: Path, m: tarfile.TarInfo) -> bytes:
    with tarfile.open(tar) as tf:
        f = tf.extractfile(m)
        assert f is not None
        return f.read()


def test_tar_stats_counts_an_input_we_did_not_generate(tmp_path: Path) -> None:
    tar = tmp_path / "rootfs.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as tf:

        def add(name: str, kind: bytes, data: bytes = b"", link: str = "") -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.size, ti.linkname = kind, len(data), link
            tf.addfile(ti, io.BytesIO(data) if data else None)

        add("./", tarfile.DIRTYPE)
        add("./etc", tarfile.DIRTYPE)
        add("./etc/a", tarfile.REGTYPE, b"x" * 100)
        add("./etc/b", tarfile.LNKTYPE, link="./etc/a")
        add("./etc/c", tarfile.SYMTYPE, link="a")
        add("./etc/d", tarfile.REGTYPE, b"")
    st = inputs.tar_stats(tar)
    assert (st.entries, st.directories, st.regular_names, st.regular_inodes) == (5, 1, 3, 2)
    assert (st.hardlinks, st.symlinks, st.content_bytes) == (1, 1, 100)
    assert st.tar_bytes == tar.stat().st_size


def test_delta_v2_packages_replaces_the_listed_files(tmp_path: Path) -> None:
    """make_v2_packages_tar: the files a package lists get new bytes of 90-110 % of their
    size, its last listed file goes, a NEWS.v2 comes; every other member is unchanged; the
    layer tar holds the changed and new files and a whiteout of the removed one."""
    from bench.delta import make_v2_packages_tar

    v1, v2 = tmp_path / "v1.tar", tmp_path / "v2.tar"
    files = {f"./usr/bin/p{i}": os.urandom(1000 * (i + 1)) for i in range(3)}
    files["./usr/bin/other"] = os.urandom(777)
    files["./var/lib/dpkg/info/pkg:amd64.list"] = b"/.\n/usr\n/usr/bin\n" + b"".join(
        f"/usr/bin/p{i}\n".encode() for i in range(3)
    )
    with tarfile.open(v1, "w", format=tarfile.PAX_FORMAT) as t:
        for name in ("./", "./usr", "./usr/bin", "./usr/share/doc/pkg"):
            m = tarfile.TarInfo(name)
            m.type = tarfile.DIRTYPE
            t.addfile(m)
        for name, data in files.items():
            m = tarfile.TarInfo(name)
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    layer = tmp_path / "layer.tar"
    n, changed, nbytes = make_v2_packages_tar(v1, v2, ("pkg:amd64",), layer)
    with tarfile.open(v2) as b, tarfile.open(layer) as c:
        new = {m.name: b.extractfile(m).read() for m in b if m.isreg()}  # type: ignore[union-attr]
        diff = {m.name: c.extractfile(m).read() for m in c if m.isreg()}  # type: ignore[union-attr]
    assert set(new) == set(files) - {"./usr/bin/p2"} | {"./usr/share/doc/pkg/NEWS.v2"}
    # the layer over v1: what changed or came, and a whiteout of what went
    assert diff == {k: v for k, v in new.items() if files.get(k) != v} | {"./usr/bin/.wh.p2": b""}
    for i in range(2):
        old, got = files[f"./usr/bin/p{i}"], new[f"./usr/bin/p{i}"]
        assert got != old and 0.9 * len(old) <= len(got) <= 1.1 * len(old)
    assert new["./usr/bin/other"] == files["./usr/bin/other"]
    assert (n, changed) == (5, 3)
    assert nbytes == sum(len(new[k]) for k in new if k not in files or new[k] != files[k])


def test_passthrough_table_rows_errors_and_crash_runs() -> None:
    """bench/passthrough.py's table: one row per fio job with each target's IOPS, CPU split
    and server reads (a failed job as its error), the mount times, one row per crash run;
    and the kernel's per-task CPU ticks parsed from /proc (this process has some)."""
    from bench.passthrough import _ticks, passthrough_table

    cpu = {"fio": 9.1, "kworkers": 8.3, "server": 0.0}
    d = {
        "kernel": "6.18.0",
        "targets": {
            "fuse_page": {"psync-j1": {"iops": 20249.0, "cpu_us_per_io": cpu, "server_reads": 30}},
            "fuse_passthrough": {"psync-j1": {"error": "fio exited 1: boom"}},
            "btrfs_loop": {"psync-j1": {"iops": 13359.4, "cpu_us_per_io": cpu}},
        },
        "mount_ms": {"fuse_page": [49, 226], "fuse_passthrough": [806, 1996]},
        "crash": {
            "page/server": {"reads": 27927, "failed": 0, "max_ms": 101.8, "after_kill": 27501,
                            "after_kill_max_ms": 101.8},
            "passthrough/supervisor": {"reads": 15066, "failed": 0, "max_ms": 33.6,
                                       "after_kill": 10004, "after_kill_max_ms": 32.3},
        },
    }  # fmt: skip
    lines = passthrough_table(d).splitlines()
    row = next(ln for ln in lines if ln.startswith("| psync-j1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == [
        "psync-j1",
        "20,249 IOPS; 9.1 + 8.3 + 0.0 µs; 30 reached the server",
        "error: fio exited 1: boom",
        "13,359 IOPS; 9.1 + 8.3 µs",
    ]
    assert any("passthrough 806-1,996 ms" in ln and "kernel 6.18.0" in ln for ln in lines)
    assert "| page: the server (restarted) | 27,927 | 0 | 101.8 | 27,501, 101.8 |" in lines
    assert any(ln.startswith("| passthrough: the supervisor (connection ends) |") for ln in lines)
    assert _ticks(os.getpid()) > 0 and _ticks(2**31) == 0


def test_meta_patch_changes_keep_every_other_path(tmp_path: Path) -> None:
    """bench/meta_patch.py's v2 of each kind: v1 untouched (v2 starts as its hard links),
    xattr and rename on every 100th single-name file (renamed ones sorting where they
    did), append after the last directory's last name, resize and addremove (new bytes of
    another size, under the same name or a new one beside it); other paths as in v1."""
    from bench.meta_patch import EVERY, KINDS, changed_bytes, make_v2, regular_files

    v1 = tmp_path / "v1"
    v1.mkdir()
    inputs.generate_tree(v1, inputs.InputParams(files=300, large_bytes=0, large_count=0))
    before = {p: p.read_bytes() for p in regular_files(v1)}
    n = len(before)
    assert n >= 2 * EVERY
    for kind in KINDS:
        v2 = tmp_path / f"v2-{kind}"
        changed = make_v2(v1, v2, kind)
        every = len(range(0, n, EVERY))
        assert changed == {"append": n // EVERY, "bound": every + 2}.get(kind, every)
        assert {p: p.read_bytes() for p in before} == before
        assert all(not os.listxattr(p) for p in before)
        names = sorted(str(p.relative_to(v2)) for p in v2.rglob("*"))
        old = sorted(str(p.relative_to(v1)) for p in v1.rglob("*"))
        if kind == "xattr":
            assert names == old
            assert sum(1 for p in v2.rglob("*") if p.is_file() and os.listxattr(p)) == changed
        elif kind == "rename":
            renamed = [s for s in names if s.endswith("-v2")]
            assert len(renamed) == changed and len(names) == len(old)
            for s in renamed:  # the same place among its siblings
                parent = (v2 / s).parent
                sib_new = sorted(os.listdir(parent))
                sib_old = sorted(os.listdir(v1 / parent.relative_to(v2)))
                assert sib_new.index(Path(s).name) == sib_old.index(Path(s).name[: -len("-v2")])
        elif kind in ("resize", "addremove", "bound"):
            gone, came = set(old) - set(names), set(names) - set(old)
            assert len(gone) == len(came) == {"resize": 0, "bound": 1}.get(kind, changed)
            suffix = "-added" if kind == "bound" else "-new"
            assert {g + suffix for g in gone} == came
            kept = [p for p in before if (v2 / p.relative_to(v1)).exists()]
            differ = [p for p in kept if (v2 / p.relative_to(v1)).read_bytes() != before[p]]
            assert len(differ) == {"addremove": 0, "bound": every}.get(kind, changed)
            new_bytes = sum((v2 / p.relative_to(v1)).stat().st_size for p in differ)
            new_bytes += sum((v2 / c).stat().st_size for c in came)
            assert changed_bytes(v1, v2) == new_bytes
        else:
            added = sorted(set(names) - set(old))
            assert len(added) == changed and set(old) <= set(names)
            last = Path(added[0]).parent
            assert all(Path(a).parent == last for a in added)
            assert max(os.listdir(v2 / last)) == Path(added[-1]).name
        # v2 stays: its hard links of v1's files must not hide them from the next kind


def test_meta_patch_lists_every_file_of_a_hard_linked_copy(tmp_path: Path) -> None:
    """bench/meta_patch.py on a v1 that is a hard-linked copy (``cp -al``) of a tree: every
    regular file is listed as in the tree itself (links from outside v1 do not count), a
    file with two names inside v1 is left out, and v2 changes 1 % of the files."""
    from bench.meta_patch import EVERY, make_v2, regular_files

    tree, v1 = tmp_path / "tree", tmp_path / "v1"
    tree.mkdir()
    inputs.generate_tree(tree, inputs.InputParams(files=300, large_bytes=0, large_count=0))
    (tree / "two-names").write_bytes(b"linked\n")
    os.link(tree / "two-names", tree / "two-names-too")
    subprocess.run(["cp", "-al", tree, v1], check=True)
    want = single_name_files(tree)
    assert len(want) > 2 * EVERY and (tree / "two-names").stat().st_nlink == 4
    assert tree / "two-names" not in want
    assert regular_files(tree) == want
    assert regular_files(v1) == [v1 / p.relative_to(tree) for p in want]
    changed = make_v2(v1, tmp_path / "v2", "resize")
    assert changed == len(range(0, len(want), EVERY))
    assert all(p.read_bytes() == (v1 / p.relative_to(tree)).read_bytes() for p in want)


def single_name_files(root: Path) -> list[Path]:
    """The regular files under ``root`` (GNU find's list) whose inode no other path
    under ``root`` names."""
    out = subprocess.run(
        ["find", root, "-type", "f", "-printf", "%i %p\\0"], check=True, capture_output=True
    ).stdout
    rows = [r.split(b" ", 1) for r in out.split(b"\0") if r]
    count: dict[bytes, int] = {}
    for ino, _ in rows:
        count[ino] = count.get(ino, 0) + 1
    return sorted(Path(os.fsdecode(p)) for ino, p in rows if count[ino] == 1)
