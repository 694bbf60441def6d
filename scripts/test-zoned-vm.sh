#!/usr/bin/env bash
# make test-zoned-vm: the zoned backend on a real zonefs, in a QEMU guest
# under software emulation (TCG). The guest loads null_blk with zoned
# devices, formats zonefs on them with our mkzonefs, runs the zoned
# backend's tests on one (TestRealZonefs: geometry from sysfs, parallel
# streams, restart, cleaner, resets) and a 3-datanode `basalt dev
# --zoned=<mounts>` on three others (put a key, read it back, restart,
# read it again), prints a result line on the serial console and powers
# off. Exit status 0 only on PASS.
#
# Everything the guest needs (Debian's bookworm-backports 6.12 kernel
# package, busybox-static, the static Go binaries, the initramfs) is
# fetched or built into $BASALT_VM_CACHE (default ~/.cache/basalt-vm),
# never into the repository. Host packages missing (qemu-system-x86, cpio,
# xz-utils) are installed with apt-get. Shared plumbing:
# scripts/vm/guest.sh.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${BASALT_VM_CACHE:-$HOME/.cache/basalt-vm}
GO=${GO:-go}
TIMEOUT=${VM_TIMEOUT:-900}
mkdir -p "$CACHE"
log() { echo "test-zoned-vm: $*" >&2; }

. "$REPO/scripts/vm/guest.sh" # host tools, kernel, modules, initramfs, QEMU
vm_host_tools
vm_kernel
vm_modules null_blk zonefs
[ -n "$(vm_modfile zonefs)" ] && [ -n "$(vm_modfile null_blk)" ] || { log "null_blk or zonefs missing"; exit 1; }

# --- static binaries -------------------------------------------------------
W=$CACHE/work
mkdir -p "$W"
vm_root "$W/root"
log "building the static test binaries"
(cd "$REPO" &&
	CGO_ENABLED=0 $GO test -c -o "$W/root/bin/zoned.test" ./internal/storage/zoned &&
	CGO_ENABLED=0 $GO build -o "$W/root/bin/basalt" ./cmd/basalt &&
	CGO_ENABLED=0 $GO build -o "$W/root/bin/mkzonefs" ./scripts/vm/mkzonefs)

cat >"$W/root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
ip link set lo up
result=FAIL
run() {
	for m in $(cat /lib/modules/order); do
		case $m in
		null_blk.ko) insmod /lib/modules/$m nr_devices=4 zoned=1 zone_size=64 zone_nr_conv=2 gb=8 memory_backed=1 zone_max_open=6 zone_max_active=8 || return 1 ;;
		*) insmod /lib/modules/$m || return 1 ;;
		esac
	done
	for i in 0 1 2 3; do
		/bin/mkzonefs /dev/nullb$i || return 1
		mkdir -p /mnt/z$i && mount -t zonefs /dev/nullb$i /mnt/z$i || return 1
	done
	echo "== zonefs on /mnt/z0: $(ls /mnt/z0/seq | wc -l) sequential zones"
	echo "== go test TestRealZonefs"
	BASALT_ZONEFS=/mnt/z0 /bin/zoned.test -test.v -test.count=1 -test.run '^TestRealZonefs$' -test.timeout 10m || return 1
	echo "== basalt dev --zoned on /mnt/z1..z3"
	head -c 20000000 /dev/urandom >/tmp/in.bin
	dev() { /bin/basalt dev --zoned=/mnt/z1,/mnt/z2,/mnt/z3 --data-dir /tmp/dev --base-port 20000 --s3 127.0.0.1:0 --webhdfs "" --metrics 127.0.0.1:0 >/tmp/dev.log 2>&1 & echo $! >/tmp/dev.pid; }
	waitdev() { for _ in $(seq 120); do grep -q '^ready' /tmp/dev.log && return 0; sleep 1; done; cat /tmp/dev.log; return 1; }
	B="/bin/basalt sh --meta 127.0.0.1:20000 --tls-dir /tmp/dev/tls/client-cli"
	dev; waitdev || return 1
	$B volume create /vol1 && $B bucket create /vol1/bkt1 && $B key put /vol1/bkt1/k1 /tmp/in.bin && $B key get /vol1/bkt1/k1 /tmp/out.bin || return 1
	cmp /tmp/in.bin /tmp/out.bin || return 1
	echo "== read back; restarting the cluster"
	kill $(cat /tmp/dev.pid); for _ in $(seq 60); do kill -0 $(cat /tmp/dev.pid) 2>/dev/null || break; sleep 1; done
	dev; waitdev || return 1
	$B key get /vol1/bkt1/k1 /tmp/out2.bin && cmp /tmp/in.bin /tmp/out2.bin || return 1
	echo "== read back after the restart"
	for i in 1 2 3; do echo "zone files written on /mnt/z$i: $(for f in /mnt/z$i/seq/*; do [ -s $f ] && echo $f; done | wc -l)"; done
	kill $(cat /tmp/dev.pid)
	return 0
}
if run; then result=PASS; fi
echo "BASALT-ZONED-VM-RESULT: $result"
sync
poweroff -f
INIT
chmod +x "$W/root/init"
vm_pack "$W/root" "$W/initrd.gz"
log "booting (TCG, timeout ${TIMEOUT}s)"

out=$W/console.log
rc=0
vm_qemu "$TIMEOUT" "$out" "$W/initrd.gz" -m 3G || rc=$?
if [ "$rc" -ne 0 ]; then
	log "qemu exited with $rc"
	exit 1
fi
if grep -q '^BASALT-ZONED-VM-RESULT: PASS' "$out"; then
	log "PASS"
	exit 0
fi
log "FAIL (console log: $out)"
exit 1
