"""The build section of bench/run end to end on a tiny input (root: the page cache is
dropped, the reflink row mounts a loop device): every row runs and is reported,
including umoci unpack + mkfs.btrfs on the OCI layout bench/inputs.py writes. Not a
speed test: no figure is checked."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import inputs  # noqa: E402
from bench.build import BuildInput, run_build  # noqa: E402
from bench.report import TAR_BASELINE, UMOCI_BASELINE, build_table  # noqa: E402

pytestmark = pytest.mark.root

TINY = inputs.InputParams(files=300, large_bytes=2 << 20, large_count=1, seed=11)
TOOLS = ("umoci", "mkfs.btrfs", "tar", "mksquashfs", "mkfs.erofs")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (drop caches, loop mount)")
@pytest.mark.skipif(
    any(shutil.which(t) is None for t in TOOLS), reason=f"needs all of {', '.join(TOOLS)}"
)
def test_build_section_runs_every_row_on_a_tiny_input(tmp_path: Path) -> None:
    data = inputs.ensure_inputs(tmp_path, TINY)
    layout = inputs.ensure_oci_layout(data)
    bi = BuildInput("synthetic", "tiny", data.tar, layout, inputs.OCI_REF, data.stats, 2, {})
    work = tmp_path / "work"
    work.mkdir()
    results, skipped = run_build(bi, work, peers=True)
    by = {r.name: r for r in results}
    # today's commit: not given
    assert skipped == {
        "ours_baseline": "no --baseline-builder",
        "ours_baseline_warm": "no --baseline-builder",
    }
    for name in ("ours", "ours_oci", "ours_in_place", "ours_in_place_reflink", "umoci_unpack",
                 "mkfs_btrfs_umoci", UMOCI_BASELINE, "tar_x", "mkfs_btrfs", TAR_BASELINE,
                 "mksquashfs", "mkfs_erofs", "mksquashfs_tar"):  # fmt: skip
        assert by[name].error is None, (name, by[name].error, (work / "bench.log").read_text())
        assert len(by[name].samples) == 2, name
    assert by["umoci_unpack"].cmd[:3] == ["umoci", "unpack", "--image"]
    assert by["mkfs_btrfs_umoci"].cmd[-2].endswith("umoci-bundle/rootfs")
    for name in ("ours_oci", "mkfs_btrfs_umoci"):  # each output holds the whole content
        assert (by[name].output_bytes or 0) >= data.stats.content_bytes, name
    assert by[UMOCI_BASELINE].steps == ["umoci_unpack", "mkfs_btrfs_umoci"]
    table = build_table(results, data.stats.content_bytes, data.stats.entries)
    assert "umoci + mkfs.btrfs / this" in table and table.count("\n") == 2 + len(results)
    # nothing left behind: scratch (outputs, umoci's bundle, the tree), the reflink btrfs
    assert sorted(p.name for p in work.iterdir()) == ["bench.log"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (drop caches)")
def test_an_input_without_a_layout_skips_the_oci_rows(tmp_path: Path) -> None:
    data = inputs.ensure_inputs(tmp_path, TINY)
    bi = BuildInput("debian", "no layout", data.tar, None, "", data.stats, 1, {})
    work = tmp_path / "work"
    work.mkdir()
    results, skipped = run_build(bi, work, peers=False)
    for name in ("ours_oci", "umoci_unpack", "mkfs_btrfs_umoci"):
        assert skipped[name] == "no OCI layout of this input"
    assert {r.name for r in results} >= {"ours", "tar_x", "mkfs_btrfs", TAR_BASELINE}
    assert UMOCI_BASELINE not in {r.name for r in results}
    assert all(r.ok for r in results)
