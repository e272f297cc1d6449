#!/bin/busybox sh
# Guest /init (packed into the initramfs by tests/vm/harness.py; busybox sh, runs as PID 1).
#
# Reaches the host root over 9p (read-only), puts an overlay with a tmpfs upper on top of it,
# mounts the rw 9p "out" share on /vmout, then runs /vmout/run.sh (written by the harness) as
# root in a chroot of that overlay. Its exit status lands in /vmout/rc.
#
# Kernel command line: vm.mods=<host path of the extracted kernel's lib/modules>.
# Markers on the console (the harness watches them):
#   "VM: init done"        userspace reached, the run script starts now
#   "VM: FAIL <why>"       setup failed; the VM powers off at once
#   "VM: run exit <rc>"    the run script finished
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
	echo "VM: FAIL $*"
	poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

for m in $(cat /lib/modules/order); do
	insmod "/lib/modules/$m" || echo "VM: insmod $m failed"
done

MODS=
for a in $(cat /proc/cmdline); do
	case $a in
	vm.mods=*) MODS=${a#vm.mods=} ;;
	esac
done

mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /mnt ||
	fail "9p mount of the host root failed"
mount -t tmpfs -o size=75% tmpfs /upper || fail "tmpfs for the overlay upper failed"
mkdir -p /upper/u /upper/w
mount -t overlay -o lowerdir=/mnt,upperdir=/upper/u,workdir=/upper/w overlay /newroot ||
	fail "overlay mount over the 9p host root failed"

mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm /newroot/run /newroot/tmp /newroot/vmout
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/run
# /tmp stays the host's (read-only lower, tmpfs upper): the checkout under test may live there
# (CI clones anywhere), and the guest must see its .venv and sources at the same path.
# The host's kernel has no modules (often no /lib/modules at all): use the guest kernel's.
mkdir -p /newroot/lib/modules
[ -n "$MODS" ] && [ -d "/mnt$MODS" ] || fail "kernel modules dir '$MODS' not visible over 9p"
mount --bind "/mnt$MODS" /newroot/lib/modules
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /newroot/vmout ||
	fail "9p mount of the rw out share failed"
[ -f /newroot/vmout/run.sh ] || fail "/vmout/run.sh missing"
ip link set lo up 2>/dev/null

# What udev/systemd-tmpfiles do on a real system: static device nodes for on-demand module
# loading (opening /dev/loop-control loads loop), and a modprobe the kernel can run. The
# kernel runs its modprobe helper with PID 1's root, which is this initramfs (the run script
# is only chrooted), so the helper chroots into the guest root to use its modprobe.
KV=$(uname -r)
if [ -f "/newroot/lib/modules/$KV/modules.devname" ]; then
	while read -r mod name dev; do
		case $mod in '#'* | '') continue ;; esac
		[ -e "/newroot/dev/$name" ] && continue
		mm=${dev#?}
		mkdir -p "$(dirname "/newroot/dev/$name")"
		mknod -m 600 "/newroot/dev/$name" "${dev%%[0-9]*}" "${mm%%:*}" "${mm#*:}"
	done <"/newroot/lib/modules/$KV/modules.devname"
fi
printf '#!/bin/sh\nexec /bin/chroot /newroot /sbin/modprobe "$@"\n' >/bin/modprobe-guest
chmod 755 /bin/modprobe-guest
echo /bin/modprobe-guest >/newroot/proc/sys/kernel/modprobe

echo "VM: init done at uptime $(cut -d' ' -f1 /newroot/proc/uptime)s"
chroot /newroot /bin/bash /vmout/run.sh
rc=$?
echo "$rc" >/newroot/vmout/rc
echo "VM: run exit $rc"
sync
umount /newroot/vmout
poweroff -f
