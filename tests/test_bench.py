"""The build benchmark's own code (bench/): input generator, measurement, report. Not a speed test."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import inputs  # noqa: E402
from bench.measure import Result, Sample, pipeline, run_measured, tree_size  # noqa: E402
from bench.report import build_section, build_table, update_doc  # noqa: E402

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


def _res(name: str, walls: list[float], rss: int, out: int | None = None) -> Result:
    r = Result(name, name, ["true"], [Sample(w, rss, 0) for w in walls])
    r.output_bytes = r.output_alloc_bytes = out
    return r


def test_report_table_json_and_doc_section(tmp_path: Path) -> None:
    ours = _res("ours", [2.0, 1.0, 3.0], 50_000, 10 << 20)
    tar_x = _res("tar_x", [1.0, 1.0, 1.0], 2_000)
    mkfs = _res("mkfs_btrfs", [3.0, 3.0, 4.0], 20_000, 12 << 20)
    base = pipeline("tar_x+mkfs_btrfs", "baseline", [tar_x, mkfs])
    broken = Result("mkfs_erofs", "mkfs.erofs", ["x"], error="exit status 1")
    assert base.walls == [4.0, 4.0, 5.0] and base.peak_rss_kib == 20_000
    assert base.output_bytes == 12 << 20

    table = build_table([ours, tar_x, mkfs, base, broken], 100_000_000, 1000, "ours")
    lines = table.splitlines()
    assert len(lines) == 2 + 5
    assert lines[2].startswith("| ours | 1.00 | 2.00 | 2.00 | 50.0 | 500 |")
    assert lines[2].rstrip().endswith("| 1.00x |")
    assert "| 2.00x |" in lines[5]  # baseline median 4.0 / ours 2.0
    assert "exit status 1" in lines[6]

    j = ours.to_json(100_000_000, 1000)
    assert j["wall_median_s"] == 2.0 and j["mb_per_s"] == 50.0 and j["files_per_s"] == 500.0
    assert j["rss_bytes_per_file"] == 50_000 * 1024 / 1000
    json.dumps(broken.to_json(1, 1))

    stats = inputs.InputStats(entries=1000, content_bytes=100_000_000, tar_bytes=1 << 27)
    doc = {
        "machine": {"date": "today", "nproc": 2, "tools": {"tar": "tar 1"}},
        "build": {
            "command": "bench/run --quick",
            "repeats": 3,
            "cache_policy": "cold.",
            "input": {"stats": stats.to_json()},
        },
    }
    body = build_section(doc, table)
    assert table.strip() in body and "bench/run --quick" in body

    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n## Build\n\n<!-- bench:build:begin -->\nold\n"
                  "<!-- bench:build:end -->\n\n## Mount\n")  # fmt: skip
    update_doc(md, "build", body)
    text = md.read_text()
    assert "\nold\n" not in text and table.strip() in text
    assert text.startswith("# Benchmarks\n") and text.endswith("## Mount\n")
    update_doc(md, "build", body)
    assert md.read_text() == text
