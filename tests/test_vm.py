"""Host side of the VM suite: boot ONE VM and run every test marked `vm` inside it.

This host's kernel has no ublk, so the ublk tests run under QEMU (tests/vm/harness.py, see
tests/vm/README.md). A VM that cannot boot is a failure with the reason, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.root


def _load_harness() -> ModuleType:
    """tests/vm/harness.py by path: works whatever pytest's import mode and rootdir."""
    name = "bui_vm_harness"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "vm/harness.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


harness = _load_harness()


@pytest.mark.skipif(os.environ.get("BUI_IN_VM") == "1", reason="already inside the VM")
def test_vm_suite(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        res = harness.run_pytest(shlex.split(os.environ.get("BUI_VM_PYTEST_ARGS", "")))
    except harness.VMError as e:
        pytest.fail(f"VM assets could not be prepared: {e}", pytrace=False)
    report = harness.summary(res)
    if res.ok:
        with capsys.disabled():  # CI output lists each guest test on success too
            print("\n" + report)
    if res.rc is None:
        pytest.fail(f"the VM did not complete its run: {res.failure_reason()}\n{report}", False)
    cases = harness.parse_junit(res.share / "junit.xml")
    if not cases:
        pytest.fail(f"no guest test results: {res.failure_reason()}\n{report}", False)
    bad = [c.nodeid for c in cases if c.outcome in ("failed", "error")]
    if res.rc != 0 or bad:
        pytest.fail(f"guest tests failed: {bad or res.failure_reason()}\n{report}", False)
