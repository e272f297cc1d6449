"""The ``files`` layer: inline regular files, directories and symlinks written in the spec."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from btrfs_ublk_image.sources.base import LayerContext, SourceRecord
from btrfs_ublk_image.tree import FileType, Inode

if TYPE_CHECKING:
    from btrfs_ublk_image.spec import FilesLayer

_DEFAULT_MODES = {"file": 0o644, "directory": 0o755, "symlink": 0o777}


def canonical_sha256(layer: FilesLayer) -> str:
    """``sha256:<hex>`` of the layer's entries as canonical JSON (sorted keys, no spaces)."""
    entries = [e.to_json() for e in layer.files]
    canon = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canon.encode("utf-8", "surrogateescape")).hexdigest()


def apply(layer: FilesLayer, ctx: LayerContext) -> SourceRecord:
    epoch = ctx.spec.source_date_epoch
    for i, entry in enumerate(layer.files):
        where = f"layers[{ctx.index}].files[{i}] ({entry.path})"
        kind = entry.kind
        mode = entry.mode if entry.mode is not None else _DEFAULT_MODES[kind]
        mtime = entry.mtime if entry.mtime is not None else (epoch or 0)
        inode = Inode(FileType.REG, mode=mode, uid=entry.uid, gid=entry.gid)
        inode.mtime_ns = mtime * 1_000_000_000
        if kind == "directory":
            inode.type = FileType.DIR
        elif kind == "symlink":
            assert entry.symlink is not None
            inode.type = FileType.SYMLINK
            inode.target = entry.symlink.encode("utf-8", "surrogateescape")
        else:
            assert entry.content is not None
            inode.content = ctx.packs.put_bytes(entry.content.encode("utf-8", "surrogateescape"))
        ctx.place(entry.path.encode("utf-8", "surrogateescape"), inode, where)
        if ctx.progress is not None:
            ctx.progress.add_file()
    return SourceRecord(kind="files", path="", sha256=canonical_sha256(layer))
