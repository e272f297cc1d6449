"""`ublkd ublk-null`, the benchmarks' ublk transport ceiling (docs/benchmarks.md): inside the
VM only (marker `vm`)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.test_ublkd import first_line, gone, ublk_ctrl, ublkd_binary

pytestmark = pytest.mark.vm


# off: libublk's loop, one queue per CPU (2 here); auto (the default): ublkd's poll loop
# with its adaptive window, one queue; --ublk-poll=1000 s: SIGTERM arrives while the
# queue thread spins, never in its sleep
@pytest.mark.parametrize(
    ("poll", "queues"),
    [(["--ublk-poll=off"], 2), ([], 1), (["--ublk-poll=1000000000"], 1)],
    ids=["sleep", "auto", "poll"],
)
def test_ublk_null_serves_reads_and_sigterm_deletes_it(poll: list[str], queues: int) -> None:
    exe = ublkd_binary()
    assert exe is not None
    subprocess.run(["modprobe", "ublk_drv"], check=True)
    p = subprocess.Popen(
        [exe, "ublk-null", "--size-mb", "8", "--threads", "2", *poll],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        dev = Path(first_line(p, "ublkd ublk-null printed no device").strip())
        assert dev.name.startswith("ublkb"), dev
        ctrl = ublk_ctrl(dev)
        size = subprocess.run(
            ["blockdev", "--getsize64", str(dev)], check=True, capture_output=True, text=True
        ).stdout
        assert int(size) == 8 << 20
        assert (Path("/sys/block") / dev.name / "ro").read_text().strip() == "1"
        # (the kernel gives at most one queue per CPU)
        hw_queues = len(list((Path("/sys/block") / dev.name / "mq").iterdir()))
        assert hw_queues == min(queues, os.cpu_count() or 1)
        # every read completes at once: the whole device with O_DIRECT
        subprocess.run(
            ["dd", f"if={dev}", "of=/dev/null", "bs=64k", "iflag=direct", "status=none"],
            check=True,
            timeout=120,
        )
        # SIGTERM (the signal thread, not the one that built the device) kills and deletes it
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, p.stderr.read()
        assert gone(dev), f"{dev} still exists after SIGTERM"
        assert gone(ctrl), f"{ctrl} still exists after SIGTERM"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
