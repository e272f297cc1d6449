"""What a build loads at start: every module costs time at each command, more with a cold
page cache (the benchmarks drop it before each build)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from btrfs_ublk_image import readahead

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


def _resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache, as util-linux's fincore counts them."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


@pytest.mark.unit
def test_readahead_reads_the_inputs_the_spec_names(tmp_path: Path) -> None:
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux-extra) is not installed")
    size = 4 << 20
    tar = tmp_path / "rootfs.tar"
    tar.write_bytes(os.urandom(size))
    layout = tmp_path / "oci"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    wanted = _blob(layout, os.urandom(size))
    other = _blob(layout, os.urandom(size))  # another image's layer: not read
    manifests = []
    for ref, layer in (("bookworm", wanted), ("other", other)):
        m = _blob(layout, json.dumps({"schemaVersion": 2, "layers": [layer]}).encode())
        manifests.append({**m, "annotations": {"org.opencontainers.image.ref.name": ref}})
    (layout / "index.json").write_text(json.dumps({"manifests": manifests}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "version: 1\nname: t\nlayers:\n  - tar: {path: rootfs.tar}\n"
        "  - oci: {path: oci, ref: bookworm}\n  - tar: {path: missing.tar}\n"
    )
    blobs = layout / "blobs" / "sha256"
    paths = [tar, blobs / str(wanted["digest"])[7:], blobs / str(other["digest"])[7:]]
    for p in paths:
        _evict(p)
    if any(_resident_bytes(p) for p in paths):
        pytest.skip("this filesystem keeps evicted pages (tmpfs?): nothing to measure")
    for t in readahead.start(str(spec)):
        t.join(30)
    assert [_resident_bytes(p) for p in paths] == [size, size, 0]


@pytest.mark.unit
def test_readahead_skips_what_it_cannot_read(tmp_path: Path) -> None:
    # advisory: a spec the build will reject, or inputs that are missing, start nothing
    for text in ("layers: [", "- a list", "version: 1\nlayers:\n  - tar: {path: 3}\n"):
        spec = tmp_path / "spec.yaml"
        spec.write_text(text)
        assert readahead._inputs_or_none(str(spec)) is None
    assert readahead._inputs_or_none(str(tmp_path / "missing.yaml")) is None
    (tmp_path / "oci").mkdir()
    (tmp_path / "oci" / "index.json").write_text("{not json")
    spec.write_text("layers:\n  - oci: {path: oci}\n  - tar: {path: gone.tar}\n")
    # the broken layout is skipped; the tarball's path is still named (read: not found)
    assert readahead._inputs_or_none(str(spec)) == [str(tmp_path / "gone.tar")]
    for t in readahead.start(str(spec)):
        t.join(30)


@pytest.mark.unit
def test_build_program_prints_and_exits_with_the_command_status(tmp_path: Path) -> None:
    # cli.run ends the process without the interpreter's teardown: the output must still
    # be all there and the status the command's
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


@pytest.mark.unit
def test_readahead_remembers_the_module_files_of_a_build(tmp_path: Path) -> None:
    # after a build, the files of the modules it loaded are listed for the next build's
    # start, which reads those it has not loaded yet (pydantic's among them)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = BUILD_HELLO
    subprocess.run([*cmd, "-o", str(tmp_path / "a")], env=env, check=True, capture_output=True)
    listed = tmp_path / "cache" / readahead.CACHE_FILE
    lines = listed.read_text().splitlines()
    names = [line.split(" ", 1)[0] for line in lines]
    for name in ("pydantic_core._pydantic_core", "btrfs_ublk_image.spec", "yaml"):
        assert name in names
    # the program builds its models without pydantic's plugin lookup (cli.run)
    assert "importlib.metadata" not in names and "pydantic.plugin._loader" not in names
    assert all(os.path.isfile(line.split(" ", 1)[1]) for line in lines)
    # the same build again: the list is the same and is not written again
    before = listed.stat().st_mtime_ns
    subprocess.run([*cmd, "-o", str(tmp_path / "b")], env=env, check=True, capture_output=True)
    assert listed.stat().st_mtime_ns == before and listed.read_text().splitlines() == lines
    code = (
        "import json, sys\n"
        "from btrfs_ublk_image import readahead\n"
        "print(json.dumps(readahead._module_files()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    wanted = json.loads(out.stdout)
    spec_file = next(
        line.split(" ", 1)[1] for line in lines if line.startswith("btrfs_ublk_image.spec ")
    )
    assert spec_file in wanted  # not loaded yet by that process: read ahead
    assert not any("/readahead." in f for f in wanted)  # loaded already: left alone


@pytest.mark.unit
def test_the_pydantic_plugin_loader_the_program_replaces_is_what_pydantic_calls() -> None:
    # cli._without_pydantic_plugins stands in for pydantic.plugin._loader (pydantic is
    # pinned): pydantic must still call its get_plugins() and take () as "none"
    code = (
        "import sys\n"
        "from btrfs_ublk_image import cli\n"
        "cli._without_pydantic_plugins()\n"
        "from btrfs_ublk_image.spec import load_spec\n"
        "load_spec(sys.argv[1])\n"
        "assert 'importlib.metadata' not in sys.modules\n"
        "import pydantic.plugin._schema_validator as v, inspect\n"
        "assert 'get_plugins()' in inspect.getsource(v.create_schema_validator)\n"
    )
    spec = str(ROOT / "examples/hello/spec.yaml")
    subprocess.run([sys.executable, "-c", code, spec], check=True)
    from pydantic.plugin import _loader

    assert list(_loader.get_plugins()) == []  # the real one finds none here either
