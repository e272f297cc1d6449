"""The Rust crates build with the oldest cargo scripts/setup.sh accepts (Debian 12's
rustc-web): no locked dependency may need a newer Rust. This machine's rustup toolchain
is newer and would build them anyway, so only the lock files can show it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRATES = ("ublkd", "native")


def _version(text: str) -> tuple[int, int, int]:
    major, minor, patch = (text.split(".") + ["0", "0"])[:3]
    return int(major), int(minor), int(patch)


def setup_rust_min() -> tuple[int, int, int]:
    found = re.search(r"^RUST_MIN=([0-9.]+)$", (ROOT / "scripts/setup.sh").read_text(), re.M)
    assert found, "scripts/setup.sh sets no RUST_MIN"
    return _version(found.group(1))


@pytest.mark.unit
@pytest.mark.parametrize("crate", CRATES)
def test_locked_dependencies_build_with_the_rust_setup_accepts(crate: str) -> None:
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo/bin/cargo")
    # not --offline: a build fetches only the host platform's dependencies, metadata
    # reads every package the lock file names
    got = subprocess.run(
        [cargo, "metadata", "--format-version", "1", "--locked"],
        cwd=ROOT / crate,
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, f"{crate}: cargo metadata failed: {got.stderr}"
    meta = json.loads(got.stdout)
    rust_min = setup_rust_min()
    too_new = [
        f"{p['name']} {p['version']} needs rustc {p['rust_version']}"
        for p in meta["packages"]
        if p.get("rust_version") and _version(p["rust_version"]) > rust_min
    ]
    assert not too_new, (
        f"{crate}/Cargo.lock: {', '.join(too_new)} (setup.sh accepts rustc {'.'.join(map(str, rust_min))})"
    )
