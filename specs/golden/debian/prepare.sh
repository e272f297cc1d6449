#!/usr/bin/env bash
# Inputs of the Debian golden image, made (as root) into OUTDIR and cached there:
#   rootfs/       debootstrap --variant=minbase (suite $DEBIAN_SUITE, default bookworm)
#   rootfs.tar    that tree as one tarball (numeric owners, xattrs, sorted names)
#   oci/          an OCI image layout, ref "bookworm", two layers made with umoci:
#                 1. the minbase tree, 2. /etc/golden-release added, /var/log/bootstrap.log
#                 removed (a whiteout), /var/cache/apt/*.bin removed
#   spec.yaml, spec-oci.yaml, overlay/   copied from specs/golden/debian/
# Usage: specs/golden/debian/prepare.sh OUTDIR      (DEBIAN_MIRROR to use another mirror)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: prepare.sh OUTDIR}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$OUT"
cd "$OUT"

if [ ! -e rootfs.done ]; then
  rm -rf rootfs
  debootstrap --variant=minbase "$SUITE" rootfs "$MIRROR" >debootstrap.log 2>&1 \
    || { tail -20 debootstrap.log >&2; exit 1; }
  touch rootfs.done
fi

if [ ! -e rootfs.tar ]; then
  tar --numeric-owner --xattrs --xattrs-include='*' --sort=name -C rootfs -cf rootfs.tar.tmp .
  mv rootfs.tar.tmp rootfs.tar
fi

# oci.done holds the layout's version: 2 = two layers (version 1, from before
# --refresh-bundle, had the second repack's whole tree as its only layer)
if [ "$(cat oci.done 2>/dev/null)" != 2 ]; then
  rm -rf oci oci-bundle
  umoci init --layout oci
  umoci new --image oci:bookworm
  umoci unpack --image oci:bookworm oci-bundle
  tar -C rootfs --numeric-owner --xattrs --xattrs-include='*' -cf - . \
    | tar -C oci-bundle/rootfs --numeric-owner --xattrs --xattrs-include='*' -xpf -
  # --refresh-bundle: the next repack diffs against this layer, not the empty image
  umoci repack --refresh-bundle --image oci:bookworm oci-bundle
  # layer 2: one file added, two removed (whiteouts in the layer)
  echo "golden-debian $SUITE" >oci-bundle/rootfs/etc/golden-release
  rm -f oci-bundle/rootfs/var/log/bootstrap.log oci-bundle/rootfs/var/cache/apt/*.bin
  umoci repack --image oci:bookworm oci-bundle
  umoci config --image oci:bookworm --config.cmd /bin/bash --config.env LANG=C.UTF-8 \
    --config.workingdir /
  umoci gc --layout oci
  rm -rf oci-bundle
  echo 2 >oci.done
fi

rm -rf overlay
cp -a "$HERE/overlay" overlay
cp "$HERE/spec.yaml" "$HERE/spec-oci.yaml" .
