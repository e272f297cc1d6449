#!/usr/bin/env bash
# Prints the Debian mirror this machine's apt already uses (deb822 sources first, then
# one-line ones; not the security archive), or nothing. The setup's backports step, the
# VM harness's private apt config and bare-check.sh reach Debian through it, so that no
# mirror is named anywhere but in the machine's own apt configuration.
set -euo pipefail
files=()
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [ -f "$f" ] && files+=("$f")
done
[ ${#files[@]} -gt 0 ] || exit 0
awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}
     $1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /:\/\// && $i !~ /security/) {print $i; exit}}' \
  "${files[@]}"
