"""The image spec (version 1): pydantic models, YAML loading with located errors, JSON schema.

A spec is a YAML mapping::

    version: 1
    name: web-base
    btrfs: {inline_limit: 2048, fsid: null, label: ""}   # optional
    source_date_epoch: null                               # optional
    remove: ["/usr/share/doc/**"]                         # optional
    prefetch: ["/usr/bin/*", "/etc/**"]                   # optional: prefetch.trace
    pack_chunk_size: 1048576                              # optional: fetch/verify unit
    pack_compression: none                                # optional: none | zstd | btrfs-zstd
    base: ../web-base-v1.bundle                           # optional: reuse its packs
    layers:
      - tar: {path: rootfs.tar.zst, exclude: ["/var/cache/**"], uid: 0, gid: 0}
      - oci: {path: ./debian-oci, ref: bookworm}
      - oci: {ref: registry.example/library/debian:12}      # pulled, pinned in spec.yaml.lock
      - dir: {path: ./overlay, dest: /srv}
      - files:
          - {path: /etc/motd, content: "hello\\n", mode: "0644"}
          - {path: /usr/bin/vi, symlink: /usr/bin/vim.tiny}
          - {path: /srv/data, directory: true}

The models are frozen pydantic v2 models in strict mode (no bool for an int, no int for
a string, no set for a list; unknown keys refused); ``json_schema`` is pydantic's
``model_json_schema`` of ``Spec``. Only commands that read a spec import this module:
pydantic's import and model building cost ~80-100 ms of CPU per command more than the
hand-written validator this replaced (docs/sources.md, "The spec: validation and its cost").

Every layer is a mapping with exactly ONE key naming its kind. ``Layer`` is a
discriminated union over that key: a new source kind is one new model plus one
entry in ``_LAYER_KINDS`` and in the ``Layer`` union.

``load_spec`` also applies the ``SOURCE_DATE_EPOCH`` environment variable when the
spec sets no ``source_date_epoch`` (docs/sources.md).

``load_spec`` turns every problem (YAML syntax, duplicate keys, validation) into
a ``SpecError`` whose lines read ``FILE:LINE: field.path: message``; the line
comes from the YAML node the failing field was read from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import WithJsonSchema

from btrfs_ublk_image.errors import ImageError, SpecError
from btrfs_ublk_image.specyaml import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from btrfs_ublk_image.specyaml import DEFAULT_INLINE_LIMIT as DEFAULT_INLINE_LIMIT
from btrfs_ublk_image.specyaml import MAX_CHUNK_SIZE as MAX_CHUNK_SIZE
from btrfs_ublk_image.specyaml import MAX_INLINE_LIMIT as MAX_INLINE_LIMIT
from btrfs_ublk_image.specyaml import MIN_CHUNK_SIZE as MIN_CHUNK_SIZE
from btrfs_ublk_image.specyaml import SpecYaml, compose, read_spec_yaml
from btrfs_ublk_image.specyaml import check_chunk_size as check_chunk_size

SPEC_VERSION = 1

_MODE_RE = re.compile(r"(?:0o|0)?([0-7]{1,4})")


def _no_globs() -> list[str]:
    # the glob lists' default: a function, not ``list``: pydantic reads a default factory's
    # signature, and a builtin's is parsed from text (the tokenizer's patterns compiled
    # first: ~3 ms of the spec's import)
    return []


def parse_mode(value: object) -> int:
    """A mode as an octal string ("0644", "4755", "0o755") or an int, permission bits only."""
    if isinstance(value, bool):
        raise ValueError(f"invalid octal mode {value!r}")  # noqa: TRY004 - pydantic wants ValueError
    if isinstance(value, int):
        if not 0 <= value <= 0o7777:
            raise ValueError(f"mode {value} (octal {value:o}) is outside 0..0o7777")
        return value
    if isinstance(value, str):
        m = _MODE_RE.fullmatch(value.strip())
        if m is None:
            raise ValueError(f"invalid octal mode {value!r}")
        return int(m.group(1), 8)
    raise ValueError(f"invalid octal mode {value!r}")


class _Model(BaseModel):
    # strict: YAML's bool is no int, its int no string, a !!set no list
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def to_json(self) -> dict[str, Any]:
        """The model as JSON data, every field included; ``parse_spec`` reads it back."""
        return self.model_dump(mode="json")


# ---- value types ------------------------------------------------------------------------

Mode = Annotated[
    int,
    BeforeValidator(parse_mode),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": "^(0o|0)?[0-7]{1,4}$"},
                {"type": "integer", "minimum": 0, "maximum": 0o7777},
            ],
            "description": 'Permission bits incl. setuid/setgid/sticky: an octal string ("0644",'
            ' "4755") or an integer (YAML reads an unquoted 0644 as octal)',
        }
    ),
]


def _check_image_path(value: str) -> str:
    raw = value.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise ValueError("path contains a NUL byte")
    for comp in raw.split(b"/"):
        if len(comp) > 255:
            raise ValueError(f"path component longer than 255 bytes: {comp[:40]!r}...")
    return value


ImagePath = Annotated[
    str,
    Field(min_length=1, description="Path inside the image; '..' never leaves the image root"),
    AfterValidator(_check_image_path),
]


def _check_glob(value: str) -> str:
    from btrfs_ublk_image.sources.globs import compile_glob

    compile_glob(value)  # raises ValueError with the reason
    return value


Glob = Annotated[
    str,
    Field(
        min_length=1,
        description="Image path pattern: '*' and '?' match within one component, '**' any"
        " number of components, '[...]' a character class",
    ),
    AfterValidator(_check_glob),
]

Owner = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]


def _uuid_string(value: object) -> object:
    # pydantic's lax UUID also takes 16 bytes (YAML's !!binary): a spec writes a string
    if not isinstance(value, str | uuid.UUID):
        raise ValueError("Input should be a valid UUID string")  # noqa: TRY004 - see parse_mode
    return value


# a string in a form pydantic's UUID parser reads (hyphens, braces, urn:uuid:, 32 hex)
FsUuid = Annotated[uuid.UUID, Field(strict=False), BeforeValidator(_uuid_string)]


def _check_label(value: str) -> str:
    raw = value.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"label is {len(raw)} bytes long, at most 255 allowed")
    if "\0" in value:
        raise ValueError("label contains a NUL character")
    return value


# ---- models -----------------------------------------------------------------------------


class _TreeOptions(_Model):
    """Options of sources that copy a file tree (``tar``, ``dir``)."""

    dest: ImagePath = Field(default="/", description="Directory of the image the tree goes into")
    include: list[Glob] | None = Field(
        default=None,
        description="Keep only entries whose image path (after dest/strip_components), or one"
        " of its parent directories, matches one of these globs",
    )
    exclude: list[Glob] = Field(
        default_factory=_no_globs,
        description="Drop entries whose image path, or one of its parent directories, matches"
        " one of these globs (applied after include)",
    )
    uid: Owner | None = Field(default=None, description="Owner override: every entry gets this uid")
    gid: Owner | None = Field(default=None, description="Owner override: every entry gets this gid")


class BtrfsOptions(_Model):
    """Options of the btrfs writer."""

    inline_limit: int = Field(
        default=DEFAULT_INLINE_LIMIT,
        ge=0,
        le=MAX_INLINE_LIMIT,
        description="Files up to this many bytes become inline extents; 0 disables inlining",
    )
    fsid: FsUuid | None = Field(
        default=None, description="Filesystem UUID; default: derived from the image content"
    )
    label: Annotated[str, AfterValidator(_check_label)] = Field(
        default="", description="Filesystem label, at most 255 bytes (UTF-8)"
    )


# ---- layers -----------------------------------------------------------------------------


class TarSource(_TreeOptions):
    """A tarball: plain, gzip, zstd, xz or bzip2 (detected from its first bytes)."""

    path: str = Field(min_length=1, description="The tarball, relative to the spec file")
    sha256: str | None = Field(
        default=None,
        pattern=r"^(sha256:)?[0-9a-f]{64}$",
        description="Expected sha256 of the tarball's bytes (as stored, compressed); a mismatch"
        " fails the build",
    )
    strip_components: int = Field(
        default=0,
        ge=0,
        description="Drop this many leading components from member names (and hard link"
        " targets); members with no name left are skipped",
    )
    in_place: bool = Field(
        default=False,
        description="Use the tarball itself as a pack of the bundle (uncompressed tarballs"
        " only): member data is referenced where it lies instead of copied. The bundle's"
        " copy of the tarball is a reflink where the filesystem supports it, else a full"
        " copy; its headers and small (inline) files stay in the pack unused",
    )


class TarLayer(_Model):
    tar: TarSource


class DirSource(_TreeOptions):
    """A local directory tree: its contents (not the directory itself) go under ``dest``."""

    path: str = Field(min_length=1, description="The directory, relative to the spec file")


class DirLayer(_Model):
    dir: DirSource


class OciSource(_Model):
    """An OCI image: a layout directory, an ``oci-archive`` or a ``docker-archive`` tarball
    (``path``), or an image in a registry (no ``path``; ``ref: REGISTRY/REPO:TAG`` or
    ``REGISTRY/REPO@sha256:HEX``), pulled through a digest-checked local cache and pinned
    in the spec's lock file (docs/sources.md)."""

    path: str | None = Field(
        default=None,
        min_length=1,
        description="OCI image layout directory, or an uncompressed oci-archive or"
        " docker-archive (docker save) tarball, relative to the spec file; leave it out to"
        " pull ``ref`` from a registry",
    )
    ref: str | None = Field(
        default=None,
        min_length=1,
        description="With path: the tag, the index's org.opencontainers.image.ref.name"
        " (docker-archive: a RepoTags entry, whole or the part after ':'); may be left out"
        " when the image holds one image. Without path: the registry image,"
        " REGISTRY[:PORT]/REPO[:TAG] or REGISTRY[:PORT]/REPO@sha256:HEX",
    )
    digest: str | None = Field(
        default=None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="Select (or, with ref, pin) by digest: of an image index or manifest;"
        " docker-archive: of the image config (the image id). Registry images: the manifest"
        " or index to pull (the tag is then only a name; the lock file is not consulted)",
    )
    platform: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?$",
        description="os/architecture[/variant] picked from an image index; default: the"
        " host's (linux/amd64 on x86_64)",
    )

    @model_validator(mode="after")
    def _path_or_registry_ref(self) -> OciSource:
        # Runs once every field is valid: reported at the entry's line.
        if self.path is not None:
            return self
        if self.ref is None:
            raise ValueError(
                "an oci source needs path (a local image) or ref (REGISTRY/REPO:TAG or"
                " REGISTRY/REPO@sha256:HEX, pulled from a registry)"
            )
        from btrfs_ublk_image.registry import parse_pull_reference  # registry sources only

        try:
            ref = parse_pull_reference(self.ref)
        except ImageError as e:
            raise ValueError(f"ref without path names a registry image: {e}") from None
        if ref.digest is not None and self.digest is not None and ref.digest != self.digest:
            raise ValueError(f"ref {self.ref} and digest {self.digest} name different images")
        return self


class OciLayer(_Model):
    oci: OciSource


class FileEntry(_Model):
    """One inline entry: exactly one of ``content``, ``symlink``, ``directory: true``."""

    path: ImagePath
    content: str | None = Field(default=None, description="Regular file content (UTF-8 text)")
    symlink: str | None = Field(default=None, min_length=1, description="Symlink target")
    directory: bool = Field(default=False, description="true: a directory")
    mode: Mode | None = Field(
        default=None, description="Default: 0644 files, 0755 dirs, 0777 symlinks"
    )
    uid: int = Field(default=0, ge=0, le=0xFFFFFFFF)
    gid: int = Field(default=0, ge=0, le=0xFFFFFFFF)
    mtime: int | None = Field(
        default=None, description="Seconds since the epoch; default: source_date_epoch, else 0"
    )

    @model_validator(mode="after")
    def _one_kind(self) -> FileEntry:
        # Runs once every field is valid: reported at the entry's line.
        kinds = [
            k
            for k, on in (
                ("content", self.content is not None),
                ("symlink", self.symlink is not None),
                ("directory", self.directory),
            )
            if on
        ]
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                f"an entry needs exactly one of content, symlink, directory: true (got: {got})"
            )
        if not self.directory and not self.path.strip("/").strip("."):
            raise ValueError("only a directory entry can describe the image root '/'")
        return self

    @property
    def kind(self) -> Literal["file", "symlink", "directory"]:
        if self.directory:
            return "directory"
        return "symlink" if self.symlink is not None else "file"


class FilesLayer(_Model):
    files: list[FileEntry]


# The layer kinds: the single key of a layer mapping -> its model.
_LAYER_KINDS: dict[str, type[_Model]] = {
    "tar": TarLayer,
    "oci": OciLayer,
    "dir": DirLayer,
    "files": FilesLayer,
}


def _layer_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        keys = list(value)
        return keys[0] if len(keys) == 1 and keys[0] in _LAYER_KINDS else None
    for kind, model in _LAYER_KINDS.items():
        if isinstance(value, model):
            return kind
    return None


def _check_layer_shape(value: Any) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        kinds = ", ".join(_LAYER_KINDS)
        if len(keys) != 1:
            raise ValueError(
                f"a layer is a mapping with exactly one key, one of: {kinds}"
                f" (got {len(keys)} keys: {', '.join(map(str, keys)) or 'none'})"
            )
        if keys[0] not in _LAYER_KINDS:
            raise ValueError(f"unknown layer kind {keys[0]!r}: expected one of {kinds}")
    elif not isinstance(value, _Model):
        raise ValueError(  # noqa: TRY004 - pydantic reports ValueError, not TypeError
            f"a layer is a mapping like '- tar: {{path: ...}}', got {value!r}"
        )
    return value


# A layer: a mapping whose single key (the one field of a member) names its kind.
Layer: TypeAlias = Annotated[
    Annotated[
        Annotated[TarLayer, Tag("tar")]
        | Annotated[OciLayer, Tag("oci")]
        | Annotated[DirLayer, Tag("dir")]
        | Annotated[FilesLayer, Tag("files")],
        Discriminator(_layer_kind),
    ],
    BeforeValidator(_check_layer_shape),
]


def _exact_int(value: object) -> object:
    # Literal[1] compares by ==, strict or not: it takes true and 1.0
    if type(value) is not int:
        raise ValueError("Input should be 1")
    return value


class Spec(_Model):
    """An image spec, version 1."""

    version: Annotated[Literal[1], BeforeValidator(_exact_int)] = Field(
        description="Spec format version"
    )
    name: str = Field(
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$",
        description="Image name (letters, digits, '.', '_', '+', '-')",
    )
    btrfs: BtrfsOptions = Field(default_factory=lambda: BtrfsOptions())
    source_date_epoch: int | None = Field(
        default=None,
        ge=0,
        description="Seconds since the epoch: no timestamp in the image is later (later ones"
        " are clamped to it); also the mtime of directories the builder creates and the"
        " default mtime of inline files. Default: the SOURCE_DATE_EPOCH environment variable",
    )
    layers: list[Layer] = Field(description="Applied in order; later layers win")
    remove: list[Glob] = Field(
        default_factory=_no_globs,
        description="Entries (with everything under them) removed after all layers are applied",
    )
    prefetch: list[Glob] = Field(
        default_factory=_no_globs,
        description="Files to fetch first when the image is mounted lazily: build writes"
        " prefetch.trace (beside manifest.json, not part of the image id) listing the pack"
        " chunks of the files these globs select (a directory: everything under it), in this"
        " order; each glob must match something",
    )
    pack_chunk_size: Annotated[int, AfterValidator(check_chunk_size)] = Field(
        default=DEFAULT_CHUNK_SIZE,
        description="Bytes per pack chunk, the unit a lazy mount fetches, verifies and caches:"
        " a power of two from 64 KiB to 16 MiB (default 1 MiB). Smaller chunks move fewer"
        " bytes for scattered small reads (a container's start); larger ones fewer requests",
    )
    pack_compression: Literal["none", "zstd", "btrfs-zstd"] = Field(
        default="none",
        description="Store each pack chunk as a zstd frame (blockmap version 2), so remote"
        " mounts move fewer bytes; in-place tarball packs stay uncompressed. 'btrfs-zstd':"
        " file data as btrfs zstd-compressed extents (at most 128 KiB each) that the kernel"
        " decompresses; the packs hold them as stored (blockmap version 1). 'none' (the"
        " default) writes blockmap version 1",
    )
    base: str | None = Field(
        default=None,
        min_length=1,
        description="An earlier bundle: a directory, relative to the spec file,"
        " oci://REGISTRY/REPO:TAG as push made it, or http(s)://HOST/PATH/manifest.json of a"
        " bundle on a web server (build --base overrides it): content"
        " already in its packs is mapped where it lies there, not written again, and the packs it is in are linked into the new bundle under the same"
        " ids, so push and lazy fetch move only the new packs (docs/bundle-format.md)",
    )

    # sha256 of the spec file's bytes, set by load_spec (model_copy keeps it); not a field
    _sha256: str | None = PrivateAttr(default=None)

    @property
    def spec_sha256(self) -> str:
        """``sha256:<hex>`` of the spec file's bytes (of the canonical JSON if not from a file)."""
        if self._sha256 is not None:
            return self._sha256
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


# ---- loading ----------------------------------------------------------------------------


def load_spec(
    path: str | Path, environ: Mapping[str, str] | None = None, text: SpecYaml | None = None
) -> Spec:
    """Read and validate a spec file; any problem is a ``SpecError`` naming file, line, field.
    ``text``: the file as ``read_spec_yaml`` read it already (the ``build`` command's).

    A spec without ``source_date_epoch`` takes it from ``SOURCE_DATE_EPOCH`` in ``environ``
    (default: the process environment), as reproducible-builds.org specifies.
    """
    path = Path(path)
    text = read_spec_yaml(path) if text is None else text
    spec = _validate(text.node, text.data, str(path))
    env = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH")
    if spec.source_date_epoch is None and env is not None and env.strip():
        if not env.strip().isdigit():
            raise SpecError(
                f"SOURCE_DATE_EPOCH={env!r}: not a non-negative integer (seconds since the epoch)"
            )
        spec = spec.model_copy(update={"source_date_epoch": int(env)})
    spec._sha256 = "sha256:" + hashlib.sha256(text.raw).hexdigest()
    return spec


def parse_spec(text: bytes | str, filename: str = "<spec>") -> Spec:
    """Validate spec text; errors name ``filename``."""
    return _validate(*compose(text, filename), filename)


def _validate(node: yaml.Node | None, data: Any, filename: str) -> Spec:
    if node is None:
        raise SpecError(f"{filename}:1: the spec is empty")
    _check_duplicate_keys(node, filename)
    if not isinstance(data, dict):
        raise SpecError(f"{filename}:{node.start_mark.line + 1}: the spec must be a mapping")
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_format_errors(e, node, filename)) from None


def _check_duplicate_keys(node: yaml.Node, filename: str) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        raise SpecError(
                            f"{filename}:{k.start_mark.line + 1}: duplicate key {k.value!r}"
                        )
                    seen.add(k.value)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def _locate(root: yaml.Node, loc: Sequence[int | str]) -> tuple[int, str]:
    """Follow a pydantic error location through the YAML nodes: (line, dotted field path).

    The line is the deepest node reached: a mapping key's line for a key that is present,
    the enclosing node's line for a missing one.
    """
    node: yaml.Node | None = root
    line = root.start_mark.line + 1
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            if isinstance(node, yaml.SequenceNode) and 0 <= item < len(node.value):
                node = node.value[item]
                line = node.start_mark.line + 1
            else:
                node = None
            continue
        path += f".{item}" if path else item
        found = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == item:
                    found, line = v, k.start_mark.line + 1
                    break
        node = found
    return line, path


# what pydantic's wording of an error type becomes (the spec's terms, not Python's)
_MESSAGES = {
    "extra_forbidden": "unknown key",
    "missing": "missing required key",
    "invalid_key": "unknown key",
    "model_type": "Input should be a mapping (key: value)",
    "model_attributes_type": "Input should be a mapping (key: value)",
}


def _format_errors(err: ValidationError, root: yaml.Node, filename: str) -> str:
    found: list[tuple[int, str]] = []
    for e in err.errors(include_url=False):
        loc = _strip_tags(e["loc"])
        if e["type"] == "invalid_key":  # a key that is no string (YAML's `1:`): no field's name
            loc[-1] = str(loc[-1])
        line, field = _locate(root, loc)
        msg = _MESSAGES.get(e["type"]) or e["msg"].removeprefix("Value error, ")
        item = (line, f"{filename}:{line}: {field or '(top level)'}: {msg}")
        if item not in found:
            found.append(item)
    found.sort(key=lambda item: item[0])  # stable: same-line errors keep pydantic's order
    return "\n".join(text for _, text in found)


def _strip_tags(loc: Sequence[int | str]) -> list[int | str]:
    """Drop discriminated-union tags: ``layers.1.files.files.0`` -> ``layers.1.files.0``."""
    out: list[int | str] = []
    i = 0
    while i < len(loc):
        item = loc[i]
        if (
            isinstance(item, str)
            and item in _LAYER_KINDS
            and i + 1 < len(loc)
            and loc[i + 1] == item
            and out
            and isinstance(out[-1], int)
            and out[:1] == ["layers"]
        ):
            i += 1  # the tag; the repeated key that follows is the real field
            continue
        out.append(item)
        i += 1
    return out


# ---- schema -----------------------------------------------------------------------------


def json_schema() -> dict[str, Any]:
    """The JSON schema of the spec (``specs/schema.json`` is this, as ``json_schema_text``)."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "btrfs-ublk-image spec, version 1"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(json_schema_text(), end="")
