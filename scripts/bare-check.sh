#!/usr/bin/env bash
# Try the README's two commands on a bare Debian 12: a chroot of debootstrap's bookworm
# minbase (nothing of this machine's toolchains, venvs or caches in it) gets a clean clone
# of HEAD, runs scripts/setup.sh, then scripts/test.sh. As root. Not part of CI (about
# 25 minutes: apt, pip, a cold cargo build).
#
#   scripts/bare-check.sh [pytest args]
#       default: -m 'not vm and not slow' -k 'not bwrap and not containerd'
#                --ignore tests/test_vm.py --ignore tests/test_podman.py
#
# What a chroot cannot show: the VM stage (SKIP_VM=1: no kernel download here), bwrap
# (the kernel refuses new user namespaces inside a chroot: test_bwrap_* fails there) and
# runc's containers (containerd, podman: runc cannot pivot into a rootfs from a chroot,
# "mount /, flags: 0x84000: invalid argument").
# This machine reaches the package registries through a TLS-intercepting proxy: its local
# CA certificates are copied in (ca-certificates, installed by setup's apt step, adds them
# to the system store) and PIP_CERT/SSL_CERT_FILE passed through when set here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${BARE_WORKDIR:-/var/tmp/btrfs-ublk-image-bare}
MIRROR=${DEBIAN_MIRROR:-$("$ROOT/scripts/host-mirror.sh")}
[ -n "$MIRROR" ] || { echo "bare-check: no Debian mirror in apt's sources: set DEBIAN_MIRROR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "bare-check: run as root" >&2; exit 2; }
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null
[ $# -gt 0 ] || set -- -m 'not vm and not slow' -k 'not bwrap and not containerd' \
  --ignore tests/test_vm.py --ignore tests/test_podman.py
log() { printf '[bare-check] %s\n' "$*" >&2; }

rm -rf "$WORK"
mkdir -p "$WORK"
CH=$WORK/root
cleanup() {
  for d in dev sys proc; do mountpoint -q "$CH/$d" && umount -R "$CH/$d"; done
  return 0
}
trap cleanup EXIT

log "debootstrap --variant=minbase bookworm ($MIRROR)"
debootstrap --variant=minbase bookworm "$CH" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
cp /etc/resolv.conf "$CH/etc/resolv.conf"
mkdir -p "$CH/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$CH/usr/local/share/ca-certificates/" 2>/dev/null || true
git clone -q "$ROOT" "$CH/root/btrfs-ublk-image"
for d in proc sys dev; do
  mount --rbind "/$d" "$CH/$d"
  mount --make-rslave "$CH/$d"
done

# a login-like environment: none of this machine's PATH, venvs or pip settings
TLS_ENV=()
for v in PIP_CERT SSL_CERT_FILE; do [ -n "${!v:-}" ] && TLS_ENV+=("$v=${!v}"); done
in_chroot() {
  chroot "$CH" /usr/bin/env -i HOME=/root LANG=C.UTF-8 "${TLS_ENV[@]}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
log "scripts/setup.sh (SKIP_VM=1)"
in_chroot bash -c 'cd /root/btrfs-ublk-image && SKIP_VM=1 bash scripts/setup.sh'
log "scripts/test.sh $*"
in_chroot bash -c 'cd /root/btrfs-ublk-image && exec bash scripts/test.sh "$@"' test.sh "$@"
log "ok"
