"""Step 1 of the writer (``writer``): inode numbers, dir indexes and the names of each
inode (``number``), natively (native/src/numbering.rs) when the extension has it."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator

from btrfs_ublk_native import Names, Rows

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.layout import (
    BaseLayout,
)
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.tree import FileType, Inode, Tree


class Numbering:
    """Inode numbers and the names that point at each inode.

    Kept as flat arrays, one row per inode in number order: an image's writer holds
    them for every entry at once, so a row costs a few machine words, not objects.
    Without a base an inode's number is its row (+ FIRST_FREE_OBJECTID); ``Inode.ino``
    holds it only for directories and hardlinked files (``once`` marks every other
    inode), and a directory's new children (those not named earlier) take consecutive
    numbers from ``child_base``, so ``child_inos`` finds every child's number without an
    int object per inode. With a base numbers have gaps: ``inos`` holds each row's and
    ``Inode.ino`` every inode's.
    """

    __slots__ = (
        "child_base",
        "dir_indexes",
        "index",
        "inodes",
        "inos",
        "more_refs",
        "name",
        "once",
        "parent",
    )

    def __init__(self, root: Inode, once: object) -> None:
        self.once = once  # this numbering's mark of an inode with one name
        # row -> inode: the natively numbered rows name a directory's entries and a slot
        # (no object for a child held inline there); reading a row from Python promotes it
        self.inodes = Rows([root])
        self.inos: array[int] | None = None  # row -> inode number, with a base
        # with a base: dir ino -> its entries' dir indexes in name order (else 2, 3, ...)
        self.dir_indexes: dict[int, array[int]] = {}
        # the first name of each inode: parent dir's ino, dir index, name
        self.parent = array("Q", [d.FIRST_FREE_OBJECTID])
        self.index = array("Q", [0])
        self.name = Names([b".."])
        # hardlinks: ino -> its other names (parent ino, index, name)
        self.more_refs: dict[int, list[tuple[int, int, bytes]]] = {}
        self.child_base: dict[int, int] = {}  # dir ino -> the number of its first new child

    def refs(self, n: int, ino: int) -> list[tuple[int, int, bytes]]:
        """Every name of inode ``ino`` (row ``n``)."""
        return [(self.parent[n], self.index[n], self.name[n]), *self.more_refs.get(ino, ())]

    def child_inos(self, dir_ino: int, children: Iterable[Inode]) -> Iterator[int]:
        """The numbers of a directory's children, given in sorted name order."""
        if self.inos is not None:  # with a base: every inode holds its number
            for child in children:
                assert isinstance(child.ino, int)
                yield child.ino
            return
        once, k = self.once, self.child_base[dir_ino]
        for child in children:
            ino = child.ino
            if ino is once:
                yield k
                k += 1
                continue
            assert isinstance(ino, int)
            if ino == k:  # numbered here (a directory, or a hardlink's first name)
                k += 1
            yield ino


def number(tree: Tree, base: BaseLayout | None = None) -> Numbering:
    """DFS, sorted names; a directory's new children take consecutive numbers when it is
    reached; a hardlink reuses its inode's number. With a base: see ``number_on_base``."""
    # pass 1: which inodes have more than one name (marks of this run: whatever ``ino``
    # held before is overwritten)
    once, more = object(), object()
    root = tree.root
    nat = native.module()
    # both passes in the extension (native/src/numbering.rs): the same columns and errors
    if nat is not None and base is None and hasattr(nat, "number_inodes"):
        num = Numbering(root, once)
        nat.number_inodes(root, num, more)
        return num
    if nat is not None and base is not None and hasattr(nat, "number_on_base"):
        num = Numbering(root, once)
        nat.number_on_base(root, num, more, base.dirs, base.max_ino)
        return num
    root.ino = once
    stack = [root]
    while stack:
        for name, child in stack.pop().entries.items():
            mark = child.ino
            if mark is once:
                if child.type is FileType.DIR:
                    raise ImageError(
                        f"directory {name!r} appears twice in the tree (hardlinked dir)"
                    )
                child.ino = more
            elif mark is not more:
                child.ino = once
                if child.type is FileType.DIR:
                    stack.append(child)
    # pass 2: numbers
    first = d.FIRST_FREE_OBJECTID
    root.ino = first
    num = Numbering(root, once)
    if base is not None:
        return number_on_base(num, base, more)
    inodes, parents, indexes, names = num.inodes, num.parent, num.index, num.name
    dirs = [(root, first)]
    while dirs:
        parent, pino = dirs.pop()
        entries = parent.entries
        num.child_base[pino] = first + len(inodes)
        pending: list[tuple[Inode, int]] = []
        for index, name in enumerate(sorted(entries), start=2):
            child = entries[name]
            mark = child.ino
            if mark is not once and mark is not more:  # numbered already: another name
                assert isinstance(mark, int)
                num.more_refs.setdefault(mark, []).append((pino, index, name))
                continue
            ino = first + len(inodes)
            if child.type is FileType.DIR:
                child.ino = ino
                pending.append((child, ino))
            elif mark is more:
                child.ino = ino
            inodes.append(child)
            parents.append(pino)
            indexes.append(index)
            names.append(name)
        dirs.extend(reversed(pending))
    return num


def number_on_base(num: Numbering, base: BaseLayout, more: object) -> Numbering:
    """Pass 2 of ``number`` with a base: a name the base has (same parent directory,
    same name) keeps its dir index, and its inode keeps the base's number unless an
    inode reached earlier took it (hardlinks split). A new inode takes the number and dir
    index of a name its directory lost (the removed names', in name order, to the new
    names, in name order; only numbers the base gave one name), so a renamed or re-added
    file's items stay where the base had them in the fs tree instead of moving to its end;
    other new names get dir indexes after the highest of their directory in the base,
    their inodes numbers after the base's highest. Same DFS as without a base. The
    reference (and ``BUI_NATIVE=0``'s path) for numbering.rs's ``number_on_base``."""
    once, first = num.once, d.FIRST_FREE_OBJECTID
    inodes, parents, indexes, names = num.inodes, num.parent, num.index, num.name
    inos = array("Q", [first])
    taken = {first}
    next_ino = max(base.max_ino, first) + 1
    named = Counter(ino for entries in base.dirs.values() for ino, _ in entries.values())
    dirs: list[tuple[Inode, int]] = [(inodes[0], first)]
    while dirs:
        parent, pino = dirs.pop()
        entries = parent.entries
        old = base.dirs.get(pino)  # the same path's directory in the base, if it was one
        next_index = 2 if not old else max(i for _, i in old.values()) + 1
        pending: list[tuple[Inode, int]] = []
        dir_indexes = num.dir_indexes[pino] = array("Q")
        # (number, dir index) of the names this directory lost, popped from the end
        freed = (
            []
            if old is None
            else [was for n, was in sorted(old.items()) if n not in entries and named[was[0]] == 1]
        )
        freed.reverse()
        for name in sorted(entries):
            child = entries[name]
            was = None if old is None else old.get(name)
            mark = child.ino
            numbered = mark is not once and mark is not more  # another name's inode
            lost = None
            if was is None and not numbered:
                while freed and freed[-1][0] in taken:
                    freed.pop()
                lost = freed.pop() if freed else None
            if was is not None:
                index = was[1]
            elif lost is not None:
                index = lost[1]
            else:
                index, next_index = next_index, next_index + 1
            dir_indexes.append(index)
            if numbered:
                assert isinstance(mark, int)
                num.more_refs.setdefault(mark, []).append((pino, index, name))
                continue
            if was is not None and was[0] not in taken:
                ino = was[0]
            elif lost is not None:
                ino = lost[0]
            else:
                ino, next_ino = next_ino, next_ino + 1
            taken.add(ino)
            child.ino = ino
            if child.type is FileType.DIR:
                pending.append((child, ino))
            inodes.append(child)
            inos.append(ino)
            parents.append(pino)
            indexes.append(index)
            names.append(name)
        dirs.extend(reversed(pending))
    # rows in number order: the fs tree's items are made in that order
    order = sorted(range(len(inos)), key=inos.__getitem__)
    num.inodes = Rows(inodes[i] for i in order)
    num.inos = array("Q", [inos[i] for i in order])
    num.parent = array("Q", [parents[i] for i in order])
    num.index = array("Q", [indexes[i] for i in order])
    num.name = Names(names[i] for i in order)
    return num
