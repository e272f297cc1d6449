"""Host-side unit tests of the VM harness pieces that need no VM."""

from __future__ import annotations

from pathlib import Path

import pytest

from bundletools import load_vm_harness

pytestmark = pytest.mark.unit


h = load_vm_harness()

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="tests.vm.test_a" name="test_ok" time="0.5"/>
<testcase classname="tests.vm.test_a" name="test_bad" time="1.0">
  <failure message="AssertionError: nope">assert 1 == 2</failure>
  <system-out>printed by the test</system-out>
</testcase>
<testcase classname="tests.vm.test_a" name="test_err" time="0"><error message="fixture"/></testcase>
<testcase classname="tests.vm.test_a" name="test_skip" time="0"><skipped message="why"/></testcase>
</testsuite></testsuites>
"""


def test_parse_junit(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    cases = h.parse_junit(tmp_path / "junit.xml")
    assert [(c.nodeid.split("::")[1], c.outcome) for c in cases] == [
        ("test_ok", "passed"),
        ("test_bad", "failed"),
        ("test_err", "error"),
        ("test_skip", "skipped"),
    ]
    assert "AssertionError: nope" in cases[1].message
    assert "printed by the test" in cases[1].message
    assert h.parse_junit(tmp_path / "missing.xml") == []
    (tmp_path / "broken.xml").write_text("<testsuites")
    assert h.parse_junit(tmp_path / "broken.xml") == []


def test_qemu_command_has_the_recipe_fixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUI_VM_ACCEL", raising=False)
    monkeypatch.delenv("BUI_VM_ICOUNT", raising=False)
    a = h.Assets("6.12.0-test", tmp_path / "vmlinuz", tmp_path / "modules", tmp_path / "i.gz")
    cmd = h.qemu_command(a, tmp_path / "share")
    line = " ".join(cmd)
    assert cmd[cmd.index("-accel") + 1] == "tcg,thread=single"
    assert "microvm,acpi=on" in cmd
    append = cmd[cmd.index("-append") + 1]
    assert "tsc=reliable" in append and "tsc_early_khz=" in append
    assert f"vm.mods={tmp_path / 'modules'}" in append
    assert "readonly=on" in line and f"path={tmp_path / 'share'}" in line


def test_accel_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = h.Assets("6.12.0-test", tmp_path / "vmlinuz", tmp_path / "modules", tmp_path / "i.gz")
    monkeypatch.setenv("BUI_VM_ACCEL", "tcg,thread=multi")
    cmd = h.qemu_command(a, tmp_path / "share")
    assert cmd[cmd.index("-accel") + 1] == "tcg,thread=multi"
    monkeypatch.setenv("BUI_VM_ACCEL", "")  # set but empty: the default, not an empty flag
    assert h.qemu_command(a, tmp_path / "share")[cmd.index("-accel") + 1] == "tcg,thread=single"


def test_icount_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = h.Assets("6.12.0-test", tmp_path / "vmlinuz", tmp_path / "modules", tmp_path / "i.gz")
    monkeypatch.delenv("BUI_VM_ICOUNT", raising=False)
    assert "-icount" not in h.qemu_command(a, tmp_path / "share")
    monkeypatch.setenv("BUI_VM_ICOUNT", "shift=3,sleep=off")
    cmd = h.qemu_command(a, tmp_path / "share")
    assert cmd[cmd.index("-icount") + 1] == "shift=3,sleep=off"


def test_summary_of_a_failed_run(tmp_path: Path) -> None:
    share = tmp_path / "share"
    share.mkdir()
    (share / "junit.xml").write_text(JUNIT)
    (share / "dmesg.txt").write_text("[ 1.0] boot\n[ 9.9] ublk: something odd\n")
    (share / "uname").write_text("6.12.95+deb12-amd64\n")
    res = h.RunResult(out=tmp_path, rc=1)
    res.boots.append(h.Boot(attempt=1, console=tmp_path / "c.log", status="ok", boot_s=5))
    text = h.summary(res)
    assert "kernel 6.12.95+deb12-amd64" in text
    assert "FAILED  tests.vm.test_a::test_bad" in text
    assert "AssertionError: nope" in text
    assert "ublk: something odd" in text


def test_summary_of_a_boot_hang(tmp_path: Path) -> None:
    (tmp_path / "c.log").write_text("[ 0.1] Linux version 6.12\n[ 0.2] stuck here\n")
    res = h.RunResult(out=tmp_path, rc=None)
    for n in (1, 2):
        res.boots.append(
            h.Boot(attempt=n, console=tmp_path / "c.log", status="boot-hang", reason="no init")
        )
    text = h.summary(res)
    assert "boot 1: boot-hang: no init; boot 2: boot-hang: no init" in text
    assert "stuck here" in text  # console tail when the VM never finished
    assert h.Boot(1, tmp_path, status="boot-hang").retryable
    assert not h.Boot(1, tmp_path, status="boot-fail", init_failed=True).retryable
    assert h.Boot(1, tmp_path, status="boot-fail").retryable
