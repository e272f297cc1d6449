"""Listings and the ls / manifest / diff commands (format: docs/listing-format.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from btrfs_ublk_image import listing
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import ImageError

BIG = "".join(f"line {i:06d} of a file that lives in a pack\n" for i in range(8000))


def spec_text(name: str, motd: str, tool_mode: str, big: str, removed: bool) -> str:
    files: list[dict[str, object]] = [
        {"path": "/etc/motd", "content": motd},
        {"path": "/bin/tool", "content": "#!/bin/sh\necho tool\n", "mode": tool_mode},
        {"path": "/usr/share/big.txt", "content": big},
        {"path": "/bin/sh", "symlink": "busybox"},
        {"path": "/var/empty", "directory": True, "mode": "0700", "uid": 7},
    ]
    if removed:
        files.append({"path": "/etc/removed", "content": "bye\n"})
    # JSON is YAML: no quoting questions for the generated content
    return json.dumps(
        {"version": 1, "name": name, "source_date_epoch": 1700000000, "layers": [{"files": files}]}
    )


def build(tmp: Path, name: str, **kw: object) -> Path:
    args = {"motd": "hello\n", "tool_mode": "0755", "big": BIG, "removed": True, **kw}
    spec = tmp / f"{name}.yaml"
    spec.write_text(spec_text(name, **args))  # type: ignore[arg-type]
    assert cli(["build", str(spec), "-o", str(tmp / name)]) == 0
    return tmp / name


def sha_of(entries: list[listing.Entry], path: bytes) -> str:
    (sha,) = [e.sha256 for e in entries if e.path == path]
    assert sha is not None
    return sha


@pytest.mark.unit
def test_diff_catches_byte_mode_and_removal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = build(tmp_path, "a")
    big = BIG[:150_000] + "X" + BIG[150_001:]  # one byte, in a file stored in the pack
    b = build(tmp_path, "b", motd="hellp\n", tool_mode="0700", big=big, removed=False)
    la, lb = listing.from_bundle(str(a)), listing.from_bundle(str(b))
    got = listing.diff(la, lb)
    assert got == [
        "~ /bin/tool mode: 0755 -> 0700",
        f"~ /etc/motd sha256: {sha_of(la, b'/etc/motd')} -> {sha_of(lb, b'/etc/motd')}",
        "- /etc/removed",
        f"~ /usr/share/big.txt sha256: {sha_of(la, b'/usr/share/big.txt')}"
        f" -> {sha_of(lb, b'/usr/share/big.txt')}",
    ]
    capsys.readouterr()
    assert cli(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == got
    assert "4 difference(s)" in out.err


@pytest.mark.unit
def test_diff_is_sorted_and_clean_when_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = build(tmp_path, "a")
    a2 = build(tmp_path, "a2")  # another name: another image id, the same content
    assert cli(["diff", str(a), str(a2)]) == 0
    b = build(tmp_path, "b", motd="hellp\n", tool_mode="0700", removed=False)
    capsys.readouterr()
    assert cli(["diff", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "~ /bin/tool mode",
        "~ /etc/motd sha256",
        "- /etc/removed",
    ]
    assert cli(["diff", str(b), str(a)]) == 1
    assert "+ /etc/removed" in capsys.readouterr().out


@pytest.mark.unit
def test_manifest_and_listing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = build(tmp_path, "a")
    out = tmp_path / "a.listing"
    assert cli(["manifest", str(a), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.splitlines()[0] == "#btrfs-ublk-image listing 1"
    assert text.splitlines()[1] == "/ type=dir mode=0755 uid=0 gid=0 mtime=1700000000000000000"
    assert (
        "/bin/sh type=symlink mode=0777 uid=0 gid=0 mtime=1700000000000000000 target=busybox"
        in text
    )
    assert "/var/empty type=dir mode=0700 uid=7 gid=0 mtime=1700000000000000000" in text
    # a listing file compares equal to its bundle; an edited one does not
    assert cli(["diff", str(a), str(out)]) == 0
    assert cli(["diff", str(out), str(a)]) == 0
    out.write_text(
        text.replace("/etc/removed type=file mode=0644", "/etc/removed type=file mode=0640")
    )
    capsys.readouterr()
    assert cli(["diff", str(out), str(a)]) == 1
    assert capsys.readouterr().out == "~ /etc/removed mode: 0640 -> 0644\n"
    # manifest of a listing prints it back unchanged
    out.write_text(text)
    assert cli(["manifest", str(out)]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.unit
def test_diff_trouble_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.listing"
    bad.write_text("/ type=dir\n")
    assert cli(["diff", str(bad), str(bad)]) == 2
    assert "not a listing" in capsys.readouterr().err
    assert cli(["diff", str(tmp_path / "missing"), str(bad)]) == 2


@pytest.mark.unit
def test_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = build(tmp_path, "a")
    capsys.readouterr()
    assert cli(["ls", str(a)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines] == ["bin", "etc", "usr", "var"]
    assert lines[0].startswith("drwxr-xr-x 1 0 0 ")
    assert cli(["ls", str(a), "/bin"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" 2023-11-14 22:13:20.000000000 sh -> busybox")
    assert lines[1].startswith("-rwxr-xr-x 1 0 0 20 2023-11-14 22:13:20.000000000 tool")
    assert cli(["ls", str(a), "/usr/share/big.txt"]) == 0
    assert capsys.readouterr().out.split()[4] == str(len(BIG))
    assert cli(["ls", "-R", str(a), "/var"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "/var:",
        "drwx------ 1 7 0 0 2023-11-14 22:13:20.000000000 empty",
        "",
        "/var/empty:",
    ]
    assert cli(["ls", str(a), "/nope"]) == 1
    assert "/nope: no such file or directory" in capsys.readouterr().err


@pytest.mark.unit
@given(st.binary(min_size=1, max_size=64))
def test_escape_round_trip(raw: bytes) -> None:
    text = listing.escape(raw)
    assert text.isascii() and " " not in text and "=" not in text and "\n" not in text
    assert listing.unescape(text) == raw


@pytest.mark.unit
def test_parse_errors() -> None:
    head = listing.HEADER + "\n"
    with pytest.raises(ImageError, match=r"x:2: unknown field 'colour'"):
        listing.parse_listing(head + "/ type=dir mode=0755 uid=0 gid=0 mtime=0 colour=red\n", "x")
    with pytest.raises(ImageError, match=r"x:2: field 'mtime' missing"):
        listing.parse_listing(head + "/ type=dir mode=0755 uid=0 gid=0\n", "x")
    with pytest.raises(ImageError, match=r"x:3: / listed twice"):
        line = "/ type=dir mode=0755 uid=0 gid=0 mtime=0\n"
        listing.parse_listing(head + line + line, "x")
    with pytest.raises(ImageError, match=r"x:2: bad escape"):
        listing.parse_listing(head + "/a\\9 type=fifo mode=0755 uid=0 gid=0 mtime=0\n", "x")
