"""Listings of a container's root filesystem and of a directory tree, to compare them
(tests/test_containerd.py, tests/test_podman.py): find(1)'s path, type, mode, owner,
group, size and link target of every entry, and the sha256 of every regular file.

A container's listing is taken inside it by one shell command (`LIST_COMMAND`), whose
output `parse_container` splits; paths the runtime mounts over (/proc, /dev, ...) are
left out of both sides, since the image's entries there are hidden in the container.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

FIND_FORMAT = r"%P\t%y\t%m\t%U\t%G\t%s\t%l\n"
# run inside the container: listing, ==, its mount table, ==, file digests
LIST_COMMAND = (
    f"find / -xdev -printf '{FIND_FORMAT}'; echo ==; cat /proc/self/mountinfo; echo ==; "
    "find / -xdev -type f -print0 | xargs -0 sha256sum"
)

Listing = dict[str, str]


def hidden(path: str, mounted: set[str]) -> bool:
    return any(path == m or path.startswith(m + "/") for m in mounted)


def parse_find(text: str, mounted: set[str]) -> Listing:
    out = {}
    for line in text.splitlines():
        path, kind, mode, uid, gid, size, target = line.split("\t")
        if not path or hidden(path, mounted):
            continue
        if kind == "d":
            size = "-"  # a directory's size is the filesystem's business
        out[path] = "\t".join((kind, mode, uid, gid, size, target))
    return out


def parse_sums(text: str, prefix: str, mounted: set[str]) -> Listing:
    out = {}
    for line in text.splitlines():
        digest, path = line.split("  ", 1)
        path = path.removeprefix(prefix)
        if not hidden(path, mounted):
            out[path] = digest
    return out


def parse_container(output: str) -> tuple[Listing, Listing, set[str]]:
    """LIST_COMMAND's output -> (listing, file digests, paths mounted over)."""
    listing, mountinfo, sums = output.split("==\n")
    mounted = {line.split()[4].lstrip("/") for line in mountinfo.splitlines()} - {""}
    return parse_find(listing, mounted), parse_sums(sums, "/", mounted), mounted


def tree_listing(root: Path, mounted: set[str]) -> tuple[Listing, Listing]:
    """The same of a directory tree, without what lies at or under ``mounted``."""

    def run(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    listing = run("find", str(root), "-printf", FIND_FORMAT)
    sums = run("sh", "-c", f"cd {root} && find . -type f -print0 | xargs -0 sha256sum")
    return parse_find(listing, mounted), parse_sums(sums, "./", mounted)
