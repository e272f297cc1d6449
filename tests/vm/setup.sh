#!/usr/bin/env bash
# Prepare the VM test assets (called by scripts/setup.sh; idempotent, cached):
# the bookworm-backports 6.12 kernel (private APT config; the host's sources stay untouched),
# its depmod'ed modules tree and the busybox initramfs, under /var/cache/btrfs-ublk-image/vm.
# A warm cache costs well under a second and no network.
#   SKIP_VM=1        skip entirely
#   VM_REFRESH=1     re-resolve the newest backports kernel
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
[ -n "${SKIP_VM:-}" ] && { echo "[setup] vm: skipped (SKIP_VM)" >&2; exit 0; }
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" tests/vm/harness.py prepare ${VM_REFRESH:+--refresh}
