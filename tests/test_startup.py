"""What a build loads at start: every module costs time at each command, more with a cold
page cache (the benchmarks drop it before each build)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# loaded only where needed: zstandard (an 11 MiB library) for zstd layers and compressed
# packs, the prefetch trace writer for specs with prefetch globs, crc32c's package
# __init__ never (crc.py loads its C module alone); importlib.metadata only with pydantic,
# which imports it to look for plugins
NOT_AT_START = ("zstandard", "crc32c", "btrfs_ublk_image.trace")
# what reading a spec costs (pydantic and the models: ~80 ms of CPU, docs/sources.md):
# commands that read no spec never load it
SPEC_ONLY = ("pydantic", "pydantic_core", "btrfs_ublk_image.spec", "importlib.metadata")
# the program building examples/hello (add "-o", OUT)
BUILD_HELLO = [
    sys.executable,
    "-m",
    "btrfs_ublk_image",
    "build",
    str(ROOT / "examples/hello/spec.yaml"),
]


@pytest.mark.unit
def test_build_path_imports_stay_lean() -> None:
    code = (
        "import json, sys\n"
        "import btrfs_ublk_image.cli, btrfs_ublk_image.sources, btrfs_ublk_image.spec\n"
        "from btrfs_ublk_image.crc import crc32c\n"
        "assert crc32c(b'123456789') == 0xE3069283\n"  # the CRC-32C check value
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "crc32c._crc32c" in loaded
    assert sorted(m for m in NOT_AT_START if m in loaded) == []


@pytest.mark.unit
def test_commands_that_read_no_spec_never_import_pydantic(tmp_path: Path) -> None:
    bundle = tmp_path / "hello.bundle"
    subprocess.run(
        [sys.executable, "-m", "btrfs_ublk_image", "build", str(ROOT / "examples/hello/spec.yaml")]
        + ["-o", str(bundle)],
        check=True,
        capture_output=True,
    )
    code = (
        "import json, sys, contextlib, io\n"
        "from btrfs_ublk_image.cli import main\n"
        "import btrfs_ublk_image.push, btrfs_ublk_image.registry, btrfs_ublk_image.listing\n"
        "for argv in sys.argv[1:]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(json.loads(argv)) == 0, argv\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    commands = [["inspect", str(bundle)], ["ls", "-R", str(bundle), "/"], ["manifest", str(bundle)]]
    out = subprocess.run(
        [sys.executable, "-c", code, *map(json.dumps, commands)],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(json.loads(out.stdout))
    assert "btrfs_ublk_image.reader" in loaded  # the commands ran
    assert sorted(m for m in SPEC_ONLY if m in loaded) == []
    # and the one that reads a spec does load it: the check above can fail
    code = (
        "import json, sys\n"
        "from btrfs_ublk_image.spec import load_spec\n"
        "load_spec(sys.argv[1])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    spec = str(ROOT / "examples/hello/spec.yaml")
    out = subprocess.run(
        [sys.executable, "-c", code, spec], capture_output=True, text=True, check=True
    )
    assert {"pydantic", "btrfs_ublk_image.spec"} <= set(json.loads(out.stdout))


@pytest.mark.unit
def test_build_program_prints_and_exits_with_the_command_status(tmp_path: Path) -> None:
    # the program's output and exit status, as a user's shell sees them
    cmd = BUILD_HELLO
    out = tmp_path / "hello.bundle"
    ok = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{out}: sha256:") and ok.stdout.endswith("\n")
    again = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, check=False)
    assert again.returncode == 1
    assert (
        again.stderr
        == f"btrfs-ublk-image: error: {out}: already exists (a bundle is never overwritten; remove it first)\n"
    )
