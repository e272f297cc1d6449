"""Sources: stream each layer of a spec, in order, into one merged ``Tree``.

``build_sources`` is the entry point (``build_tree`` is the same without the
image config). Each layer kind has one module with an
``apply(layer, ctx) -> SourceRecord`` function, registered in ``_appliers``; a new
kind is a new module plus one registry entry.

Placement rules (``LayerContext.place``), the same for every source:
  * later wins: an entry replaces whatever was at its path, except that a
    directory put on an existing directory only updates its metadata (the
    children stay, as ``tar -x`` does);
  * missing parent directories are created (mode 0755, owner 0, mtime
    ``source_date_epoch`` when the spec sets it, else the entry's mtime), and
    a non-directory (other than a symlink) in the way of a parent is replaced
    by a directory;
  * ``..`` in a name is resolved lexically and stops at ``/``; a symlink among
    the parent directories is followed INSIDE the image (an absolute target
    starts at the image root, ``..`` stops there: the host is never looked at);
    the last component is never followed;
  * an entry for ``/`` itself updates the root directory's metadata.

After the layers: the spec's ``remove:`` globs delete entries (with what is under
them), then, when ``source_date_epoch`` is set, every timestamp later than it is
clamped to it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.sources import tar
from btrfs_ublk_image.sources.base import LayerContext, SourceRecord
from btrfs_ublk_image.sources.globs import PathSet
from btrfs_ublk_image.tree import FileType, Tree, clamp_tree_times

if TYPE_CHECKING:  # a build's first tar layer is read while the spec's models import
    from btrfs_ublk_image.spec import Spec

__all__ = ["Built", "LayerContext", "SourceRecord", "build_sources", "build_tree"]


def _apply_oci(layer: Any, ctx: LayerContext) -> SourceRecord:
    # imported by specs with OCI layers only (~6 ms of every other build's start)
    from btrfs_ublk_image.sources import oci

    return oci.apply(layer, ctx)


def _appliers() -> dict[type, Callable[[Any, LayerContext], SourceRecord]]:
    """Layer model -> the function that applies it."""
    # here, not at the top: a build's first tar layer is read from start-up on (early.py),
    # and what that start imports delays it
    from btrfs_ublk_image.sources import dir as dir_source
    from btrfs_ublk_image.sources import files
    from btrfs_ublk_image.spec import DirLayer, FilesLayer, OciLayer, TarLayer

    return {
        TarLayer: tar.apply,
        OciLayer: _apply_oci,
        DirLayer: dir_source.apply,
        FilesLayer: files.apply,
    }


class Built(NamedTuple):
    """The layers applied: the tree and what the manifest records (a NamedTuple: early.py)."""

    tree: Tree
    records: list[SourceRecord]
    # the image config for the manifest: the last layer that has one (OCI) wins
    image_config: dict[str, Any] | None


class Started:
    """The first layers of a spec already applied (``early.EarlyRead``): the tree they
    made and their records; ``build_sources`` applies the rest."""

    __slots__ = ("records", "tree")

    def __init__(self, tree: Tree, records: list[SourceRecord]) -> None:
        self.tree, self.records = tree, records


def build_tree(
    spec: Spec, spec_path: Path, packs: PackWriter, progress: Progress | None = None
) -> tuple[Tree, list[SourceRecord]]:
    """``build_sources`` without the image config."""
    built = build_sources(spec, spec_path, packs, progress)
    return built.tree, built.records


def build_sources(
    spec: Spec,
    spec_path: Path,
    packs: PackWriter,
    progress: Progress | None = None,
    started: Started | None = None,
) -> Built:
    """Apply every layer of ``spec`` in order; paths in the spec are relative to ``spec_path``.
    ``started``: the first layers, applied already (into ``packs``).

    Regular file content goes to ``packs`` (deduplicated there). Raises ``SourceError``
    (unreadable, corrupt or hostile input), naming the source file and entry.
    """
    if started is None:
        tree = Tree()
        if spec.source_date_epoch is not None:
            tree.root.mtime_ns = spec.source_date_epoch * 1_000_000_000
        records: list[SourceRecord] = []
    else:
        tree, records = started.tree, list(started.records)
    spec_dir = Path(spec_path).parent
    appliers = _appliers()
    for index, layer in enumerate(spec.layers):
        if index < len(records):
            continue
        apply = appliers.get(type(layer))
        if apply is None:
            raise SourceError(f"layers[{index}]: no source for {type(layer).__name__}")
        ctx = LayerContext(tree, spec, spec_dir, packs, progress, index)
        records.append(apply(layer, ctx))
    if spec.remove:
        remove_globs(tree, PathSet(spec.remove))
    if spec.source_date_epoch is not None:
        clamp_times(tree, spec.source_date_epoch * 1_000_000_000)
    config = None
    for r in records:
        if r.image_config is not None:
            config = r.image_config
    return Built(tree, records, config)


def remove_globs(tree: Tree, globs: PathSet) -> int:
    """Delete every entry whose path matches (with everything under it); returns how many."""
    removed = 0
    todo = [(b"", tree.root)]
    while todo:
        path, node = todo.pop()
        for name in sorted(node.entries):
            child = node.entries[name]
            cpath = path + b"/" + name
            if globs.match(cpath):
                del node.entries[name]
                removed += 1
            elif child.type == FileType.DIR:
                todo.append((cpath, child))
    return removed


def clamp_times(tree: Tree, limit_ns: int) -> None:
    """No timestamp later than ``limit_ns`` (reproducible-builds' SOURCE_DATE_EPOCH clamping)."""
    clamp_tree_times(tree, limit_ns)
