#!/usr/bin/env bash
# The whole test suite: unit, root integration and VM (ublk under QEMU) tests.
#   scripts/test.sh [pytest args...]      e.g. scripts/test.sh -m unit
# Run as root (integration tests attach loop devices and mount). CI runs exactly this.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
[ -x "$PY" ] || { echo "test.sh: .venv missing: run scripts/setup.sh first" >&2; exit 2; }
"$PY" -m ruff format --check btrfs_ublk_image tests bench
"$PY" -m ruff check btrfs_ublk_image tests bench
"$PY" -m mypy
exec "$PY" -m pytest "$@"
