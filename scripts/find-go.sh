#!/usr/bin/env bash
# Prints the path of a Go toolchain >= 1.21 (one that fetches go.mod's newer toolchain
# itself under GOTOOLCHAIN=auto), or exits 1: PATH's go, then the places Go's release
# and Debian's golang packages (backports' golang-X-go included) put theirs. Used by
# scripts/setup.sh and scripts/test.sh, so both run the same Go.
set -euo pipefail
GO_MIN=1.21
for g in "$(command -v go || true)" /usr/local/go/bin/go /usr/lib/go/bin/go /usr/lib/go-1.*/bin/go; do
  [ -n "$g" ] && [ -x "$g" ] || continue
  have=$(GOTOOLCHAIN=local "$g" env GOVERSION 2>/dev/null | sed 's/^go//')
  if [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$GO_MIN" "$have" | sort -V | head -1)" = "$GO_MIN" ]; then
    echo "$g"
    exit 0
  fi
done
exit 1
