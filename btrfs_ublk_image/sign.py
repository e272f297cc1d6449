"""`push --sign-by KEY`: signatures of what push tagged, made by skopeo.

The signature is containers/image "simple signing" (docs/signatures.md), the format
podman and skopeo verify and `ublkd mount --policy` checks. skopeo makes it: `skopeo
copy --sign-by KEY docker://REPO@DIGEST docker://REPO:TAG` copies the pushed manifest onto
its own tag (every blob is already there, so none is uploaded), signs it with the GnuPG
key KEY (from $GNUPGHOME) for the identity REPO:TAG and stores the signature where
containers-registries.d(5) says (`lookaside-staging`, `sigstore-staging`). The manifest
skopeo wrote must be the one push made, or the signature would be for another image.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile

from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.registry import Reference, is_loopback


def sign_pushed(
    ref: Reference,
    digest: str,
    key: str,
    *,
    plain_http: bool = False,
    credentials: tuple[str, str] | None = None,
    registries_d: str | None = None,
) -> None:
    """Sign the manifest ``digest`` tagged ``ref`` with the GnuPG key ``key``."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError(f"{ref}: --sign-by needs skopeo (package skopeo)")
    tls = "false" if plain_http or is_loopback(ref.registry) else "true"
    target = Reference(ref.registry, ref.repo, ref.tag)
    with tempfile.TemporaryDirectory(prefix="bui-sign-") as work:
        argv = [skopeo, "copy", "--quiet", "--sign-by", key, f"--src-tls-verify={tls}",
                f"--dest-tls-verify={tls}", "--digestfile", os.path.join(work, "digest")]  # fmt: skip
        if registries_d is not None:
            argv += ["--registries.d", registries_d]
        if credentials is not None:  # in a file: never on a command line
            auth = base64.b64encode(":".join(credentials).encode()).decode()
            authfile = os.path.join(work, "auth.json")
            with open(authfile, "w") as f:
                json.dump({"auths": {ref.registry: {"auth": auth}}}, f)
            argv += ["--authfile", authfile]
        source = Reference(ref.registry, ref.repo, "", digest)  # not the tag: it may move
        argv += [f"docker://{source}", f"docker://{target}"]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise ImageError(f"{target}: skopeo copy --sign-by {key}: {r.stderr.strip()}")
        with open(os.path.join(work, "digest")) as f:
            written = f.read().strip()
    if written != digest:
        raise ImageError(
            f"{target}: skopeo wrote manifest {written} while signing, not the pushed {digest}"
        )
