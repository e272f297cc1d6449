"""Shared pytest configuration for the whole test suite."""

from __future__ import annotations

import os

import pytest


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
