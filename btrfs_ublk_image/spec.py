"""The image spec (version 1): typed models, YAML loading with located errors, JSON schema.

A spec is a YAML mapping::

    version: 1
    name: web-base
    btrfs: {inline_limit: 2048, fsid: null, label: ""}   # optional
    source_date_epoch: null                               # optional
    remove: ["/usr/share/doc/**"]                         # optional
    prefetch: ["/usr/bin/*", "/etc/**"]                   # optional: prefetch.trace
    pack_chunk_size: 1048576                              # optional: fetch/verify unit
    pack_compression: none                                # optional: none | zstd | btrfs-zstd
    layers:
      - tar: {path: rootfs.tar.zst, exclude: ["/var/cache/**"], uid: 0, gid: 0}
      - oci: {path: ./debian-oci, ref: bookworm}
      - oci: {ref: registry.example/library/debian:12}      # pulled, pinned in spec.yaml.lock
      - dir: {path: ./overlay, dest: /srv}
      - files:
          - {path: /etc/motd, content: "hello\\n", mode: "0644"}
          - {path: /usr/bin/vi, symlink: /usr/bin/vim.tiny}
          - {path: /srv/data, directory: true}

The models are frozen dataclasses. Each field's annotation (a type, optionally
``Annotated`` with ``_Rules``) and its ``_field(...)`` (default, description, constraints)
are the one declaration that both the validator (``_validate``) and the JSON schema
(``json_schema``) read. Types are strict: no bool for an int, no int for a string.
(This replaced pydantic, whose import and model building cost ~0.3 s of CPU per command.)

Every layer is a mapping with exactly ONE key naming its kind. ``Layer`` is a union
of one-field models told apart by that key: a new source kind is one new model plus
one member of the ``Layer`` union.

``load_spec`` also applies the ``SOURCE_DATE_EPOCH`` environment variable when the
spec sets no ``source_date_epoch`` (docs/sources.md).

``load_spec`` turns every problem (YAML syntax, duplicate keys, validation) into
a ``SpecError`` whose lines read ``FILE:LINE: field.path: message``; the line
comes from the YAML node the failing field was read from.
"""

import dataclasses
import hashlib
import json
import os
import re
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import (
    Annotated,
    Any,
    Literal,
    TypeAlias,
    TypeVar,
    Union,
    dataclass_transform,
    get_args,
    get_origin,
)

import yaml

from btrfs_ublk_image.errors import ImageError, SpecError

SPEC_VERSION = 1
DEFAULT_INLINE_LIMIT = 2048
MAX_INLINE_LIMIT = 4095
DEFAULT_CHUNK_SIZE = 1 << 20  # packs.DEFAULT_CHUNK_SIZE (not imported: the CLI's start)
MIN_CHUNK_SIZE = 64 << 10  # pack chunks: ublkd's fetch, verify and cache unit
MAX_CHUNK_SIZE = 16 << 20

_MODE_RE = re.compile(r"(?:0o|0)?([0-7]{1,4})")


def parse_mode(value: object) -> int:
    """A mode as an octal string ("0644", "4755", "0o755") or an int, permission bits only."""
    if isinstance(value, bool):
        raise ValueError(f"invalid octal mode {value!r}")  # noqa: TRY004 - reported as a spec error
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


# ---- field declarations -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=False)  # eq=False: hashable (typing needs it)
class _Rules:
    """Checks of one scalar value beyond its type, each also a JSON schema keyword."""

    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None  # anchored ^...$; matched against the whole value
    ge: int | None = None
    le: int | None = None
    check: Callable[[Any], object] | None = None  # raises ValueError naming the problem
    parse: Callable[[object], Any] | None = None  # replaces the type check: raw -> value
    schema: dict[str, Any] | None = None  # the JSON schema of what ``parse`` accepts
    description: str | None = None  # of the type (a field's own description wins)


def _field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    init: bool = True,
    description: str | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
    pattern: str | None = None,
    ge: int | None = None,
    le: int | None = None,
    check: Callable[[Any], object] | None = None,
) -> Any:
    """A model field: its default, description and the rules of its (non-null) value."""
    constraints = (min_length, max_length, pattern, ge, le, check)
    rules = _Rules(*constraints) if any(c is not None for c in constraints) else None
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        init=init,
        repr=init,
        compare=init,
        metadata={"description": description, "rules": rules},
    )


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(_field,))
def _model(cls: type[_T]) -> type[_T]:
    """A spec model: a frozen, slotted, keyword-only dataclass keeping its own docstring."""
    doc = cls.__dict__.get("__doc__")
    model = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
    model.__doc__ = doc  # not dataclass's generated signature: the schema shows it
    return model


class _Model:
    """Base of the spec models."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        """The model as JSON data, every field included; ``parse_spec`` reads it back."""
        return {f.name: _to_json(getattr(self, f.name)) for f in _fields(type(self))}


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The declared (validated, dumped) fields of a model, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.init]


def _to_json(value: object) -> Any:
    if isinstance(value, _Model):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


# ---- value types ------------------------------------------------------------------------

Mode = Annotated[
    int,
    _Rules(
        parse=parse_mode,
        schema={
            "anyOf": [
                {"type": "string", "pattern": "^(0o|0)?[0-7]{1,4}$"},
                {"type": "integer", "minimum": 0, "maximum": 0o7777},
            ],
            "description": 'Permission bits incl. setuid/setgid/sticky: an octal string ("0644",'
            ' "4755") or an integer (YAML reads an unquoted 0644 as octal)',
        },
    ),
]


def _check_image_path(value: str) -> None:
    raw = value.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise ValueError("path contains a NUL byte")
    for comp in raw.split(b"/"):
        if len(comp) > 255:
            raise ValueError(f"path component longer than 255 bytes: {comp[:40]!r}...")


ImagePath = Annotated[
    str,
    _Rules(
        min_length=1,
        check=_check_image_path,
        description="Path inside the image; '..' never leaves the image root",
    ),
]


def _check_glob(value: str) -> None:
    from btrfs_ublk_image.sources.globs import compile_glob

    compile_glob(value)  # raises ValueError with the reason


Glob = Annotated[
    str,
    _Rules(
        min_length=1,
        check=_check_glob,
        description="Image path pattern: '*' and '?' match within one component, '**' any"
        " number of components, '[...]' a character class",
    ),
]

Owner = Annotated[int, _Rules(ge=0, le=0xFFFFFFFF)]


def check_chunk_size(value: int) -> None:
    if value < MIN_CHUNK_SIZE or value > MAX_CHUNK_SIZE or value & (value - 1):
        raise ValueError(f"{value} is not a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}")


def _check_label(value: str) -> None:
    raw = value.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"label is {len(raw)} bytes long, at most 255 allowed")
    if "\0" in value:
        raise ValueError("label contains a NUL character")


# ---- models -----------------------------------------------------------------------------


@_model
class _TreeOptions(_Model):
    """Options of sources that copy a file tree (``tar``, ``dir``)."""

    dest: ImagePath = _field(default="/", description="Directory of the image the tree goes into")
    include: list[Glob] | None = _field(
        default=None,
        description="Keep only entries whose image path (after dest/strip_components), or one"
        " of its parent directories, matches one of these globs",
    )
    exclude: list[Glob] = _field(
        default_factory=list,
        description="Drop entries whose image path, or one of its parent directories, matches"
        " one of these globs (applied after include)",
    )
    uid: Owner | None = _field(
        default=None, description="Owner override: every entry gets this uid"
    )
    gid: Owner | None = _field(
        default=None, description="Owner override: every entry gets this gid"
    )


@_model
class BtrfsOptions(_Model):
    """Options of the btrfs writer."""

    inline_limit: int = _field(
        default=DEFAULT_INLINE_LIMIT,
        ge=0,
        le=MAX_INLINE_LIMIT,
        description="Files up to this many bytes become inline extents; 0 disables inlining",
    )
    fsid: uuid.UUID | None = _field(
        default=None, description="Filesystem UUID; default: derived from the image content"
    )
    label: str = _field(
        default="", check=_check_label, description="Filesystem label, at most 255 bytes (UTF-8)"
    )


# ---- layers -----------------------------------------------------------------------------


@_model
class TarSource(_TreeOptions):
    """A tarball: plain, gzip, zstd, xz or bzip2 (detected from its first bytes)."""

    path: str = _field(min_length=1, description="The tarball, relative to the spec file")
    sha256: str | None = _field(
        default=None,
        pattern=r"^(sha256:)?[0-9a-f]{64}$",
        description="Expected sha256 of the tarball's bytes (as stored, compressed); a mismatch"
        " fails the build",
    )
    strip_components: int = _field(
        default=0,
        ge=0,
        description="Drop this many leading components from member names (and hard link"
        " targets); members with no name left are skipped",
    )
    in_place: bool = _field(
        default=False,
        description="Use the tarball itself as a pack of the bundle (uncompressed tarballs"
        " only): member data is referenced where it lies instead of copied. The bundle's"
        " copy of the tarball is a reflink where the filesystem supports it, else a full"
        " copy; its headers and small (inline) files stay in the pack unused",
    )


@_model
class TarLayer(_Model):
    tar: TarSource


@_model
class DirSource(_TreeOptions):
    """A local directory tree: its contents (not the directory itself) go under ``dest``."""

    path: str = _field(min_length=1, description="The directory, relative to the spec file")


@_model
class DirLayer(_Model):
    dir: DirSource


@_model
class OciSource(_Model):
    """An OCI image: a layout directory, an ``oci-archive`` or a ``docker-archive`` tarball
    (``path``), or an image in a registry (no ``path``; ``ref: REGISTRY/REPO:TAG`` or
    ``REGISTRY/REPO@sha256:HEX``), pulled through a digest-checked local cache and pinned
    in the spec's lock file (docs/sources.md)."""

    path: str | None = _field(
        default=None,
        min_length=1,
        description="OCI image layout directory, or an uncompressed oci-archive or"
        " docker-archive (docker save) tarball, relative to the spec file; leave it out to"
        " pull ``ref`` from a registry",
    )
    ref: str | None = _field(
        default=None,
        min_length=1,
        description="With path: the tag, the index's org.opencontainers.image.ref.name"
        " (docker-archive: a RepoTags entry, whole or the part after ':'); may be left out"
        " when the image holds one image. Without path: the registry image,"
        " REGISTRY[:PORT]/REPO[:TAG] or REGISTRY[:PORT]/REPO@sha256:HEX",
    )
    digest: str | None = _field(
        default=None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="Select (or, with ref, pin) by digest: of an image index or manifest;"
        " docker-archive: of the image config (the image id). Registry images: the manifest"
        " or index to pull (the tag is then only a name; the lock file is not consulted)",
    )
    platform: str | None = _field(
        default=None,
        pattern=r"^[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?$",
        description="os/architecture[/variant] picked from an image index; default: the"
        " host's (linux/amd64 on x86_64)",
    )

    def __post_init__(self) -> None:
        # Runs once every field is valid: the validator reports this at the entry's line.
        if self.path is not None:
            return
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


@_model
class OciLayer(_Model):
    oci: OciSource


@_model
class FileEntry(_Model):
    """One inline entry: exactly one of ``content``, ``symlink``, ``directory: true``."""

    path: ImagePath
    content: str | None = _field(default=None, description="Regular file content (UTF-8 text)")
    symlink: str | None = _field(default=None, min_length=1, description="Symlink target")
    directory: bool = _field(default=False, description="true: a directory")
    mode: Mode | None = _field(
        default=None, description="Default: 0644 files, 0755 dirs, 0777 symlinks"
    )
    uid: int = _field(default=0, ge=0, le=0xFFFFFFFF)
    gid: int = _field(default=0, ge=0, le=0xFFFFFFFF)
    mtime: int | None = _field(
        default=None, description="Seconds since the epoch; default: source_date_epoch, else 0"
    )

    def __post_init__(self) -> None:
        # Runs once every field is valid: the validator reports this at the entry's line.
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

    @property
    def kind(self) -> Literal["file", "symlink", "directory"]:
        if self.directory:
            return "directory"
        return "symlink" if self.symlink is not None else "file"


@_model
class FilesLayer(_Model):
    files: list[FileEntry]


# A layer: a mapping whose single key (the one field of a member) names its kind.
Layer: TypeAlias = TarLayer | OciLayer | DirLayer | FilesLayer


@_model
class Spec(_Model):
    """An image spec, version 1."""

    version: Literal[1] = _field(description="Spec format version")
    name: str = _field(
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$",
        description="Image name (letters, digits, '.', '_', '+', '-')",
    )
    btrfs: BtrfsOptions = _field(default_factory=BtrfsOptions)
    source_date_epoch: int | None = _field(
        default=None,
        ge=0,
        description="Seconds since the epoch: no timestamp in the image is later (later ones"
        " are clamped to it); also the mtime of directories the builder creates and the"
        " default mtime of inline files. Default: the SOURCE_DATE_EPOCH environment variable",
    )
    layers: list[Layer] = _field(description="Applied in order; later layers win")
    remove: list[Glob] = _field(
        default_factory=list,
        description="Entries (with everything under them) removed after all layers are applied",
    )
    prefetch: list[Glob] = _field(
        default_factory=list,
        description="Files to fetch first when the image is mounted lazily: build writes"
        " prefetch.trace (beside manifest.json, not part of the image id) listing the pack"
        " chunks of the files these globs select (a directory: everything under it), in this"
        " order; each glob must match something",
    )
    pack_chunk_size: int = _field(
        default=DEFAULT_CHUNK_SIZE,
        check=check_chunk_size,
        description="Bytes per pack chunk, the unit a lazy mount fetches, verifies and caches:"
        " a power of two from 64 KiB to 16 MiB (default 1 MiB). Smaller chunks move fewer"
        " bytes for scattered small reads (a container's start); larger ones fewer requests",
    )
    pack_compression: Literal["none", "zstd", "btrfs-zstd"] = _field(
        default="none",
        description="Store each pack chunk as a zstd frame (blockmap version 2), so remote"
        " mounts move fewer bytes; in-place tarball packs stay uncompressed. 'btrfs-zstd':"
        " file data as btrfs zstd-compressed extents (at most 128 KiB each) that the kernel"
        " decompresses; the packs hold them as stored (blockmap version 1). 'none' (the"
        " default) writes blockmap version 1",
    )

    # sha256 of the spec file's bytes, set by load_spec; not a spec field.
    _sha256: str | None = _field(default=None, init=False)

    @property
    def spec_sha256(self) -> str:
        """``sha256:<hex>`` of the spec file's bytes (of the canonical JSON if not from a file)."""
        if self._sha256 is not None:
            return self._sha256
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


# ---- validation -------------------------------------------------------------------------

_Loc = tuple[int | str, ...]
_Errors = list[tuple[_Loc, str]]
_INVALID: Any = object()  # the value of a field that failed (its error is recorded)


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else None


def _with(rules: _Rules | None, more: _Rules | None) -> _Rules | None:
    """``rules`` (of a type) with the non-default entries of ``more`` (of a field) on top."""
    if rules is None or more is None:
        return rules or more
    changes = {
        f.name: getattr(more, f.name)
        for f in dataclasses.fields(more)
        if getattr(more, f.name) is not None
    }
    return dataclasses.replace(rules, **changes)


def _validate(tp: Any, rules: _Rules | None, value: object, loc: _Loc, errors: _Errors) -> Any:
    """``value`` checked against the declared type ``tp``; problems are appended to ``errors``."""
    if get_origin(tp) is Annotated:
        base, own = get_args(tp)
        return _validate(base, _with(own, rules), value, loc, errors)
    members = _union_members(tp)
    if members is not None:
        if types.NoneType in members:  # X | None
            if value is None:
                return None
            (inner,) = (m for m in members if m is not types.NoneType)
            return _validate(inner, rules, value, loc, errors)
        return _validate_one_of(members, value, loc, errors)
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        names = [repr(c) for c in choices]
        expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        errors.append((loc, f"Input should be {expected}"))
        return _INVALID
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            errors.append((loc, "Input should be a valid list"))
            return _INVALID
        return [_validate(item, None, v, (*loc, i), errors) for i, v in enumerate(value)]
    if isinstance(tp, type) and issubclass(tp, _Model):
        return _validate_model(tp, value, loc, errors)
    try:
        return _scalar(tp, rules, value)
    except ValueError as e:
        errors.append((loc, str(e)))
        return _INVALID


_UUID_RE = re.compile(
    r"(?:urn:uuid:)?(?P<h>[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})"
    r"|\{(?P<b>[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})\}"
    r"|(?P<s>[0-9a-fA-F]{32})"
)


def _scalar(tp: Any, rules: _Rules | None, value: object) -> Any:
    """A bool, int, str or UUID value, strictly typed, with its rules; ValueError if not."""
    if rules is not None and rules.parse is not None:
        return rules.parse(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError("Input should be a valid boolean")
        return value
    if tp is uuid.UUID:
        if not isinstance(value, str):
            raise ValueError("Input should be a valid UUID string")
        if _UUID_RE.fullmatch(value) is None:
            raise ValueError(f"Input should be a valid UUID, got {value!r}")
        return uuid.UUID(value)
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("Input should be a valid integer")
    elif tp is str:
        if not isinstance(value, str):
            raise ValueError("Input should be a valid string")
    else:
        raise TypeError(f"spec field type {tp!r} has no validator")
    if rules is None:
        return value
    if rules.check is not None:
        rules.check(value)
    if isinstance(value, str):
        if rules.min_length is not None or rules.max_length is not None or rules.pattern:
            try:  # as pydantic did: a constrained string must be valid Unicode
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    "Input should be a valid string, unable to parse raw data as a unicode string"
                ) from None
        if rules.min_length is not None and len(value) < rules.min_length:
            s = "" if rules.min_length == 1 else "s"
            raise ValueError(f"String should have at least {rules.min_length} character{s}")
        if rules.max_length is not None and len(value) > rules.max_length:
            raise ValueError(f"String should have at most {rules.max_length} characters")
        # fullmatch: '$' must not accept a trailing newline
        if rules.pattern is not None and re.fullmatch(rules.pattern, value) is None:
            raise ValueError(f"String should match pattern {rules.pattern!r}")
    else:
        assert isinstance(value, int)
        if rules.ge is not None and value < rules.ge:
            raise ValueError(f"Input should be greater than or equal to {rules.ge}")
        if rules.le is not None and value > rules.le:
            raise ValueError(f"Input should be less than or equal to {rules.le}")
    return value


def _validate_model(cls: type[_Model], value: object, loc: _Loc, errors: _Errors) -> Any:
    if not isinstance(value, dict):
        errors.append((loc, "Input should be a mapping (key: value)"))
        return _INVALID
    before = len(errors)
    fields = _fields(cls)
    args: dict[str, Any] = {}
    for f in fields:
        if f.name in value:
            args[f.name] = _validate(
                f.type, f.metadata.get("rules"), value[f.name], (*loc, f.name), errors
            )
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(((*loc, f.name), "missing required key"))
    names = {f.name for f in fields}
    errors.extend(((*loc, str(k)), "unknown key") for k in value if k not in names)
    if len(errors) > before:
        return _INVALID
    try:
        return cls(**args)
    except ValueError as e:  # __post_init__: a rule across fields
        errors.append((loc, str(e)))
        return _INVALID


def _validate_one_of(members: tuple[Any, ...], value: object, loc: _Loc, errors: _Errors) -> Any:
    """A union of one-field models (``Layer``): the mapping's single key picks the member."""
    by_key = {_fields(m)[0].name: m for m in members}
    kinds = ", ".join(by_key)
    if not isinstance(value, dict):
        errors.append((loc, f"a layer is a mapping like '- tar: {{path: ...}}', got {value!r}"))
        return _INVALID
    keys = list(value)
    if len(keys) != 1:
        errors.append(
            (
                loc,
                f"a layer is a mapping with exactly one key, one of: {kinds}"
                f" (got {len(keys)} keys: {', '.join(map(str, keys)) or 'none'})",
            )
        )
        return _INVALID
    if keys[0] not in by_key:
        errors.append((loc, f"unknown layer kind {keys[0]!r}: expected one of {kinds}"))
        return _INVALID
    return _validate_model(by_key[keys[0]], value, loc, errors)


# ---- loading ----------------------------------------------------------------------------


def load_spec(path: str | Path, environ: Mapping[str, str] | None = None) -> Spec:
    """Read and validate a spec file; any problem is a ``SpecError`` naming file, line, field.

    A spec without ``source_date_epoch`` takes it from ``SOURCE_DATE_EPOCH`` in ``environ``
    (default: the process environment), as reproducible-builds.org specifies.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec: {e.strerror or e}") from None
    spec = parse_spec(raw, str(path))
    env = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH")
    if spec.source_date_epoch is None and env is not None and env.strip():
        if not env.strip().isdigit():
            raise SpecError(
                f"SOURCE_DATE_EPOCH={env!r}: not a non-negative integer (seconds since the epoch)"
            )
        spec = dataclasses.replace(spec, source_date_epoch=int(env))
    object.__setattr__(spec, "_sha256", "sha256:" + hashlib.sha256(raw).hexdigest())  # frozen
    return spec


def parse_spec(text: bytes | str, filename: str = "<spec>") -> Spec:
    """Validate spec text; errors name ``filename``."""
    node, data = _compose(text, filename)
    if node is None:
        raise SpecError(f"{filename}:1: the spec is empty")
    _check_duplicate_keys(node, filename)
    if not isinstance(data, dict):
        raise SpecError(f"{filename}:{node.start_mark.line + 1}: the spec must be a mapping")
    errors: _Errors = []
    spec = _validate_model(Spec, data, (), errors)
    if errors:
        raise SpecError(_format_errors(errors, node, filename))
    assert isinstance(spec, Spec)
    return spec


def _compose(text: bytes | str, filename: str) -> tuple[yaml.Node | None, Any]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
        return node, data
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f"{mark.line + 1}" if mark is not None else "1"
        what = " ".join(p for p in (e.context, e.problem) if p)
        raise SpecError(f"{filename}:{line}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{filename}: invalid YAML: {e}") from None
    finally:
        loader.dispose()


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
    """Follow an error's location through the YAML nodes: (line, dotted field path).

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


def _format_errors(errors: _Errors, root: yaml.Node, filename: str) -> str:
    found: list[tuple[int, str]] = []
    for loc, msg in errors:
        line, field = _locate(root, loc)
        item = (line, f"{filename}:{line}: {field or '(top level)'}: {msg}")
        if item not in found:
            found.append(item)
    found.sort(key=lambda item: item[0])  # stable: same-line errors keep field order
    return "\n".join(text for _, text in found)


# ---- schema -----------------------------------------------------------------------------


def _schema(tp: Any, rules: _Rules | None, defs: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a declared type (the validator's ``_validate`` reads the same)."""
    if get_origin(tp) is Annotated:
        base, own = get_args(tp)
        return _schema(base, _with(own, rules), defs)
    members = _union_members(tp)
    if members is not None:
        if types.NoneType in members:
            (inner,) = (m for m in members if m is not types.NoneType)
            return {"anyOf": [_schema(inner, rules, defs), {"type": "null"}]}
        return {"oneOf": [_schema(m, None, defs) for m in members]}
    if get_origin(tp) is Literal:
        choices = list(get_args(tp))
        out: dict[str, Any] = {"type": {int: "integer", str: "string"}[type(choices[0])]}
        if len(choices) == 1:
            out["const"] = choices[0]
        else:
            out["enum"] = choices
        return out
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        return {"type": "array", "items": _schema(item, None, defs)}
    if isinstance(tp, type) and issubclass(tp, _Model):
        _model_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if rules is not None and rules.schema is not None:
        return dict(rules.schema)
    if tp is uuid.UUID:
        return {"type": "string", "format": "uuid"}
    out = {"type": {bool: "boolean", int: "integer", str: "string"}[tp]}
    if rules is not None:
        for key, value in (
            ("minLength", rules.min_length),
            ("maxLength", rules.max_length),
            ("pattern", rules.pattern),
            ("minimum", rules.ge),
            ("maximum", rules.le),
            ("description", rules.description),
        ):
            if value is not None:
                out[key] = value
    return out


def _model_schema(cls: type[_Model], defs: dict[str, Any]) -> None:
    """Add ``cls`` (and the models it uses) to ``defs``."""
    if cls.__name__ in defs:
        return
    defs[cls.__name__] = schema = {
        "type": "object",
        "title": cls.__name__,
        "additionalProperties": False,
    }
    if cls.__doc__:
        import inspect

        schema["description"] = inspect.cleandoc(cls.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in _fields(cls):
        prop = _schema(f.type, f.metadata.get("rules"), defs)
        if "$ref" not in prop:
            prop["title"] = f.name.replace("_", " ").title()
        if f.default is not dataclasses.MISSING:
            prop["default"] = _to_json(f.default)
        elif f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        if f.metadata.get("description") is not None:
            prop["description"] = f.metadata.get("description")
        properties[f.name] = prop
    schema["properties"] = properties
    if required:
        schema["required"] = required


def json_schema() -> dict[str, Any]:
    """The JSON schema of the spec (``specs/schema.json`` is this, as ``json_schema_text``)."""
    defs: dict[str, Any] = {}
    _model_schema(Spec, defs)
    schema: dict[str, Any] = defs.pop("Spec")
    schema["$defs"] = defs
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "btrfs-ublk-image spec, version 1"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(json_schema_text(), end="")
