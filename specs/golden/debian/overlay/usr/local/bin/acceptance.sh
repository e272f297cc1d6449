#!/bin/sh
# Runs inside the mounted, sprouted Debian golden image (chroot): the userland works and
# writes land on the sprout. Prints "acceptance ok" last; any failure exits non-zero.
set -eu
. /etc/os-release
echo "os: $PRETTY_NAME ($(cat /etc/debian_version))"
test "$(echo hello | sha256sum | cut -c1-16)" = 5891b5b522d5df08
n=$(ls /usr/bin | wc -l)
test "$n" -gt 100
dpkg-query -W -f='${Package}\n' | grep -qx dpkg
echo written >/root/acceptance-written
test "$(cat /root/acceptance-written)" = written
rm /root/acceptance-written
cp /usr/bin/dpkg /tmp/dpkg-copy
cmp /usr/bin/dpkg /tmp/dpkg-copy
rm /tmp/dpkg-copy
for cmd in bash sed grep tar gzip find xargs apt-get; do command -v "$cmd" >/dev/null; done
echo "acceptance ok: $n commands in /usr/bin"
