"""Shared pytest configuration for the whole test suite."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `vm` need the ublk-capable guest kernel: run them only inside the VM.

    tests/vm/init.sh sets BUI_IN_VM=1 in the guest; on the host, tests/test_vm.py boots the VM
    and runs `pytest -m vm` there (see tests/vm/README.md).
    """
    if os.environ.get("BUI_IN_VM") == "1":
        return
    keep = [it for it in items if it.get_closest_marker("vm") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep
