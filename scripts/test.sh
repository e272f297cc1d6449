#!/usr/bin/env bash
# The whole test suite: unit, root integration and VM (ublk under QEMU) tests.
#   scripts/test.sh [pytest args...]      e.g. scripts/test.sh -m unit
# Run as root (integration tests attach loop devices and mount). CI runs exactly this.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
[ -x "$PY" ] || { echo "test.sh: .venv missing: run scripts/setup.sh first" >&2; exit 2; }
"$PY" -m ruff format --check .
"$PY" -m ruff check .
"$PY" -m mypy
# ublkd: rustfmt and clippy where the toolchain has them (rustup's does; Debian's cargo
# package has neither, and setup falls back to it only without rustup)
if cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1; then
  (cd ublkd && cargo fmt --check && cargo clippy --release --locked -q --all-targets -- -D warnings)
  (cd native && cargo fmt --check && cargo clippy --release --locked -q --all-targets -- -D warnings)
else
  echo "test.sh: cargo fmt/clippy not installed: ublkd's format and lints NOT checked" >&2
fi
# the Rust crates' own tests (ublkd's frontends and sources; the extension's readers,
# hashers and pack: sha256x4's property test against sha2, the mapping's truncation)
(cd ublkd && cargo test --release --locked -q)
(cd native && cargo test --release --locked -q)
# the snapshotter (Go): gofmt, go vet, its unit tests
# (the Go setup.sh found; go.mod's toolchain where that one is older)
if GO=$(scripts/find-go.sh); then
  export GOTOOLCHAIN=auto
  unformatted=$(cd snapshotter && "$("$GO" env GOROOT)/bin/gofmt" -l .)
  [ -z "$unformatted" ] || { echo "test.sh: gofmt: $unformatted" >&2; exit 1; }
  (cd snapshotter && GOFLAGS=-buildvcs=false "$GO" vet ./... && GOFLAGS=-buildvcs=false "$GO" test ./...)
else
  echo "test.sh: no Go >= 1.21: the snapshotter's format, vet and unit tests NOT checked" >&2
fi
exec "$PY" -m pytest "$@"
