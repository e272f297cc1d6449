"""What a build loads at start: every module costs time at each command, more with a cold
page cache (the benchmarks drop it before each build)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# loaded only where needed: importlib.metadata (via the crc32c package's __init__, ~45
# modules) never, zstandard (an 11 MiB library) for zstd layers and compressed packs, the
# prefetch trace writer for specs with prefetch globs
NOT_AT_START = ("importlib.metadata", "email", "zstandard", "crc32c", "btrfs_ublk_image.trace")


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
