"""Spec v1: loading, defaults, errors that name file, line and field; the JSON schema."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from btrfs_ublk_image.errors import SpecError
from btrfs_ublk_image.spec import (
    FilesLayer,
    Spec,
    TarLayer,
    json_schema,
    json_schema_text,
    load_spec,
    parse_mode,
    parse_spec,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

FULL = """\
version: 1
name: web-base
btrfs:
  inline_limit: 1024
  fsid: 2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab
  label: "web"
source_date_epoch: 1700000000
layers:
  - tar: {path: rootfs.tar.zst}
  - files:
      - {path: /etc/motd, content: "hello\\n", mode: "0644", uid: 0, gid: 0, mtime: 0}
      - {path: /usr/bin/vi, symlink: /usr/bin/vim.tiny}
      - {path: /srv/data, directory: true, mode: "0755"}
      - {path: /usr/bin/su, content: "", mode: "4755"}
      - {path: /tmp, directory: true, mode: 01777}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return p


def test_full_spec_loads(tmp_path: Path) -> None:
    p = write(tmp_path, FULL)
    spec = load_spec(p)
    assert spec.version == 1
    assert spec.name == "web-base"
    assert spec.btrfs.inline_limit == 1024
    assert spec.btrfs.fsid == uuid.UUID("2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab")
    assert spec.btrfs.label == "web"
    assert spec.source_date_epoch == 1700000000
    assert isinstance(spec.layers[0], TarLayer)
    assert spec.layers[0].tar.path == "rootfs.tar.zst"
    files = spec.layers[1]
    assert isinstance(files, FilesLayer)
    motd, vi, data, su, tmp = files.files
    assert (motd.kind, motd.content, motd.mode, motd.mtime) == ("file", "hello\n", 0o644, 0)
    assert (vi.kind, vi.symlink, vi.mode) == ("symlink", "/usr/bin/vim.tiny", None)
    assert (data.kind, data.mode) == ("directory", 0o755)
    assert su.mode == 0o4755
    assert tmp.mode == 0o1777  # YAML 1.1 reads an unquoted 01777 as octal
    assert spec.spec_sha256 == "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()


def test_minimal_spec_defaults(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "version: 1\nname: x\nlayers: []\n"))
    assert spec.btrfs.inline_limit == 2048
    assert spec.btrfs.fsid is None
    assert spec.btrfs.label == ""
    assert spec.source_date_epoch is None
    assert spec.layers == []


def test_spec_sha256_without_file() -> None:
    a = parse_spec("version: 1\nname: x\nlayers: []\n")
    b = parse_spec("{version: 1, name: x, layers: []}")
    assert a.spec_sha256 == b.spec_sha256
    assert a.spec_sha256.startswith("sha256:")


@pytest.mark.parametrize(
    ("value", "mode"),
    [("0644", 0o644), ("644", 0o644), ("4755", 0o4755), ("0o755", 0o755), (0o7777, 0o7777), (0, 0)],
)
def test_parse_mode(value: object, mode: int) -> None:
    assert parse_mode(value) == mode


@pytest.mark.parametrize("value", ["rwx", "0999", "17777", "", "-1", -1, 0o10000, True, 1.5])
def test_parse_mode_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="mode"):
        parse_mode(value)


BASE = "version: 1\nname: x\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            BASE + "layers:\n  - files:\n      - {path: /a, content: x}\n"
            "      - path: /b\n        content: y\n        mode: rwx\n",
            "spec.yaml:8: layers[0].files[1].mode: invalid octal mode 'rwx'",
        ),
        (
            BASE
            + "layers:\n  - tar: {path: a.tar}\n  - files:\n      - {path: /a, content: x, mode: rwx}\n",
            "spec.yaml:6: layers[1].files[0].mode: invalid octal mode 'rwx'",
        ),
        (BASE + "layers: []\ncolour: red\n", "spec.yaml:4: colour: unknown key"),
        ("version: 1\nlayers: []\n", "spec.yaml:1: name: missing required key"),
        ("version: 2\nname: x\nlayers: []\n", "spec.yaml:1: version: Input should be 1"),
        (BASE, "spec.yaml:1: layers: missing required key"),
        (
            BASE + "layers:\n  - zip: {path: a.zip}\n",
            "spec.yaml:4: layers[0]: unknown layer kind 'zip': expected one of tar, oci, dir, files",
        ),
        (
            BASE + "layers:\n  - tar: {path: a.tar}\n    files: []\n",
            "spec.yaml:4: layers[0]: a layer is a mapping with exactly one key",
        ),
        (BASE + "layers:\n  - a.tar\n", "spec.yaml:4: layers[0]: a layer is a mapping like"),
        (BASE + "layers:\n  - tar: {}\n", "spec.yaml:4: layers[0].tar.path: missing required key"),
        (
            BASE + "layers:\n  - tar:\n      path: a.tar\n      strip: 1\n",
            "spec.yaml:6: layers[0].tar.strip: unknown key",
        ),
        (
            BASE + "layers:\n  - tar: {path: 7}\n",
            "spec.yaml:4: layers[0].tar.path: Input should be",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a, content: x, symlink: /b}\n",
            (
                "spec.yaml:5: layers[0].files[0]: an entry needs exactly one of content, symlink,"
                " directory: true (got: content, symlink)"
            ),
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a}\n",
            "spec.yaml:5: layers[0].files[0]: an entry needs exactly one of",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /, content: x}\n",
            "spec.yaml:5: layers[0].files[0]: only a directory entry can describe the image root",
        ),
        (
            BASE + 'layers:\n  - files:\n    - {path: "/a\\0b", content: x}\n',
            "spec.yaml:5: layers[0].files[0].path: path contains a NUL byte",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a, content: x, uid: -1}\n",
            "spec.yaml:5: layers[0].files[0].uid: Input should be greater than or equal to 0",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a, directory: yes please}\n",
            "spec.yaml:5: layers[0].files[0].directory: Input should be a valid boolean",
        ),
        (
            BASE + "btrfs:\n  inline_limit: 4096\nlayers: []\n",
            "spec.yaml:4: btrfs.inline_limit: Input should be less than or equal to 4095",
        ),
        (
            BASE + "btrfs: {fsid: not-a-uuid}\nlayers: []\n",
            "spec.yaml:3: btrfs.fsid: Input should be a valid UUID",
        ),
        (
            BASE + f"btrfs: {{label: {'é' * 128}}}\nlayers: []\n",
            "spec.yaml:3: btrfs.label: label is 256 bytes long, at most 255 allowed",
        ),
        (
            BASE + "source_date_epoch: -5\nlayers: []\n",
            "spec.yaml:3: source_date_epoch: Input should be greater than or equal to 0",
        ),
        ("version: 1\nname: 'a b'\nlayers: []\n", "spec.yaml:2: name: String should match pattern"),
        (
            'version: 1\nname: "a\\n"\nlayers: []\n',
            "spec.yaml:2: name: String should match pattern",
        ),
        ("version: true\nname: x\nlayers: []\n", "spec.yaml:1: version: Input should be 1"),
        ("version: 1.0\nname: x\nlayers: []\n", "spec.yaml:1: version: Input should be 1"),
        (BASE + "layers: !!set {a: null}\n", "spec.yaml:3: layers: Input should be a valid list"),
        (
            "version: 1\nname: 2024-01-01\nlayers: []\n",
            "spec.yaml:2: name: Input should be a valid string",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a, content: x, mtime: 1.5}\n",
            "spec.yaml:5: layers[0].files[0].mtime: Input should be a valid integer",
        ),
        (
            BASE + "layers:\n  - files:\n    - {path: /a, content: x, uid: true}\n",
            "spec.yaml:5: layers[0].files[0].uid: Input should be a valid integer",
        ),
        (
            BASE + "layers:\n  - tar: {path: a, exclude: ['[']}\n",
            "spec.yaml:4: layers[0].tar.exclude[0]: unterminated character class in '['",
        ),
        (BASE + "layers:\n  - tar: 5\n", "spec.yaml:4: layers[0].tar: Input should be a mapping"),
        (
            BASE + "layers: []\npack_compression: gzip\n",
            "spec.yaml:4: pack_compression: Input should be 'none', 'zstd' or 'btrfs-zstd'",
        ),
        (BASE + "layers: []\n1: x\n", "spec.yaml:4: 1: unknown key"),
        (
            BASE + "btrfs: {fsid: 5}\nlayers: []\n",
            "spec.yaml:3: btrfs.fsid: Input should be a valid UUID string",
        ),
        (
            BASE + "btrfs: {fsid: !!binary MDEyMzQ1Njc4OWFiY2RlZg==}\nlayers: []\n",
            "spec.yaml:3: btrfs.fsid: Input should be a valid UUID string",
        ),
        (
            BASE + "btrfs: {fsid: '+b9f7c8e1d2a4c3b9e8f0123456789ab'}\nlayers: []\n",
            "spec.yaml:3: btrfs.fsid: Input should be a valid UUID, invalid character: found `+` at 0",
        ),
        # YAML-level problems
        (BASE + "layers: [\n", "spec.yaml:4: invalid YAML"),
        (BASE + "layers:\n  - tar: {path: a}\n   bad: indent\n", "spec.yaml:5: invalid YAML"),
        (BASE + "name: y\nlayers: []\n", "spec.yaml:3: duplicate key 'name'"),
        ("", "spec.yaml:1: the spec is empty"),
        ("- 1\n- 2\n", "spec.yaml:1: the spec must be a mapping"),
    ],
)
def test_spec_errors(tmp_path: Path, text: str, expected: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value).replace(str(p), "spec.yaml")
    assert expected in msg, msg
    for line in msg.splitlines():
        assert line.startswith("spec.yaml:"), msg


@pytest.mark.parametrize(
    "fsid",
    [
        "2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab",
        "{2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab}",
        "urn:uuid:2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab",
        "2B9F7C8E1D2A4C3B9E8F0123456789AB",
    ],
)
def test_fsid_forms(fsid: str) -> None:
    spec = parse_spec(BASE + f"btrfs: {{fsid: '{fsid}'}}\nlayers: []\n")
    assert spec.btrfs.fsid == uuid.UUID("2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab")
    assert spec.to_json()["btrfs"]["fsid"] == "2b9f7c8e-1d2a-4c3b-9e8f-0123456789ab"


def test_error_text_names_file_line_and_field(tmp_path: Path) -> None:
    text = (
        "version: 1\n"
        "name: web-base\n"
        "layers:\n"
        "  - tar: {path: rootfs.tar.zst}\n"
        "  - files:\n"
        "      - path: /etc/motd\n"
        "        mode: rwx\n"
        "        content: hi\n"
    )
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    assert str(info.value) == f"{p}:7: layers[1].files[0].mode: invalid octal mode 'rwx'"


def test_every_error_is_reported(tmp_path: Path) -> None:
    text = BASE + "colour: red\nlayers:\n  - files:\n    - {path: /a, content: x, mode: 99999}\n"
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(":3: colour: unknown key")
    assert ":6: layers[0].files[0].mode: " in lines[1]


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="nope.yaml: cannot read spec"):
        load_spec(tmp_path / "nope.yaml")


def test_models_are_frozen(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, FULL))
    with pytest.raises(ValidationError, match="frozen"):
        setattr(spec, "name", "other")  # noqa: B010 - the point is the runtime check
    with pytest.raises(ValidationError, match="frozen"):
        setattr(spec.layers[0].tar, "path", "other")  # type: ignore[union-attr]  # noqa: B010


def test_schema_describes_layers() -> None:
    schema = json_schema()
    assert schema["properties"]["version"]["const"] == 1
    items = schema["properties"]["layers"]["items"]["oneOf"]
    assert {i["$ref"] for i in items} == {
        "#/$defs/TarLayer",
        "#/$defs/OciLayer",
        "#/$defs/DirLayer",
        "#/$defs/FilesLayer",
    }
    assert schema["$defs"]["FileEntry"]["additionalProperties"] is False
    mode = schema["$defs"]["FileEntry"]["properties"]["mode"]
    assert "pattern" in json.dumps(mode)


def test_schema_file_is_up_to_date() -> None:
    committed = (ROOT / "specs" / "schema.json").read_text()
    assert committed == json_schema_text(), (
        "specs/schema.json is stale: python -m btrfs_ublk_image.spec > specs/schema.json"
    )


def test_spec_round_trips_through_json(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, FULL))
    data = spec.to_json()
    again = parse_spec(json.dumps(data))
    assert again.model_dump() == spec.model_dump()  # == would also compare the file's sha256
    assert again.to_json() == data
    assert isinstance(again, Spec) and again.btrfs.fsid == spec.btrfs.fsid


def test_pack_chunk_size(tmp_path: Path) -> None:
    from btrfs_ublk_image import packs, spec

    assert spec.DEFAULT_CHUNK_SIZE == packs.DEFAULT_CHUNK_SIZE
    p = tmp_path / "spec.yaml"
    p.write_text("version: 1\nname: x\npack_chunk_size: 262144\nlayers: []\n")
    assert load_spec(p).pack_chunk_size == 262144
    for bad in ("100000", "32768", "33554432", "true"):
        p.write_text(f"version: 1\nname: x\npack_chunk_size: {bad}\nlayers: []\n")
        with pytest.raises(SpecError, match=r"spec.yaml:3: pack_chunk_size"):
            load_spec(p)
