"""CRC-32C: the ``crc32c`` package's C function, loaded without the package's ``__init__``.

That ``__init__`` imports ``importlib.metadata`` (and through it email, zipfile, socket,
calendar, ...: ~45 modules) only to set ``__version__``: 30-60 ms of every command's
start, and more with a cold page cache (the Debian build reads its modules cold).
The extension module ``crc32c._crc32c`` is found and loaded on its own and registered
under its name, so a later ``import crc32c`` (tests) reuses it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Protocol


class _Crc32c(Protocol):
    def __call__(
        self, data: bytes | bytearray | memoryview, value: int = 0, gil_release_mode: int = -1, /
    ) -> int: ...


def _load() -> ModuleType:
    name = "crc32c._crc32c"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    pkg = importlib.machinery.PathFinder.find_spec("crc32c")
    spec = None
    if pkg is not None and pkg.submodule_search_locations:
        spec = importlib.machinery.PathFinder.find_spec(name, pkg.submodule_search_locations)
    if spec is None or spec.loader is None:  # laid out differently: the ordinary import
        import crc32c

        return sys.modules.get(name) or crc32c
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


crc32c: _Crc32c = _load().crc32c
