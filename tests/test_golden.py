"""Golden images: every spec in specs/golden/*/ is built and must give exactly its committed
listing (expected.listing) and image id (expected-id).

A deliberate change (writer, sources, builder version) changes them: review the printed
diff, then rewrite the expected files with

    BUI_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py

and commit them with the change that caused them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from btrfs_ublk_image import listing
from btrfs_ublk_image.bundle import read_manifest
from btrfs_ublk_image.cli import main as cli

from bundletools import dmesg_btrfs_problems, dmesg_len, mounted_bundle, run

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
    assert cli(["build", str(spec), "-o", str(out)]) == 0
    _, image_id = read_manifest(str(out))
    return listing.format_listing(listing.from_bundle(str(out))), image_id


def check_against_expected(name: str, text: str, image_id: str) -> None:
    d = GOLDEN / name
    if UPDATE:
        (d / "expected.listing").write_text(text)
        (d / "expected-id").write_text(image_id + "\n")
        return
    assert (d / "expected.listing").exists(), f"{d}/expected.listing missing (BUI_UPDATE_GOLDEN=1)"
    want = listing.parse_listing((d / "expected.listing").read_text(), str(d / "expected.listing"))
    changes = listing.diff(want, listing.parse_listing(text, "built"))
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
