"""Shared pytest configuration for the whole test suite."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources import SourceRecord, build_tree
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Tree


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `vm` need the ublk-capable guest kernel: run them only inside the VM.

    The guest's run script (tests/vm/harness.py) sets BUI_IN_VM=1; on the host,
    tests/test_vm.py boots the VM and runs `pytest -m vm` there (see tests/vm/README.md).
    """
    if os.environ.get("BUI_IN_VM") == "1":
        return
    vm = [it for it in items if it.get_closest_marker("vm") is not None]
    if vm:
        config.hook.pytest_deselected(items=vm)
        items[:] = [it for it in items if it.get_closest_marker("vm") is None]


@pytest.fixture
def packs(tmp_path: Path) -> Iterator[PackWriter]:
    """A pack writer in tmp_path that keeps content up to 64 bytes inline (bigger goes to a Blob)."""
    d = tmp_path / "packs"
    d.mkdir()
    writer = PackWriter(str(d), keep_inline=64)
    yield writer
    writer.abort()


@pytest.fixture
def build(tmp_path: Path, packs: PackWriter) -> Callable[[str], tuple[Tree, list[SourceRecord]]]:
    """build(spec_yaml) -> (tree, records): writes tmp_path/spec.yaml, loads it, runs the sources."""

    def run(text: str) -> tuple[Tree, list[SourceRecord]]:
        path = tmp_path / "spec.yaml"
        path.write_text(text)
        return build_tree(load_spec(path), path, packs)

    return run
