#!/bin/busybox sh
# PID 1 of fallow's test guests (the harness packs it as /init of the initramfs).
#
# It mounts the kernel's file systems, loads the virtio modules the Debian cloud kernel
# keeps outside its image, waits for the disks the host attached (fallow.disks=N), then
# runs /fallow/script: in the initramfs itself, or, with fallow.root=DEV, chrooted into
# the ext4 file system on DEV (mounted read-only unless fallow.rootrw=1), with /proc,
# /sys, /dev and tmpfs on /run and /tmp inside it, and fallow-guest-tool on its PATH.
# Whatever the script does, the guest then reports `FALLOW-EXIT STATUS` on the console,
# syncs and powers off: the harness reads that line, and QEMU (started with -no-reboot)
# exits when the guest does.
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp

for module in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
    insmod "/lib/modules/$module.ko" || echo "FALLOW-ERROR insmod $module failed"
done

arg() { # the value of kernel argument $1=..., or nothing
    for word in $(cat /proc/cmdline); do
        case "$word" in "$1="*) echo "${word#*=}" ;; esac
    done
}

finish() {
    echo "FALLOW-EXIT $1"
    sync
    poweroff -f
}

disks=$(arg fallow.disks)
waited=0
while [ "$(ls /sys/block | grep -c '^vd')" -lt "${disks:-0}" ] && [ $waited -lt 100 ]; do
    sleep 0.1
    waited=$((waited + 1))
done
if [ "$(ls /sys/block | grep -c '^vd')" -lt "${disks:-0}" ]; then
    echo "FALLOW-ERROR expected ${disks} virtio disks, found: $(ls /sys/block | tr '\n' ' ')"
    finish 125
fi
echo "FALLOW-BOOTED $(cut -d' ' -f1 /proc/uptime)"

[ -e /fallow/script ] || finish 0

root=$(arg fallow.root)
if [ -z "$root" ]; then
    sh /fallow/script
    finish $?
fi

mode=ro
[ "$(arg fallow.rootrw)" = 1 ] && mode=rw
mkdir -p /newroot
if ! mount -t ext4 -o "$mode" "$root" /newroot; then
    echo "FALLOW-ERROR cannot mount $root"
    finish 125
fi
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o size=16m tmpfs /newroot/dev/shm
mount -t tmpfs -o size=16m,mode=755 tmpfs /newroot/run
mount -t tmpfs -o size=32m,mode=1777 tmpfs /newroot/tmp
mkdir -p /newroot/run/fallow
cp /fallow/script /newroot/run/fallow/script
cp /bin/fallow-guest-tool /newroot/run/fallow/fallow-guest-tool
PATH=/run/fallow:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    chroot /newroot /bin/sh /run/fallow/script
status=$?
umount /newroot/tmp /newroot/run /newroot/dev/shm /newroot/dev/pts /newroot/dev \
    /newroot/sys /newroot/proc
# A clean unmount, so that the host's fsck finds the file system closed.
if ! umount /newroot; then
    echo "FALLOW-ERROR cannot unmount $root"
    [ $status -eq 0 ] && status=124
fi
finish $status
