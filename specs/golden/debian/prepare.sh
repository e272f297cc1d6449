#!/usr/bin/env bash
# Inputs of the Debian golden image, made (as root) into OUTDIR and cached there:
#   rootfs.tar    mmdebstrap --variant=minbase bookworm from the pinned package set only
#                 (../shared/debian-minbase), SOURCE_DATE_EPOCH=1700000000, host-dependent
#                 files normalised (README.md): the same bytes on every machine and day
#   oci/          an OCI image layout, ref "bookworm", two layers (make-oci.py): that
#                 tarball; then /etc/golden-release added and the dpkg/debconf backup
#                 copies removed (whiteouts)
#   spec.yaml, spec-oci.yaml, overlay/   copied from specs/golden/debian/
# Usage: specs/golden/debian/prepare.sh OUTDIR
# The package set: $BUI_DEBIAN_REPO, else ../shared/debian-minbase beside the checkout, else
# the copy scripts/setup.sh keeps in /var/cache/btrfs-ublk-image/debian-minbase.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
OUT=${1:?usage: prepare.sh OUTDIR}
EPOCH=1700000000
# bump when the recipe changes: a cache made by another recipe is made again
RECIPE=pinned-minbase-2

find_repo() {
  local c
  for c in "${BUI_DEBIAN_REPO:-}" "$ROOT/../shared/debian-minbase" \
    /var/cache/btrfs-ublk-image/debian-minbase; do
    if [ -n "$c" ] && [ -f "$c/SHA256SUMS" ] && [ -d "$c/dists/bookworm" ]; then
      (cd "$c" && pwd)
      return 0
    fi
  done
  echo "prepare.sh: the pinned Debian package set is missing: set BUI_DEBIAN_REPO, or put" \
    "debian-minbase/ beside the checkout (../shared/debian-minbase) and run scripts/setup.sh" >&2
  return 1
}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$(cat "$OUT/inputs.done" 2>/dev/null)" != "$RECIPE" ]; then
  REPO=$(find_repo)
  (cd "$REPO/pool/main" && sha256sum --quiet -c ../../SHA256SUMS >&2) \
    || { echo "prepare.sh: $REPO/pool/main does not match $REPO/SHA256SUMS" >&2; exit 1; }
  rm -rf "$OUT/rootfs.tar" "$OUT/oci" "$OUT/inputs.done" "$OUT"/rootfs "$OUT"/*.done
  # every package of the set: its index has each .deb's own Priority (apt says "important"),
  # not the archive's overrides (apt is "required" there), so minbase alone would miss apt
  INCLUDE=$(awk '/^Package: /{print $2}' "$REPO/dists/bookworm/main/binary-amd64/Packages" \
    | sort | paste -sd, -)
  # Normalise what mmdebstrap takes from the host or the repository's path: the host's
  # hostname and resolv.conf (a container runtime provides both), sources.list naming
  # the repository's path on this machine.
  SOURCE_DATE_EPOCH=$EPOCH mmdebstrap --variant=minbase --mode=root --format=tar \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --include="$INCLUDE" \
    --customize-hook='rm -f "$1/etc/hostname" "$1/etc/resolv.conf"' \
    --customize-hook='echo "# golden image: packages from a pinned set (no source configured)" >"$1/etc/apt/sources.list"' \
    bookworm "$OUT/rootfs.tar.tmp" "deb [trusted=yes] copy://$REPO bookworm main" \
    >"$OUT/mmdebstrap.log" 2>&1 \
    || { tail -20 "$OUT/mmdebstrap.log" >&2; rm -f "$OUT/rootfs.tar.tmp"; exit 1; }
  mv "$OUT/rootfs.tar.tmp" "$OUT/rootfs.tar"
  python3 "$HERE/make-oci.py" "$OUT/rootfs.tar" "$OUT/oci" --epoch "$EPOCH"
  echo "$RECIPE" >"$OUT/inputs.done"
fi

rm -rf "$OUT/overlay"
cp -a "$HERE/overlay" "$OUT/overlay"
# the dir: source's digest covers modes and mtimes as found: a checkout's depend on the
# clone (its time, the umask), so they are fixed here
chmod -R u=rwX,go=rX "$OUT/overlay"
find "$OUT/overlay" -exec touch -h -d "@$EPOCH" {} +
cp "$HERE/spec.yaml" "$HERE/spec-oci.yaml" "$OUT/"
