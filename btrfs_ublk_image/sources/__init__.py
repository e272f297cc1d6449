"""Sources: stream each layer of a spec, in order, into one merged ``Tree``.

``build_tree`` is the entry point. Each layer kind has one module with an
``apply(layer, ctx) -> SourceRecord`` function, registered in ``_APPLY``; a new
kind (oci, dir) is a new module plus one registry entry.

Placement rules (``LayerContext.place``), the same for every source:
  * later wins: an entry replaces whatever was at its path, except that a
    directory put on an existing directory only updates its metadata (the
    children stay, as ``tar -x`` does);
  * missing parent directories are created (mode 0755, owner 0, mtime
    ``source_date_epoch`` when the spec sets it, else the entry's mtime), and
    a non-directory in the way of a parent is replaced by a directory;
  * paths resolve lexically inside the image (``..`` stops at ``/``);
  * an entry for ``/`` itself updates the root directory's metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.sources import files, tar
from btrfs_ublk_image.sources.base import LayerContext, SourceRecord
from btrfs_ublk_image.spec import FilesLayer, Spec, TarLayer
from btrfs_ublk_image.tree import Tree

__all__ = ["LayerContext", "SourceRecord", "build_tree"]

# layer model -> the function that applies it
_APPLY: dict[type, Callable[[Any, LayerContext], SourceRecord]] = {
    TarLayer: tar.apply,
    FilesLayer: files.apply,
}


def build_tree(
    spec: Spec, spec_path: Path, packs: PackWriter, progress: Progress | None = None
) -> tuple[Tree, list[SourceRecord]]:
    """Apply every layer of ``spec`` in order; paths in the spec are relative to ``spec_path``.

    Regular file content goes to ``packs`` (deduplicated there). Raises ``SourceError``
    (unreadable, corrupt or hostile input), naming the source file and entry.
    """
    tree = Tree()
    if spec.source_date_epoch is not None:
        tree.root.mtime_ns = spec.source_date_epoch * 1_000_000_000
    spec_dir = Path(spec_path).parent
    records: list[SourceRecord] = []
    for index, layer in enumerate(spec.layers):
        apply = _APPLY.get(type(layer))
        if apply is None:
            raise SourceError(f"layers[{index}]: no source for {type(layer).__name__}")
        ctx = LayerContext(tree, spec, spec_dir, packs, progress, index)
        records.append(apply(layer, ctx))
    return tree, records
