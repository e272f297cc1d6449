"""What every source shares: the record it returns and the context it writes through."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.spec import Spec
from btrfs_ublk_image.tree import FileType, Inode, Tree, check_name, split_path


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """What the manifest records about one layer (``sources`` list, in layer order)."""

    kind: str  # "tar", "files", ...
    path: str  # as written in the spec ("" for a files layer)
    sha256: str  # "sha256:<hex>": of the source file's bytes; files layer: of its canonical JSON

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "sha256": self.sha256}


class LayerContext:
    """Everything a source needs to apply one layer to the tree."""

    __slots__ = ("dir_mtime_ns", "index", "packs", "progress", "spec", "spec_dir", "tree")

    def __init__(
        self,
        tree: Tree,
        spec: Spec,
        spec_dir: Path,
        packs: PackWriter,
        progress: Progress | None,
        index: int,
    ) -> None:
        self.tree = tree
        self.spec = spec
        self.spec_dir = spec_dir
        self.packs = packs
        self.progress = progress
        self.index = index  # the layer's position in ``spec.layers``
        epoch = spec.source_date_epoch
        self.dir_mtime_ns = None if epoch is None else epoch * 1_000_000_000

    def resolve(self, path: str) -> Path:
        """A source path from the spec, relative to the spec file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.spec_dir / p

    def place(self, path: bytes, inode: Inode, where: str) -> None:
        """Put ``inode`` at image path ``path`` (see the module docstring for the rules)."""
        parts = split_path(path)
        tree = self.tree
        if not parts:
            if inode.type != FileType.DIR:
                raise SourceError(f"{where}: the image root can only be a directory")
            tree.set_root_meta(inode)
            return
        node = tree.root
        for comp in parts[:-1]:
            child = node.entries.get(comp)
            if child is None or child.type != FileType.DIR:
                check_name(comp, where)
                mtime = self.dir_mtime_ns if self.dir_mtime_ns is not None else inode.mtime_ns
                child = Inode(FileType.DIR, mode=0o755, mtime_ns=mtime)
                node.entries[comp] = child
            node = child
        name = parts[-1]
        entries = node.entries
        old = entries.get(name)
        if old is None:
            check_name(name, where)
        elif old.type == FileType.DIR and inode.type == FileType.DIR:
            if old is not inode:
                old.mode, old.uid, old.gid = inode.mode, inode.uid, inode.gid
                old.mtime_ns, old.atime_ns = inode.mtime_ns, inode.atime_ns
                old.ctime_ns, old.xattrs = inode.ctime_ns, inode.xattrs
            return
        entries[name] = inode

    def lookup(self, path: bytes) -> Inode | None:
        return self.tree.lookup(path)
