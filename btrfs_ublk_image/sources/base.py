"""What every source shares: the record it returns and the context it writes through."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from btrfs_ublk_native import Names

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.specyaml import source_path
from btrfs_ublk_image.tree import (
    Entries,
    FileType,
    Inode,
    SavedMetadata,
    Tree,
    check_name,
    split_path,
)


class SpecDates(Protocol):
    """What a layer reads of the spec (``spec.Spec``; ``early`` gives it before the models
    are imported): its ``source_date_epoch``."""

    @property
    def source_date_epoch(self) -> int | None: ...


MAX_SYMLINKS = 40  # symlinks followed while resolving one path (the kernel's limit)
PATH_MAX = 4096  # a symlink target must be shorter (the kernel refuses longer ones)
WHITEOUT = b".wh."
OPAQUE = b".wh..wh..opq"

# one change to the tree, as ``LayerContext.undo`` reverts it: a directory's entry and what
# it held before (None: nothing), names new in a directory (the extension's placer: one
# ``Names`` per run of members in one directory), a path added to the layer's upper set, a
# directory's metadata before ``take_metadata``
_Change = (
    tuple[Entries, bytes, Inode | None]
    | tuple[Entries, Names]
    | tuple[set[bytes], bytes]
    | tuple[Inode, SavedMetadata]
)


class SourceRecord(NamedTuple):
    """What the manifest records about one layer (``sources`` list, in layer order; a
    NamedTuple: early.py)."""

    kind: str  # "tar", "files", ...
    path: str  # as written in the spec ("" for a files layer)
    sha256: str  # "sha256:<hex>": of the source file's bytes; files layer: of its canonical JSON
    # OCI: the image config for the manifest (not part of the source record itself)
    image_config: dict[str, Any] | None = None
    # registry images only: the spec's ref and the manifest (or index) digest it resolved to
    ref: str | None = None
    digest: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind, "path": self.path, "sha256": self.sha256}
        if self.ref is not None:  # only registry sources: the records of the others stay
            out["ref"] = self.ref
        if self.digest is not None:
            out["digest"] = self.digest
        return out


class Cancelled(Exception):
    """A layer's read stopped because its result is no longer wanted (``LayerContext.cancelled``)."""


class LayerContext:
    """Everything a source needs to apply one layer to the tree."""

    __slots__ = (
        "_changes",
        "_held_warnings",
        "_last_dir",
        "cancelled",
        "dir_mtime_ns",
        "index",
        "packs",
        "progress",
        "spec",
        "spec_dir",
        "tree",
        "upper",
    )

    def __init__(
        self,
        tree: Tree,
        spec: SpecDates,
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
        # OCI layers: resolved paths placed by this layer and their ancestors (whiteouts
        # only remove what lower layers made); None: not tracked
        self.upper: set[bytes] | None = None
        # the directory ``place`` resolved last: (its path components as given, the directory,
        # its resolved components). Archives list a directory's entries together, so most
        # entries reuse it. Valid while no entry is replaced or removed (only those can change
        # where an already resolved path leads): it is dropped then.
        self._last_dir: tuple[list[bytes], Inode, list[bytes]] | None = None
        # while a placement may still be undone (``begin_undoable``): the tree's changes,
        # and the warnings held back until it is kept
        self._changes: list[_Change] | None = None
        self._held_warnings: list[str] | None = None
        # set by another thread: the native read stops at its next segment (``Cancelled``)
        self.cancelled = False

    def begin_undoable(self) -> None:
        """Record every change to the tree, and hold warnings back, until ``commit`` or
        ``undo``: the native reader's members are placed while it still reads, and it may
        then hand the archive back to the Python reader, which places them all again."""
        self._changes = []
        self._held_warnings = []

    def commit(self) -> None:
        """Keep the changes since ``begin_undoable``; the warnings held back are given."""
        held = self._held_warnings or []
        self._changes = self._held_warnings = None
        for message in held:
            self.warn(message)

    def undo(self) -> None:
        """The tree as it was at ``begin_undoable``; the warnings held back are dropped."""
        changes = self._changes or []
        self._changes = self._held_warnings = None
        self._last_dir = None
        for change in reversed(changes):
            if len(change) == 2:
                target, value = change
                if isinstance(target, set):
                    target.discard(value)
                elif isinstance(target, Entries):
                    assert isinstance(value, Names)
                    for name in value:
                        del target[name]
                else:
                    assert isinstance(target, Inode) and isinstance(value, tuple)
                    target.restore_metadata(value)
                continue
            entries, name, old = change
            if old is None:
                del entries[name]
            else:
                entries[name] = old

    def warn(self, message: str) -> None:
        """A warning about the sources (something read differently from what it says, or
        skipped): through the build's progress, or on stderr without one."""
        if self._held_warnings is not None:
            self._held_warnings.append(message)
            return
        if self.progress is not None:
            self.progress.warn(message)
        else:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def resolve(self, path: str) -> Path:
        """A source path from the spec, relative to the spec file's directory."""
        return source_path(self.spec_dir, path)

    def _resolve_dir(
        self, parts: list[bytes], where: str, create: bool, mtime_of: Inode | None
    ) -> tuple[Inode, list[bytes]] | None:
        """The directory named by ``parts``, following symlinks INSIDE the image.

        A symlink's target is resolved as if the image root were ``/`` (an absolute target
        restarts at the image root, ``..`` stops there), like the kernel under chroot and
        umoci's securejoin. Missing directories are created when ``create`` (else: None),
        with ``mtime_of``'s mtime (0 without) unless the spec fixes one; a non-directory
        that is not a symlink is replaced by a directory. Returns the directory and its
        resolved path components.
        """
        node = self.tree.root
        # fast path: plain directories all the way
        for comp in parts:
            child = node.entries.get(comp)
            if child is None or child.type != FileType.DIR:
                break
            node = child
        else:
            return node, parts
        root = self.tree.root
        todo = list(reversed(parts))
        nodes: list[Inode] = [root]
        resolved: list[bytes] = []
        links = 0
        while todo:
            comp = todo.pop()
            if comp in (b"", b"."):
                continue
            node = nodes[-1]
            if comp == b"..":
                if resolved:
                    resolved.pop()
                    nodes.pop()
                continue
            child = node.entries.get(comp)
            if child is not None and child.type == FileType.SYMLINK:
                links += 1
                if links > MAX_SYMLINKS:
                    raise SourceError(
                        f"{where}: too many levels of symbolic links (more than {MAX_SYMLINKS})"
                    )
                if child.target.startswith(b"/"):
                    del nodes[1:]
                    resolved.clear()
                todo.extend(reversed(child.target.split(b"/")))
                continue
            if child is None or child.type != FileType.DIR:
                if not create:
                    return None
                check_name(comp, where)
                mtime = self.dir_mtime_ns
                if mtime is None:
                    mtime = 0 if mtime_of is None else mtime_of.mtime_ns
                if self._changes is not None:
                    self._changes.append((node.entries, comp, child))
                child = Inode(FileType.DIR, mode=0o755, mtime_ns=mtime)
                node.entries[comp] = child
            nodes.append(child)
            resolved.append(comp)
        return nodes[-1], resolved

    def place(self, path: bytes, inode: Inode, where: str) -> None:
        """Put ``inode`` at image path ``path`` (see the module docstring for the rules)."""
        parts = split_path(path)
        tree = self.tree
        ftype = inode.type
        if ftype is FileType.SYMLINK:
            target = inode.target
            if not target or len(target) >= PATH_MAX or b"\0" in target:
                raise SourceError(
                    f"{where}: invalid symlink target (empty, {PATH_MAX} bytes or longer,"
                    f" or containing NUL): {target[:40]!r}"
                )
        if not parts:
            if ftype is not FileType.DIR:
                raise SourceError(f"{where}: the image root can only be a directory")
            if self._changes is not None:
                self._changes.append((tree.root, tree.root.saved_metadata()))
            tree.root.take_metadata(inode)
            return
        dir_parts = parts[:-1]
        last = self._last_dir
        if last is not None and last[0] == dir_parts:
            _, node, resolved = last
        else:
            found = self._resolve_dir(dir_parts, where, True, inode)
            assert found is not None
            node, resolved = found
            self._last_dir = (dir_parts, node, resolved)
        name = parts[-1]
        if self.upper is not None:
            self._mark_upper(resolved, name)
        entries = node.entries
        old = entries.get(name)
        if old is None:
            check_name(name, where)
        elif ftype is FileType.DIR and old.type is FileType.DIR:
            if old is not inode:
                if self._changes is not None:
                    self._changes.append((old, old.saved_metadata()))
                old.take_metadata(inode)
            return
        else:
            self._last_dir = None  # an entry replaced: a resolved path may lead elsewhere now
        if ftype is FileType.REG:
            tree.set_content_aside(inode, self.packs.directory)
        if self._changes is not None:
            self._changes.append((entries, name, old))
        entries[name] = inode

    def ensure_dir(self, path: str | bytes, where: str) -> Inode:
        """The directory at ``path``, created (0755, root) if missing; symlinks followed."""
        self._last_dir = None  # a file in the way is replaced by a directory
        found = self._resolve_dir(split_path(path), where, True, None)
        assert found is not None
        if self.upper is not None and found[1]:
            self._mark_upper(found[1][:-1], found[1][-1])
        return found[0]

    def lookup(self, path: bytes) -> Inode | None:
        """The entry at ``path``: symlinks in its directories are followed (inside the image),
        the last component is not (a hard link to a symlink links the symlink)."""
        parts = split_path(path)
        if not parts:
            return self.tree.root
        found = self._resolve_dir(parts[:-1], str(path), False, None)
        return None if found is None else found[0].entries.get(parts[-1])

    def _mark_upper(self, resolved: list[bytes], name: bytes) -> None:
        upper = self.upper
        assert upper is not None
        key = b"/".join([*resolved, name])
        while key and key not in upper:
            if self._changes is not None:
                self._changes.append((upper, key))
            upper.add(key)
            key = key[: max(key.rfind(b"/"), 0)]

    def whiteout(self, path: bytes, where: str) -> None:
        """An OCI whiteout entry (``DIR/.wh.NAME`` or ``DIR/.wh..wh..opq``), as the OCI image
        spec and umoci apply it: remove NAME (or DIR's children) unless this same layer put
        it there; inside a directory this layer also wrote, remove what lower layers left."""
        self._last_dir = None  # entries are removed
        parts = split_path(path)
        if not parts:
            return
        name = parts[-1]
        found = self._resolve_dir(parts[:-1], where, False, None)
        if found is None:
            return  # nothing to hide
        node, resolved = found
        upper = self.upper if self.upper is not None else set()
        if name == OPAQUE:
            todo = [(node, resolved)]
        else:
            victim = name[len(WHITEOUT) :]
            if victim in (b"", b".", b"..") or victim.startswith(WHITEOUT):
                raise SourceError(f"{where}: invalid whiteout {name!r}")
            check_name(victim, where)
            child = node.entries.get(victim)
            if child is None:
                return
            if b"/".join([*resolved, victim]) not in upper:
                if self._changes is not None:
                    self._changes.append((node.entries, victim, child))
                del node.entries[victim]
                return
            if child.type != FileType.DIR:
                return
            todo = [(child, [*resolved, victim])]
        while todo:
            d, dpath = todo.pop()
            for cname, child in list(d.entries.items()):
                cpath = [*dpath, cname]
                if b"/".join(cpath) not in upper:
                    if self._changes is not None:
                        self._changes.append((d.entries, cname, child))
                    del d.entries[cname]
                elif child.type == FileType.DIR:
                    todo.append((child, cpath))
