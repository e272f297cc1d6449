"""The soak of issue 22 (tests/soak.py): 8 mounts of one remote bundle behind a
fault-injecting proxy, readers checking every byte, the server killed with SIGKILL 20
times in 2 minutes (fuse, on the host). BUI_SOAK_SECONDS / BUI_SOAK_KILLS shorten it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_ublkd import UBLKD
from test_ublkd import no_leftovers as no_leftovers  # noqa: F401  (a fixture)

from tests.soak import run_soak


@pytest.mark.root
@pytest.mark.slow
def test_soak_kills_and_faults_lose_no_read(no_leftovers: Path) -> None:
    assert UBLKD is not None
    seconds = float(os.environ.get("BUI_SOAK_SECONDS", "120"))
    kills = int(os.environ.get("BUI_SOAK_KILLS", "20"))
    r = run_soak(UBLKD, no_leftovers / "soak", seconds=seconds, kills=kills)
    print(r["status_text"])
    assert r["kills"] == kills
    assert r["hung_readers"] == 0
    assert r["failed_reads"] == 0, r["failed_examples"]
    assert r["wrong_bytes"] == 0
    assert r["reads"] > 100
    # every fault shows in status: the restarts with their cause, and each kind the proxy
    # injected in the server's counters (which go on across restarts)
    assert r["restarts"]["count"] == kills and r["restarts"]["last_cause"] == "killed by SIGKILL"
    faults, st = r["proxy_faults"], r["status"]
    assert faults["drop"] > 0 and faults["corrupt"] > 0 and faults["stall"] > 0, faults
    assert st["fetch_errors"] > 0 and st["verify_failures"] > 0, st
    assert st["fetch_latency_us_max"] >= 1_000_000, st  # a stall (1.5 s) was waited out
    assert st["read_errors"] == 0, st
