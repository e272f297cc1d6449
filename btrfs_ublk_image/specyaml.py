"""A spec file's YAML read and composed without its models (``spec`` validates it): the
``build`` command reads it first, so that the tarballs' digests start (``native.Prehash``)
before pydantic and the spec's models are imported; ``load_spec`` then validates the same
composition instead of reading the file again. Only PyYAML is imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from btrfs_ublk_image.errors import SpecError

# a tar layer's keys when the native reader reads it as it is (no dest, renames, filters or
# in_place: sources/tar.py's ``_read_native``) and from start-up on: the digest begun
# (``cli._start_prehashes``), the whole first layer read (``early.EarlyRead``)
PLAIN_TAR_KEYS = frozenset({"path", "uid", "gid", "sha256"})

# the spec's limits (``spec`` imports them; here for what reads the YAML before the models)
DEFAULT_INLINE_LIMIT = 2048
MAX_INLINE_LIMIT = 4095
DEFAULT_CHUNK_SIZE = 1 << 20  # packs.DEFAULT_CHUNK_SIZE (not imported: the CLI's start)
MIN_CHUNK_SIZE = 64 << 10  # pack chunks: ublkd's fetch, verify and cache unit
MAX_CHUNK_SIZE = 16 << 20


def check_chunk_size(value: int) -> int:
    if value < MIN_CHUNK_SIZE or value > MAX_CHUNK_SIZE or value & (value - 1):
        raise ValueError(f"{value} is not a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}")
    return value


class SpecYaml:
    """A spec file's bytes, its YAML node tree (for the lines in errors) and its data."""

    __slots__ = ("data", "node", "raw")

    def __init__(self, raw: bytes, node: yaml.Node | None, data: Any) -> None:
        self.raw = raw
        self.node = node
        self.data = data


def read_spec_yaml(path: Path) -> SpecYaml:
    """The spec file at ``path``, composed; a ``SpecError`` naming it when it cannot be read
    or is not YAML."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec: {e.strerror or e}") from None
    return SpecYaml(raw, *compose(raw, str(path)))


def compose(text: bytes | str, filename: str) -> tuple[yaml.Node | None, Any]:
    """The YAML node tree of ``text`` and the data constructed from it."""
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


def source_path(spec_dir: Path, path: str) -> Path:
    """A source path from the spec, relative to the spec file's directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else spec_dir / p
