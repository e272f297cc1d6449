"""What the OCI image spec (and Docker's v2 schema before it) defines that the OCI
source, pull and push share: media types, annotation keys, platform names and picking a
platform's manifest from an image index."""

from __future__ import annotations

import os
from typing import Any

from btrfs_ublk_image.errors import SourceError

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
ANNOTATION_TITLE = "org.opencontainers.image.title"

_ARCH = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", None),
    "arm64": ("arm64", None),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i686": ("386", None),
    "i386": ("386", None),
    "ppc64le": ("ppc64le", None),
    "s390x": ("s390x", None),
    "riscv64": ("riscv64", None),
}


def host_platform_name() -> str:
    """The host's platform as an OCI ``os/architecture[/variant]``."""
    machine = os.uname().machine  # what platform.machine() returns, without its import
    arch, variant = _ARCH.get(machine, (machine, None))
    return "linux/" + arch + (f"/{variant}" if variant else "")


def platform_name(p: Any) -> str | None:
    """``os/architecture[/variant]`` of a descriptor's platform, None if it has none."""
    if not isinstance(p, dict) or not p.get("os") or not p.get("architecture"):
        return None
    parts = (p.get("os"), p.get("architecture"), p.get("variant"))
    return "/".join(str(x) for x in parts if x)


def select_platform(
    descs: list[dict[str, Any]], plat: str, what: str, label: str
) -> dict[str, Any]:
    """The first entry of an index for ``plat`` (``os/arch[/variant]``); the error lists
    the platforms there are."""
    want = plat.split("/")
    for d in descs:
        p = d.get("platform")
        if not isinstance(p, dict) or [p.get("os"), p.get("architecture")] != want[:2]:
            continue
        if len(want) > 2 and p.get("variant") != want[2]:
            continue
        return d
    avail = sorted(n for d in descs if (n := platform_name(d.get("platform"))) is not None)
    raise SourceError(
        f"{label}: {what}: no manifest for platform {plat}"
        f" (available: {', '.join(avail) or 'none'})"
    )
