"""Signature policy of `ublkd mount` (docs/signatures.md), with skopeo as the oracle.

Images go to docker-registry on loopback (`btrfs-ublk-image push --image`: a runnable
image and its bundle artifact); signatures are containers/image simple signing
signatures made by skopeo (`skopeo copy --sign-by`, `skopeo standalone-sign`) with
throwaway GnuPG keys, stored in a file:// lookaside directory named by a registries.d
file. ublkd and skopeo read the same policy.json and registries.d: what one accepts the
other accepts, what one refuses the other refuses. The registry's access log shows that
a refused mount fetched the manifest and nothing else (no config, no meta.img).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from containerdtools import FLAVOURS, SNAPSHOTTER, busybox_bundle, containerd_stack, mounts_under
from servers import AccessRecord, Registry, docker_registry, nginx_serving
from test_push import ok, push
from test_remote import FRONTEND, build_served_bundle, cache_dir, read_file
from test_ublkd import no_leftovers, status, ublkd

from bundletools import list_dir, list_tar

pytestmark = pytest.mark.root
__all__ = ["cache_dir", "no_leftovers"]  # the fixtures, used by name


@dataclass
class Keys:
    home: Path  # GNUPGHOME holding both secret keys
    trusted: str  # fingerprint of the key the policy names
    other: str  # a key the policy does not name
    trusted_pub: Path  # the trusted public key (binary export), the policy's keyPath

    def env(self) -> dict[str, str]:
        return dict(os.environ, GNUPGHOME=str(self.home))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keys]:
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    env = dict(os.environ, GNUPGHOME=str(home))
    fprs = []
    for name in ("Trusted Signer <trusted@example.com>", "Other Signer <other@example.com>"):
        subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", name, "ed25519",
                        "sign", "never"], env=env, check=True, capture_output=True)  # fmt: skip
        out = subprocess.run(["gpg", "--with-colons", "--list-keys", name], env=env,
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
        fprs.append(next(ln.split(":")[9] for ln in out.splitlines() if ln.startswith("fpr:")))
    pub = home / "trusted.gpg"
    pub.write_bytes(
        subprocess.run(
            ["gpg", "--export", fprs[0]], env=env, check=True, capture_output=True
        ).stdout
    )
    try:
        yield Keys(home, fprs[0], fprs[1], pub)
    finally:  # the agent that key generation started, by its home directory
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True)


@dataclass
class Trust:
    """A policy.json and registries.d (lookaside = staging = ``sigs``) for one registry."""

    policy: Path
    registries_d: Path
    sigs: Path

    def ublkd_args(self) -> tuple[str, ...]:
        return ("--policy", str(self.policy), "--registries-d", str(self.registries_d))

    def signature(self, repo: str, manifest: bytes, n: int = 1) -> Path:
        """Where containers/image keeps signature ``n`` of ``manifest`` in ``repo``."""
        hex_ = hashlib.sha256(manifest).hexdigest()
        return self.sigs / f"{repo}@sha256={hex_}" / f"signature-{n}"


def make_trust(work: Path, reg: Registry, keys: Keys) -> Trust:
    """Reject by default; ``REGISTRY/signed`` needs the trusted key's signature."""
    work.mkdir()
    sigs = work / "sigs"
    rd = work / "registries.d"
    rd.mkdir()
    (rd / "test.yaml").write_text(
        f"default-docker:\n  lookaside: file://{sigs}\n  lookaside-staging: file://{sigs}\n"
    )
    policy = work / "policy.json"
    signed_by = {"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(keys.trusted_pub)}
    policy.write_text(
        json.dumps(
            {
                "default": [{"type": "reject"}],
                "transports": {"docker": {f"{reg.address}/signed": [signed_by]}},
            }
        )
    )
    return Trust(policy, rd, sigs)


def skopeo(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", *map(str, args)], capture_output=True, text=True, env=env)


def raw_manifest(ref: str) -> bytes:
    r = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                       capture_output=True, check=True)  # fmt: skip
    return r.stdout


def sign_in_place(ref: str, trust: Trust, keys: Keys, fpr: str) -> None:
    """`skopeo copy --sign-by` onto itself: the manifest is unchanged, a signature is stored."""
    r = skopeo("copy", "--registries.d", trust.registries_d, "--src-tls-verify=false",
               "--dest-tls-verify=false", "--sign-by", fpr, f"docker://{ref}", f"docker://{ref}",
               env=keys.env())  # fmt: skip
    assert r.returncode == 0, r.stderr


def standalone_sign(tmp: Path, manifest: bytes, identity: str, keys: Keys, fpr: str) -> bytes:
    (tmp / "m.json").write_bytes(manifest)
    r = skopeo("standalone-sign", tmp / "m.json", identity, fpr, "-o", tmp / "sig", env=keys.env())
    assert r.returncode == 0, r.stderr
    return (tmp / "sig").read_bytes()


def tamper_payload(sig: bytes, old: bytes, new: bytes) -> bytes:
    """The signed message with ``old`` in its payload replaced (same length), compressed
    again; the signature packet is kept, so it no longer matches: gpg's BADSIG."""
    assert sig[:2] == b"\xa3\x01" and len(old) == len(new)  # compressed (ZIP), to the end
    inner = zlib.decompressobj(-15).decompress(sig[2:])
    assert inner.count(old) == 1
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return sig[:2] + c.compress(inner.replace(old, new)) + c.flush()


def break_stream_end(sig: bytes, keys: Keys) -> bytes:
    """``sig`` with one bit of its last byte flipped such that gpg still reports GOODSIG but
    exits non-zero (the compressed stream's end is broken after the signature packet).
    Which bit does that depends on where the deflate stream's last code ends, which varies
    with the signature's length, so gpg is asked; bits 0-1 always had one in trials."""
    for bit in range(8):
        candidate = sig[:-1] + bytes([sig[-1] ^ (1 << bit)])
        r = subprocess.run(["gpg", "--batch", "--status-fd", "1", "--decrypt"], input=candidate,
                           env=keys.env(), capture_output=True)  # fmt: skip
        if r.returncode != 0 and b"[GNUPG:] GOODSIG " in r.stdout:
            return candidate
    raise AssertionError("no flip of the last byte leaves gpg's GOODSIG with a failed exit")


def skopeo_accepts(ref: str, trust: Trust, dest: Path) -> subprocess.CompletedProcess[str]:
    """The oracle: `skopeo copy` out of the registry under the same policy and registries.d."""
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    return skopeo("--policy", trust.policy, "copy", "--registries.d", trust.registries_d,
                  "--src-tls-verify=false", f"docker://{ref}", f"dir:{dest}")  # fmt: skip


def settled_requests(reg: Registry, before: int) -> list[AccessRecord]:
    """The registry's requests since number ``before``, once its log stops growing (it
    writes a line when a response ends, maybe after the client is done)."""
    deadline = time.monotonic() + 10
    seen = reg.requests()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = reg.requests()
        if len(now) == len(seen) > before:
            break
        seen = now
    return seen[before:]


@contextlib.contextmanager
def accepted(ref: str, trust: Trust, mnt: Path) -> Iterator[Path]:
    """skopeo accepts ``ref`` under the policy, and ublkd mounts it (unmounted on exit)."""
    oracle = skopeo_accepts(ref, trust, mnt.parent / "skopeo-out")
    assert oracle.returncode == 0, oracle.stderr
    ublkd("mount", f"oci://{ref}", mnt, *FRONTEND, *trust.ublkd_args())
    try:
        yield mnt
    finally:
        ublkd("umount", mnt)


def assert_refused(reg: Registry, ref: str, mnt: Path, trust: Trust, reason: str) -> None:
    """ublkd refuses naming the reference, the policy and ``reason``, having fetched no
    blob (only the manifest); skopeo refuses too."""
    before = len(reg.requests())
    r = ublkd("mount", f"oci://{ref}", mnt, *FRONTEND, *trust.ublkd_args(), check=False)
    assert r.returncode != 0, r.stdout
    assert f"oci://{ref}: refused by the signature policy {trust.policy}" in r.stderr, r.stderr
    assert reason in r.stderr, r.stderr
    fetched = [x.path for x in settled_requests(reg, before)]
    assert fetched and all("/manifests/" in p for p in fetched), fetched
    oracle = skopeo_accepts(ref, trust, mnt.parent / "skopeo-out")
    assert oracle.returncode != 0 and "rejected" in oracle.stderr, oracle.stderr


def test_signed_mounts_unsigned_and_wrongly_signed_refused_before_meta_img(
    no_leftovers: Path, cache_dir: Path, keys: Keys
) -> None:
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with docker_registry(tmp / "registry") as reg:
        ref = f"{reg.address}/signed/app:v1"
        ok(push("push", "--image", bundle, ref))
        trust = make_trust(tmp / "trust", reg, keys)
        runnable = raw_manifest(ref)
        bundle_manifest = raw_manifest(f"{ref}-bundle")

        assert_refused(reg, ref, mnt, trust, "has no signature (looked up at file://")

        # wrong signatures in signature-1, each refused by both for its own reason
        work = tmp / "sign"
        work.mkdir()
        good = standalone_sign(work, runnable, ref, keys, keys.trusted)
        cases = {
            "payload altered": (
                tamper_payload(good, b"/app:v1", b"/app:v9"),
                "a bad signature: the signed data was altered (gpg BADSIG",
            ),
            "broken stream end": (
                break_stream_end(good, keys),
                "a good signature in a message gpg refuses (gpg: ",
            ),
            "not a signature": (b"junk" * 40, "not a signed message (gpg: "),
            "wrong key": (
                standalone_sign(work, runnable, ref, keys, keys.other),
                "signed by a key that is not in the policy",
            ),
            "wrong digest": (
                standalone_sign(work, bundle_manifest, ref, keys, keys.trusted),
                "not this manifest",
            ),
            "wrong identity": (
                standalone_sign(work, runnable, f"{reg.address}/signed/app:v2", keys, keys.trusted),
                f"signed for {reg.address}/signed/app:v2, which signedIdentity "
                f"matchRepoDigestOrExact does not accept for {ref}",
            ),
        }
        sig = trust.signature("signed/app", runnable)
        sig.parent.mkdir(parents=True)
        (work / "m.json").write_bytes(runnable)
        for name, (data, reason) in cases.items():
            sig.write_bytes(data)
            assert_refused(reg, ref, mnt, trust, reason)
            # and skopeo's own check of the one signature against the trusted key
            v = skopeo("standalone-verify", work / "m.json", ref, keys.trusted, sig, env=keys.env())
            assert v.returncode != 0, f"{name}: skopeo standalone-verify accepted it"

        # a standalone-sign signature by the trusted key: skopeo and ublkd accept it
        sig.write_bytes(good)
        v = skopeo("standalone-verify", work / "m.json", ref, keys.trusted, sig, env=keys.env())
        assert v.returncode == 0, v.stderr
        with accepted(ref, trust, mnt):
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]

        # signed by `skopeo copy --sign-by` (what podman users run): a second signature
        sig.unlink()
        sign_in_place(ref, trust, keys, keys.trusted)
        assert sig.exists(), "skopeo stored its signature elsewhere"
        with accepted(ref, trust, mnt):
            assert list_dir(mnt) == list_tar(tarball)

        # by the bundle's digest (what the containerd snapshotter mounts): the bundle
        # artifact's own manifest must be signed; any tag of the repository is its identity
        bundle_digest = "sha256:" + hashlib.sha256(bundle_manifest).hexdigest()
        by_digest = f"{reg.address}/signed/app@{bundle_digest}"
        assert_refused(reg, by_digest, mnt, trust, f"manifest {bundle_digest} has no signature")
        sign_in_place(f"{ref}-bundle", trust, keys, keys.trusted)
        with accepted(by_digest, trust, mnt):
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]

        # another repository falls to the default: reject
        other = f"{reg.address}/elsewhere/app:v1"
        ok(push("push", bundle, other))
        assert_refused(reg, other, mnt, trust, "the policy rejects it")
    assert status() == []


def test_push_sign_by(
    no_leftovers: Path, cache_dir: Path, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`push --image --sign-by KEY` has skopeo sign both tags: ublkd mounts the runnable
    tag and the bundle by digest under the policy, and skopeo accepts both."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    monkeypatch.setenv("GNUPGHOME", str(keys.home))
    with docker_registry(tmp / "registry") as reg:
        trust = make_trust(tmp / "trust", reg, keys)
        ref = f"{reg.address}/signed/pushed:v1"
        rd = str(trust.registries_d)
        out = ok(push("push", "--image", bundle, ref, "--sign-by", keys.trusted,
                      "--registries-d", rd)).stdout  # fmt: skip
        assert f"signed: {ref} (sha256:" in out and f"signed: {ref}-bundle (sha256:" in out, out
        found = re.search(r"bundle: manifest (sha256:[0-9a-f]{64})", out)
        assert found is not None, out
        signed = (ref, f"{reg.address}/signed/pushed@{found[1]}")
        for loc in signed:
            with accepted(loc, trust, mnt):
                assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
        # the same signatures published by a web server: an http:// lookaside
        with nginx_serving(trust.sigs, tmp / "nginx") as web:
            (trust.registries_d / "test.yaml").write_text(
                f"default-docker:\n  lookaside: {web.url}\n"
            )
            for loc in signed:
                with accepted(loc, trust, mnt):
                    assert read_file(mnt / "etc" / "hostname") == files["etc/hostname"]
            got = {(x.path.rsplit("/", 1)[-1], x.status) for x in web.requests()}
            assert {("signature-1", 200), ("signature-2", 404)} <= got, got
        # a key GnuPG does not have: push fails naming the tag and skopeo's reason
        r = push("push", bundle, f"{reg.address}/signed/pushed:v2", "--sign-by", "0" * 40,
                 "--registries-d", rd)  # fmt: skip
        assert r.returncode == 1, r.stdout
        assert f"{reg.address}/signed/pushed:v2: skopeo copy --sign-by {'0' * 40}: " in r.stderr
    assert status() == []


def test_local_bundles_and_bad_policies(no_leftovers: Path, cache_dir: Path, keys: Keys) -> None:
    """A local bundle is the `dir` transport, scoped by path; signedBy cannot apply to it.
    A policy file ublkd cannot use fails the mount naming the file and the problem."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    policy = tmp / "policy.json"

    def mount(*extra: str) -> subprocess.CompletedProcess[str]:
        return ublkd("mount", bundle, mnt, *FRONTEND, "--policy", policy, *extra, check=False)

    policy.write_text('{"default": [{"type": "reject"}]}')
    r = mount()
    assert r.returncode != 0
    assert (
        f"{bundle}: refused by the signature policy {policy} (default): the policy rejects it"
        in r.stderr
    )
    signed_by = {"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(keys.trusted_pub)}
    policy.write_text(json.dumps({"default": [{"type": "reject"}],
                                  "transports": {"dir": {str(bundle.parent): [signed_by]}}}))  # fmt: skip
    r = mount()
    assert r.returncode != 0 and "looks up for oci:// references only" in r.stderr, r.stderr
    policy.write_text('{"default": [{"type": "insecureAcceptAnything", "extra": 1}]}')
    r = mount()
    assert r.returncode != 0 and f'policy {policy}: default[0]: unknown field "extra"' in r.stderr
    r = ublkd("mount", bundle, mnt, *FRONTEND, "--policy", tmp / "missing.json", check=False)
    assert r.returncode != 0 and f"policy {tmp / 'missing.json'}" in r.stderr, r.stderr
    accept = {"type": "insecureAcceptAnything"}
    policy.write_text(json.dumps({"default": [{"type": "reject"}],
                                  "transports": {"dir": {str(bundle.parent): [accept]}}}))  # fmt: skip
    assert mount().returncode == 0
    try:
        assert read_file(mnt / "etc" / "hostname") == files["etc/hostname"]
    finally:
        ublkd("umount", mnt)
    assert status() == []


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_containerd_pull_under_a_reject_by_default_policy(
    flavour: str, keys: Keys, tmp_path: Path
) -> None:
    """The snapshotter passes its --policy and --registries-d to every `ublkd mount`: an
    unsigned image's pull fails with ublkd's message and leaves nothing mounted, its
    meta.img never fetched; the same image signed with `skopeo copy --sign-by` runs.
    containerd 1.6 (through the snapshotter's pull client, as the CRI) names the image
    manifest it unpacks, so that manifest's signature is checked; containerd 2.x's
    transfer service names only the bundle, so the bundle's is."""
    small = busybox_bundle(tmp_path / "small")
    with docker_registry(tmp_path / "registry") as reg:
        unsigned = f"{reg.address}/signed/plain:v1"  # in the signed scope, never signed
        signed = f"{reg.address}/signed/small:v1"
        bundle_only = f"{reg.address}/signed/bundle-only:v1"  # its runnable image unsigned
        for ref in (unsigned, signed):
            ok(push("push", "--image", small, ref))
        # another image (its own run-id): one whose layer containerd has not unpacked yet
        ok(push("push", "--image", busybox_bundle(tmp_path / "other"), bundle_only))
        trust = make_trust(tmp_path / "trust", reg, keys)
        for ref in (signed, f"{signed}-bundle", f"{bundle_only}-bundle"):
            sign_in_place(ref, trust, keys, keys.trusted)
        checked = raw_manifest(unsigned if flavour == "1.6" else f"{unsigned}-bundle")
        checked_digest = "sha256:" + hashlib.sha256(checked).hexdigest()
        layers = json.loads(raw_manifest(f"{unsigned}-bundle"))["layers"]
        meta_blob = layers[0]["digest"]
        with containerd_stack(flavour, snapshotter_args=trust.ublkd_args()) as st:
            before = len(reg.requests())
            r = st.pull(unsigned, check=False)
            out = r.stdout + r.stderr
            assert r.returncode != 0, out
            assert "refused by the signature policy" in out and str(trust.policy) in out, out
            assert f"oci://{reg.address}/signed/plain@{checked_digest}: refused" in out, out
            assert f"manifest {checked_digest} has no signature" in out, out
            assert not any(meta_blob in x.path for x in settled_requests(reg, before))
            assert mounts_under(st.snapshotter_root) == []
            st.pull(signed)
            run = st.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, signed, "signed-c1",
                         "/bin/cat", "/etc/motd")  # fmt: skip
            assert run.stdout == "small\n"
            r = st.pull(bundle_only, check=False)
            if flavour == "1.6":
                assert r.returncode != 0 and "has no signature" in r.stdout + r.stderr, r
            else:
                assert r.returncode == 0, r.stdout + r.stderr
