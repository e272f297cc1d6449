"""Containerd section: from nothing to a container's first line of output (issue 20).

The Debian minbase image (specs/golden/debian/prepare.sh's two-layer OCI layout) is put
into docker-registry on loopback twice: as it is (`skopeo copy`) and as a bundle with its
runnable image (`btrfs-ublk-image push --image`). Each run starts cold: a new containerd
(root, state) and snapshotter (root, ublkd cache), the page cache dropped. Timed from the
start of the pull until `ctr run`'s first line of output (`cat /etc/debian_version`):

* ours: pull through btrfs-ublk-snapshotter, then `ctr run --snapshotter btrfs-ublk`;
* baseline: containerd's own overlayfs snapshotter pulling the ordinary image, then
  `ctr run`.

Both pulls go through the same client per containerd flavour (2.x: `ctr image pull`,
its transfer service; 1.6: the snapshotter's pull client, containerd's own client
library). Bytes moved are the registry's body bytes sent (its access log), so both sides
are counted the same way.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.measure import drop_caches, remove
from tests.containerdtools import SNAPSHOTTER, Stack, containerd_stack
from tests.servers import Registry, docker_registry

COMMAND = ["/bin/cat", "/etc/debian_version"]


def _sent(reg: Registry, since: int) -> tuple[int, int]:
    reqs = reg.requests()[since:]
    return len(reqs), sum(r.bytes_sent for r in reqs)


def _first_line(st: Stack, snapshotter: str, ref: str, name: str) -> str:
    argv = [st.ctr_binary, "--address", str(st.socket), "--namespace", "bui-test", "run",
            "--rm", "--snapshotter", snapshotter, ref, name, *COMMAND]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=st.env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"ctr run {ref}: {proc.returncode}: {err.decode()[-500:]}")
    return line


def _one(flavour: str, reg: Registry, ref: str, snapshotter: str) -> dict[str, Any]:
    with containerd_stack(flavour) as st:
        drop_caches()
        since = len(reg.requests())
        t0 = time.monotonic()
        st.pull(ref, snapshotter=snapshotter)
        t_pulled = time.monotonic()
        line = _first_line(st, snapshotter, ref, "bench")
        t_first = time.monotonic()
        requests, sent = _sent(reg, since)
    if not line.startswith("12."):
        raise RuntimeError(f"{ref}: unexpected first line {line!r}")
    return {
        "pull_s": t_pulled - t0,
        "to_first_line_s": t_first - t0,
        "requests": requests,
        "bytes": sent,
    }


FLAVOURS = ("2.x", "1.6")


def measure_containerd(
    oci_layout: Path, work: Path, repeats: int, flavours: tuple[str, ...] = FLAVOURS
) -> dict[str, Any]:
    """Cold container starts, ours and containerd's overlayfs, alternating; medians."""
    remove(work)
    work.mkdir(parents=True)
    spec = work / "spec.yaml"
    spec.write_text(  # as `convert` builds container images: 256 KiB chunks
        "version: 1\nname: bench-ctd\npack_chunk_size: 262144\nlayers:\n"
        f"  - oci: {{path: {oci_layout}, ref: bookworm}}\n"
    )
    bundle = work / "bundle"
    subprocess.run(["btrfs-ublk-image", "build", str(spec), "-o", str(bundle)],
                   check=True, capture_output=True)  # fmt: skip
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with docker_registry(work / "registry") as reg:
        ours = f"{reg.address}/bench/debian-bundle:v1"
        plain = f"{reg.address}/bench/debian:v1"
        subprocess.run(["btrfs-ublk-image", "push", "--image", str(bundle), ours],
                       check=True, capture_output=True)  # fmt: skip
        subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{oci_layout}:bookworm",
                        f"docker://{plain}"], check=True, capture_output=True)  # fmt: skip
        for flavour in flavours:
            per = runs.setdefault(flavour, {})
            for _ in range(max(1, repeats)):
                per.setdefault("ours", []).append(_one(flavour, reg, ours, SNAPSHOTTER))
                per.setdefault("overlayfs", []).append(_one(flavour, reg, plain, "overlayfs"))
    remove(work)
    return {"command": " ".join(COMMAND), "repeats": repeats, "runs": runs}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: float(statistics.median(r[k] for r in runs)) for k in runs[0]}
