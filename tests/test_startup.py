"""What a build loads at start: every module costs time at each command, more with a cold
page cache (the benchmarks drop it before each build)."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

from btrfs_ublk_image.cli import parser

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


# what a build's early read (early.py: its first tar layer read from start-up on) imports
# before it starts, it delays: the other sources, the blockmap, btrfs-zstd's extent encoder
# and the Python reader's gzip inflater come later, with the build's writer; dataclasses
# (and inspect, which it imports) with pydantic: these modules' records are NamedTuples
NOT_BEFORE_EARLY_READ = (
    "dataclasses",
    "inspect",
    "btrfs_ublk_image.blockmap",
    "btrfs_ublk_image.btrfs.encoded",
    "btrfs_ublk_image.sources.dir",
    "btrfs_ublk_image.sources.files",
    "btrfs_ublk_image.sources.gunzip",
    "isal",
    *SPEC_ONLY,
)


@pytest.mark.unit
def test_the_early_read_starts_without_what_it_does_not_use() -> None:
    code = (
        "import json, sys\n"
        "import btrfs_ublk_image.cli, btrfs_ublk_image.early\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "btrfs_ublk_image.sources.tar" in loaded
    assert sorted(m for m in NOT_BEFORE_EARLY_READ if m in loaded) == []


BUILD_LINES = [
    ["build", "s.yaml"],
    ["build", "s.yaml", "-o", "o", "--progress", "--update-lock", "--base", "b"],
    ["build", "--plain-http", "--auth", "u:p", "s.yaml"],
]


@pytest.mark.unit
def test_a_build_parses_with_its_own_parser_as_with_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in BUILD_LINES:
        assert vars(parser("build").parse_args(argv)) == vars(parser().parse_args(argv))
    for argv in (["build", "--help"], ["build"], ["build", "s.yaml", "--bogus"], ["build", "-o"]):
        seen = []
        for p in (parser("build"), parser()):
            with pytest.raises(SystemExit) as exit:
                p.parse_args(argv)
            seen.append((exit.value.code, capsys.readouterr()))
        assert seen[0] == seen[1], argv
    assert "inspect" not in parser("build").format_help()  # it is a parser of build alone
    assert "inspect" in parser().format_help()


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


# the program (cli.run) with an atexit handler and an object whose __del__ only the
# interpreter's teardown calls; it counts the cyclic collector's runs from run()'s start
# (gc.get_stats: a gc.callbacks entry would keep the module alive past the teardown)
RUN_PROGRAM = (
    "import atexit, gc, os, sys\n"
    "from btrfs_ublk_image.cli import run\n"
    "class Torn:\n"
    "    def __del__(self, write=os.write): write(1, b'torn down\\n')\n"
    "kept = Torn()\n"
    "def runs(): return sum(g['collections'] for g in gc.get_stats())\n"
    "before = runs()\n"
    "atexit.register(lambda: print(f'atexit ran, {runs() - before} collections', flush=True))\n"
    "sys.argv = ['btrfs-ublk-image', *sys.argv[1:]]\n"
    "run()\n"
)


@pytest.mark.unit
def test_the_program_ends_a_build_without_teardown_and_other_commands_with_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "hello.bundle"
    spec = str(ROOT / "examples/hello/spec.yaml")
    build = subprocess.run(
        [sys.executable, "-c", RUN_PROGRAM, "build", spec, "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    lines = build.stdout.splitlines()
    # reported, atexit handlers run, the collector off from the start, no teardown
    assert lines[0].startswith(f"{out}: sha256:") and lines[1:] == ["atexit ran, 0 collections"]
    assert not [p.name for p in tmp_path.iterdir() if p.name != "hello.bundle"]  # no leftovers
    failed = subprocess.run(
        [sys.executable, "-c", RUN_PROGRAM, "build", spec, "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert failed.returncode == 1 and "already exists" in failed.stderr
    assert failed.stdout.splitlines() == ["atexit ran, 0 collections"]
    inspect = subprocess.run(
        [sys.executable, "-c", RUN_PROGRAM, "inspect", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert inspect.returncode == 0, inspect.stderr
    # the ordinary exit: the teardown calls __del__ after the atexit handlers
    assert inspect.stdout.splitlines()[-2:-1][0].startswith("atexit ran")
    assert inspect.stdout.splitlines()[-1] == "torn down"


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


@pytest.mark.unit
def test_a_build_under_cprofile_ends_the_ordinary_way(tmp_path: Path) -> None:
    # bench/build.py's profile_ours: cProfile writes its file after the module returns
    prof = tmp_path / "build.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), *BUILD_HELLO[1:]]
    subprocess.run([*cmd, "-o", str(tmp_path / "hello.bundle")], check=True, capture_output=True)
    assert pstats.Stats(str(prof)).total_calls > 0  # type: ignore[attr-defined]
