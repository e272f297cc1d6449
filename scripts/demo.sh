#!/usr/bin/env bash
# The demo: build examples/webroot into a bundle, mount it with ublkd (device 2 served lazily),
# read a file, sprout a writable layer, write, unmount. Run as root after scripts/setup.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d /tmp/btrfs-ublk-image-demo.XXXXXX)
MNT="$W/mnt"
cleanup() {
  mountpoint -q "$MNT" && ublkd umount "$MNT" || true
  rm -rf "$W"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }

step "build examples/webroot/spec.yaml"
btrfs-ublk-image build "$ROOT/examples/webroot/spec.yaml" -o "$W/webroot.bundle"
btrfs-ublk-image inspect "$W/webroot.bundle"

step "mount it (device 2 is served lazily from the packs; only metadata is local)"
mkdir -p "$MNT"
ublkd mount "$W/webroot.bundle" "$MNT" --rw "$W/rw.img" --rw-size 1G
ls -la "$MNT"
cat "$MNT/index.html"                      # inline: lives in meta.img
sha256sum "$MNT/docs/large.txt"             # a data extent: read from the pack through device 2

step "write to the sprouted read-write layer"
echo "written after mount" > "$MNT/notes.txt"
cat "$MNT/notes.txt"
sleep 0.5                                   # the server publishes its counters every 200 ms
ublkd status

step "unmount"
ublkd umount "$MNT"
echo "demo ok"
