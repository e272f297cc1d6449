"""Image path globs (``remove:``, ``include``/``exclude``): one syntax, compiled to byte regexes.

A pattern is an image path (the leading ``/`` is optional, a trailing ``/`` is ignored)
whose components may hold ``*`` (any run of characters but ``/``), ``?`` (one character
but ``/``) and ``[...]`` / ``[!...]`` (a character class). A component that is exactly
``**`` matches any number of whole components: zero or more in the middle
(``/usr/**/*.pyc``), one or more at the end (``/usr/share/doc/**`` is everything
UNDER doc, not doc itself). Wildcards match names starting with ``.`` too.
Patterns match whole paths.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from btrfs_ublk_image.tree import split_path


def _component(comp: str) -> str:
    out: list[str] = []
    i, n = 0, len(comp)
    while i < n:
        c = comp[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and comp[j] in "!^":
                j += 1
            if j < n and comp[j] == "]":
                j += 1
            while j < n and comp[j] != "]":
                j += 1
            if j >= n:
                raise ValueError(f"unterminated character class in {comp!r}")
            body = comp[i + 1 : j]
            neg = body[:1] in ("!", "^")
            if neg:
                body = body[1:]
            body = body.replace("\\", "\\\\").replace("/", "")
            out.append(("[^/" if neg else "[") + body + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_glob(pattern: str) -> re.Pattern[bytes]:
    """The regex matching exactly the image paths (``/a/b``, bytes) that ``pattern`` names."""
    if "\0" in pattern:
        raise ValueError("pattern contains a NUL character")
    comps = [c for c in pattern.split("/") if c not in ("", ".")]
    if not comps:
        raise ValueError(f"pattern {pattern!r} names no path (the image root cannot be matched)")
    if ".." in comps:
        raise ValueError(f"pattern {pattern!r} contains '..'")
    parts: list[str] = []
    for i, comp in enumerate(comps):
        if comp == "**":
            parts.append("(?:/[^/]+)+" if i == len(comps) - 1 else "(?:/[^/]+)*")
        else:
            parts.append("/" + _component(comp))
    regex = "".join(parts)
    try:
        return re.compile(regex.encode("utf-8", "surrogateescape"), re.DOTALL)
    except re.error as e:
        raise ValueError(f"invalid pattern {pattern!r}: {e}") from None


class PathSet:
    """Several globs: does a path match one of them?"""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = list(patterns)
        self._regexes = [compile_glob(p) for p in patterns]

    def __bool__(self) -> bool:
        return bool(self._regexes)

    def match(self, path: bytes) -> bool:
        """``path`` is normalized (``/a/b``)."""
        return any(r.fullmatch(path) for r in self._regexes)

    def match_or_parent(self, path: bytes) -> bool:
        """``path`` or one of its ancestors matches."""
        regexes = self._regexes
        p = path
        while p:
            if any(r.fullmatch(p) for r in regexes):
                return True
            p = p[: p.rfind(b"/")]
        return False


def normalize(path: bytes) -> bytes:
    """``a/./b//c/`` -> ``/a/b/c`` (``..`` resolved lexically inside the root)."""
    return b"/" + b"/".join(split_path(path))


def selector(
    include: Sequence[str] | None, exclude: Sequence[str]
) -> Callable[[bytes], bool] | None:
    """A predicate on normalized image paths: keep the entry? None when everything is kept."""
    inc = PathSet(include) if include is not None else None
    exc = PathSet(exclude)
    if inc is None and not exc:
        return None

    def keep(path: bytes) -> bool:
        if inc is not None and not inc.match_or_parent(path):
            return False
        return not (exc and exc.match_or_parent(path))

    return keep
