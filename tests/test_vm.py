"""Host side of the VM suite: boot ONE VM and run every test marked `vm` inside it.

This host's kernel has no ublk, so the ublk tests run under QEMU (tests/vm/harness.py, see
tests/vm/README.md). A VM that cannot boot is a failure with the reason, never a skip.
"""

from __future__ import annotations

import os
import shlex

import pytest

from bundletools import load_vm_harness

pytestmark = pytest.mark.root


harness = load_vm_harness()


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
