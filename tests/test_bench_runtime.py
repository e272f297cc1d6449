"""The runtime benchmark's own code (bench/fio.py, bench/report.py runtime sections, the VM
script): fio job matrix and JSON parsing, tables, docs sections. Not a speed test."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench.build import main as bench_main  # noqa: E402
from bench.fio import MATRIX, FioJob, fio_args, parse_fio_json  # noqa: E402
from bench.report import (  # noqa: E402
    laziness_section,
    mount_section,
    mount_table,
    randread_section,
    randread_table,
    remote_section,
)
from bench.runtime import (  # noqa: E402
    INTERLEAVED,
    VM_INTERLEAVED,
    parse_cpu,
    parse_queues,
    randread_schedule,
    vm_job_result,
    vm_script,
)

pytestmark = pytest.mark.unit

# trimmed from real `fio --output-format=json` output (fio 3.33), with a warning before it
FIO_OUT = "fio: note: both iodepth >= 1 and synchronous I/O engine are selected\n" + json.dumps(
    {
        "fio version": "fio-3.33",
        "jobs": [
            {
                "jobname": "randread",
                "error": 0,
                "read": {
                    "iops": 12345.5,
                    "bw_bytes": 50567168,
                    "clat_ns": {"percentile": {"50.000000": 70144, "99.000000": 181248}},
                },
            }
        ],
    },
    indent=2,
)


def test_fio_matrix_args_and_parse() -> None:
    names = [j.name for j in MATRIX]
    assert names == [
        "io_uring-qd1-j1", "io_uring-qd1-j2", "io_uring-qd16-j1", "io_uring-qd16-j2",
        "psync-j1", "psync-j2",
    ]  # fmt: skip
    args = fio_args(FioJob("io_uring", 16, 2), "/m/f", 3)
    assert "--direct=1" in args and "--bs=4k" in args and "--rw=randread" in args
    assert "--iodepth=16" in args and "--numjobs=2" in args and "--runtime=3" in args
    assert "--readonly" in args and "--filename=/m/f" in args

    r = parse_fio_json(FIO_OUT)
    assert r.iops == 12345.5 and r.mib_s == pytest.approx(48.22, abs=0.01)
    assert r.lat_p50_us == pytest.approx(70.144) and r.lat_p99_us == pytest.approx(181.248)
    assert parse_fio_json(FIO_OUT.split("\n", 1)[1]).iops == 12345.5
    with pytest.raises(ValueError):
        parse_fio_json("fio: error\n")


def _mount_result(label: str, walls: list[float] | None, error: str | None = None) -> Any:
    if walls is None:
        return {"label": label, "error": error}
    med = sorted(walls)[len(walls) // 2]
    return {"label": label, "wall_min_s": min(walls), "wall_median_s": med,
            "wall_plus_sync_median_s": med + 1.0, "error": None}  # fmt: skip


def _doc() -> dict[str, Any]:
    iops = {"ours_fuse": 9000.0, "btrfs_loop": 10000.0, "erofs_loop": 20000.0,
            "squashfuse": 4500.0, "ours_ublk": 800.0}  # fmt: skip
    rr = {
        "image": "synthetic", "file": "large/blob-0.bin", "file_bytes": 64 << 20,
        "ours_cache_mb": 256, "runtime_s": 3.0, "errors": {},
        "targets": {t: {j.name: {"iops": iops[t]} for j in MATRIX[:2]}
                    for t in ("ours_fuse", "btrfs_loop", "erofs_loop", "squashfuse")},
    }  # fmt: skip
    rr["targets"]["squashfuse"]["io_uring-qd1-j2"] = {"error": "boom"}
    vm = {
        "kernel": "6.12.0", "file": "large/blob-0.bin", "file_bytes": 64 << 20,
        "runtime_s": 2.0, "errors": {"ours_fuse": "not run"},
        "rounds": 2,
        "targets": {"ours_ublk": {"psync-j1": {"iops": 800.0}},
                    "btrfs_loop": {"psync-j1": {"iops": 1000.0}},
                    "btrfs_loop_off": {"psync-j1": {"iops": 500.0}},
                    "btrfs_loop_poll": {"psync-j1": {"iops": 1000.0}},
                    "null_ublk": {"psync-j1": {"iops": 1500.0}},
                    "ours_ublk_raw": {"psync-j1": {"iops": 1200.0}},
                    "loop_raw": {"psync-j1": {"iops": 2000.0}},
                    "null_ublk_poll": {"psync-j1": {"iops": 1800.0}},
                    "ours_ublk_poll_raw": {"psync-j1": {"iops": 1600.0}},
                    "ours_ublk_poll": {"psync-j1": {"iops": 950.0}},
                    "ours_ublk_off_raw": {"psync-j1": {"iops": 600.0}},
                    "ours_ublk_off": {"psync-j1": {"iops": 400.0}}},
        "queues": {"null_ublk": {"scheduler": "none", "nr_hw_queues": "2", "nr_requests": "64"}},
        "server_cpu": {"null_ublk_poll": {"psync-j1": 0.42},
                       "ours_ublk": {"idle": 0.001, "sparse200": 0.12}},
    }  # fmt: skip
    return {
        "command": "bench/run --quick",
        "machine": {"date": "today", "nproc": 2},
        "mount": {
            "repeats": 3,
            "images": {
                "debian": {
                    "label": "Debian minbase",
                    "entries": 6000,
                    "content_bytes": 200 << 20,
                    "probe": "usr/bin/dpkg",
                    "results": {
                        "ours": _mount_result("ours", [0.05, 0.04, 0.06]),
                        "tar_x": _mount_result("tar -x", [0.5, 0.4, 0.6]),
                        "erofs": _mount_result("erofs", None, "OSError: EINVAL"),
                    },
                },
            },
        },  # fmt: skip
        "laziness": {
            "image": "debian",
            "pack_bytes_total": 200 << 20,
            "one_mib_file": "x",
            "steps": [
                {
                    "step": "mount",
                    "what": "ublkd mount",
                    "reads": 2,
                    "bytes_served": 8192,
                    "chunks_verified": 1,
                    "pack_bytes_read": 350_000,
                    "cache_hits": 1,
                },
                {
                    "step": "read_1mib",
                    "what": "read /x",
                    "reads": 1,
                    "bytes_served": 1 << 20,
                    "chunks_verified": 2,
                    "pack_bytes_read": 2 << 20,
                    "cache_hits": 0,
                },
            ],
        },  # fmt: skip
        "randread": rr,
        "randread_vm": vm,
    }


def test_runtime_tables_and_sections() -> None:
    doc = _doc()
    mt = mount_table(doc["mount"]["images"]).splitlines()
    assert len(mt) == 2 + 3
    assert "| 50.0 |" in mt[2] and mt[2].endswith("| 1.00x |")
    assert mt[3].endswith("| 10.00x |")  # tar -x median 0.5 s / ours 0.05 s
    assert "OSError: EINVAL" in mt[4]
    assert "`/usr/bin/dpkg`" in mount_section(doc)

    rt = randread_table(
        doc["randread"], [("ours_fuse", "btrfs_loop"), ("ours_fuse", "squashfuse")]
    ).splitlines()
    assert len(rt) == 2 + 2
    assert "9,000" in rt[2] and "| 0.90x | 2.00x |" in rt[2]
    assert "failed" in rt[3] and rt[3].endswith("| 0.90x |  |")
    sec = randread_section(doc)
    assert "6.12.0" in sec and "VM ours_fuse: not run" in sec
    # through btrfs: ours ublk (auto) / loop, ours ublk off / the loop runs beside it, ours
    # ublk --ublk-poll / the loop runs beside it (no fuse row: not run)
    assert "| psync-j1 | 800 | 400 | 950 | 1,000 | 500 | 1,000 | 0.80x | 0.80x | 0.95x |" in sec
    # the raw-device table: null / loop, null poll / loop, ours raw / loop, ours raw off /
    # loop, ours raw poll / loop, ours raw off / null; queue settings; the servers' CPU
    assert "| 0.75x | 0.90x | 0.60x | 0.30x | 0.80x | 0.40x |" in sec, sec
    assert "best of 2 rounds" in sec
    assert "`-accel tcg,thread=single`: absolute figures" in sec and "icount" not in sec
    doc["randread_vm"]["accel"], doc["randread_vm"]["icount"] = (
        "tcg,thread=single",
        "shift=3,sleep=off",
    )
    ic = randread_section(doc)
    assert "`-icount shift=3,sleep=off`, the guest's clock counting its instructions" in ic
    assert "per host second): absolute figures" in ic
    assert "null ublk: hw queues 2, scheduler none, nr_requests 64" in sec
    assert "null ublk poll psync-j1 0.42" in sec
    assert "ours ublk idle 0.00, sparse200 0.12" in sec

    lz = laziness_section(doc)
    assert "| read /x | 1 | 1.0 MiB | 2 | 2.0 MiB | 2.00x |" in lz


def test_randread_schedule_alternates_targets_per_job() -> None:
    jobs = list(MATRIX[:3])
    got = [(j.name, t) for j, t in randread_schedule(jobs, INTERLEAVED)]
    assert got == [
        ("io_uring-qd1-j1", "ours_fuse"), ("io_uring-qd1-j1", "btrfs_loop"),
        ("io_uring-qd1-j2", "btrfs_loop"), ("io_uring-qd1-j2", "ours_fuse"),
        ("io_uring-qd16-j1", "ours_fuse"), ("io_uring-qd16-j1", "btrfs_loop"),
    ]  # fmt: skip


def test_randread_section_reports_interleaving_and_server_reads() -> None:
    doc = _doc()
    rr = doc["randread"]
    rr["interleaved"] = list(INTERLEAVED)
    first = next(iter(rr["targets"]["ours_fuse"]))
    rr["targets"]["ours_fuse"][first]["server_reads"] = 1234
    sec = randread_section(doc)
    assert "ours fuse and btrfs loop took turns per fio job" in sec
    assert f"{first} 1,234." in sec
    assert "took turns" not in randread_section(_doc())


def test_remote_section_medians_and_ratio() -> None:
    def run(done: float, prefetch: float | None, reqs: int, sent: int) -> dict[str, Any]:
        r = {"mount_s": 0.1, "to_command_done_s": done, "to_prefetch_done_s": prefetch,
             "requests": reqs, "bytes": sent}  # fmt: skip
        return r | ({"status": {"demand_chunk_loads": reqs - 1}} if reqs > 1 else {})

    doc = _doc()
    doc["remote"] = {
        "command": "chroot MNT /bin/true",
        "bundle_bytes": 200 << 20,
        "tar_bytes": 180 << 20,
        "runs": {
            "ours (no prefetch)": [run(0.5, None, 12, 10 << 20), run(0.7, None, 14, 10 << 20)],
            "ours (recorded trace)": [run(0.4, 0.45, 3, 10 << 20)] * 2,
            "curl | zstd -d | tar -x": [run(2.4, None, 1, 60 << 20)] * 2,
        },
    }
    sec = remote_section(doc)
    # medians: 0.6 s and 13 requests for the first row; 2.4 / 0.6 = 4.0x
    assert "| ours (no prefetch) | 0.10 | 0.60 |  | 13 | 10.0 MiB | 12 | 4.0x |" in sec, sec
    assert "| ours (recorded trace) | 0.10 | 0.40 | 0.45 | 3 | 10.0 MiB | 2 | 6.0x |" in sec, sec
    assert "| curl \\| zstd -d \\| tar -x | 0.10 | 2.40 |  | 1 | 60.0 MiB |  | 1.0x |" in sec, sec


def test_from_json_renders_runtime_sections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(_doc()))
    out = tmp_path / "again.json"
    rc = bench_main(["--from-json", str(saved), "--json", str(out)])
    text = capsys.readouterr().out
    assert "Mount (until the first file is readable)" in text and "0.90x" in text
    assert rc == 1  # the erofs row and the VM fuse run failed: reported, never hidden
    assert json.loads(out.read_text()) == _doc()


def test_vm_script_runs_every_job_for_each_target() -> None:
    s = vm_script("/bin/ublkd x", Path("/b"), Path("/d.img"), "large/blob-0.bin", MATRIX, 2.0, 3)
    targets = (("null_ublk", "$NULL", "$NP"), ("null_ublk_poll", "$NULLP", "$NPP"),
               ("loop_raw", "$LR", None), ("ours_ublk_raw", "$UB", "$SP"),
               ("ours_ublk", "/tmp/m/$F", "$SP"), ("ours_ublk_off_raw", "$UB", "$SP"),
               ("ours_ublk_off", "/tmp/m/$F", "$SP"), ("ours_ublk_poll_raw", "$UB", "$SP"),
               ("ours_ublk_poll", "/tmp/m/$F", "$SP"), ("ours_fuse", "/tmp/m/$F", None),
               ("btrfs_loop", "/tmp/b/$F", None), ("btrfs_loop_off", "/tmp/b/$F", None),
               ("btrfs_loop_poll", "/tmp/b/$F", None),
               ("btrfs_loop_fuse", "/tmp/b/$F", None))  # fmt: skip
    for j in MATRIX:
        for tag, path, pid in targets:
            # the ublk targets' fio jobs also record their server's CPU time
            run = f"cpujob {pid} {tag}" if pid else f"fiojob {tag}"
            assert f"{run} {path} {j.name} --name=randread" in s
    # interleaved: per job, each live target in turn, in each mode's fio function
    first = s.index("cpujob $NP null_ublk $NULL " + MATRIX[1].name)
    assert all(s.index(f" {t} ", 0) < first for t in VM_INTERLEAVED)

    def body(fn: str) -> str:
        start = s.index(f"\n{fn}() {{")
        return s[start : s.index("\n}\n", start)]

    assert "cpujob $SP ours_ublk /tmp/m" in body("fio_auto")
    assert "cpujob $SP ours_ublk_off /tmp/m" in body("fio_off")
    assert "cpujob $SP ours_ublk_poll /tmp/m" in body("fio_poll")
    assert "fiojob ours_fuse /tmp/m" in body("fio_fuse")
    assert "ours_ublk_off" not in body("fio_auto") + body("fio_poll")
    # the baseline stays mounted (a fsid of its own) and runs beside ours in every block,
    # under that block's tag
    for fn, tag in (("fio_auto", "btrfs_loop"), ("fio_off", "btrfs_loop_off"),
                    ("fio_poll", "btrfs_loop_poll"), ("fio_fuse", "btrfs_loop_fuse")):  # fmt: skip
        assert f"fiojob {tag} /tmp/b/$F" in body(fn)
    assert "btrfstune -S 0 $L1" in s and "btrfstune -f -U $NEWFSID $L1" in s
    assert s.index("btrfstune -f -U") < s.index("/tmp/b ||") < s.index("for R in")
    assert "$O/$tag/$job.r$R.json" in s
    # one mount block for every mode: mounted with its flag, its server's CPU idle and under
    # sparse reads, then its fio jobs; the default (auto) first, then off, then a fixed window
    mode = body("ublkmode")
    assert '$U mount --frontend ublk "$@" --cache-mb' in mode
    assert mode.index("lightload $tag") < mode.index("$fn") < mode.index("$U umount /tmp/m")
    auto = s.index("  ublkmode ours_ublk fio_auto\n")
    off = s.index("  ublkmode ours_ublk_off fio_off --ublk-poll=off\n")
    assert auto < off < s.index("  ublkmode ours_ublk_poll fio_poll --ublk-poll\n")
    # idle and sparse reads: the server's CPU as jobs "idle" and "sparse200"
    assert "sleep 5\n" in s and '"$2 idle $R' in s
    assert "cpujob $SP $1 /tmp/m/$F sparse200 --name=randread" in s and "--rate_iops=200" in s
    assert "for R in $(seq 3)" in s
    assert "U='/bin/ublkd x'" in s and "$U ublk-null --ublk-poll=off --size-mb" in s
    assert "$U ublk-null --ublk-poll --size-mb" in s
    assert "--frontend ublk" in s and "--frontend fuse" in s
    assert "losetup -d $LR $L1 $L2" in s and "umount /tmp/b" in s
    assert "qsettings $tag $UB" in s and "qsettings btrfs_loop $L2" in s
    assert "--runtime=2" in s and "kill $NP $NPP" in s


def test_parse_cpu_is_the_mean_over_rounds() -> None:
    text = (
        "null_ublk psync-j1 1 50 100 1000000000\n"  # 0.5 s of CPU over 1 s
        "null_ublk psync-j1 2 30 100 2000000000\n"  # 0.3 s over 2 s
        "ours_ublk psync-j1 1 0 100 0\n"  # no wall time: skipped
        "garbage\n"
    )
    assert parse_cpu(text) == {"null_ublk": {"psync-j1": 0.325}}


def _fio_json(iops: float) -> str:
    return json.dumps({"jobs": [{"read": {"iops": iops, "bw_bytes": iops * 4096,
                                          "clat_ns": {"percentile": {}}},
                                 "error": 0}]})  # fmt: skip


def test_vm_job_result_is_the_best_round(tmp_path: Path) -> None:
    for r, iops in ((1, 300.0), (2, 100.0), (3, 200.0)):
        (tmp_path / f"psync-j1.r{r}.json").write_text(_fio_json(iops))
    (tmp_path / "psync-j16.r1.json").write_text(_fio_json(999.0))  # another job
    res = vm_job_result(tmp_path, "psync-j1")
    assert res["iops"] == 300.0 and res["rounds"] == [100.0, 200.0, 300.0]
    assert "error" in vm_job_result(tmp_path, "psync-j2")


def test_parse_queues_takes_the_active_scheduler() -> None:
    q = parse_queues("null_ublk scheduler [none] mq-deadline \nnull_ublk nr_hw_queues 2\nbad\n")
    assert q == {"null_ublk": {"scheduler": "none", "nr_hw_queues": "2"}}
