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
# xz-utils) are installed with apt-get.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${BASALT_VM_CACHE:-$HOME/.cache/basalt-vm}
GO=${GO:-go}
TIMEOUT=${VM_TIMEOUT:-900}
mkdir -p "$CACHE"
log() { echo "test-zoned-vm: $*" >&2; }

# --- host tools -----------------------------------------------------------
missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
command -v cpio >/dev/null || missing+=(cpio)
command -v xz >/dev/null || missing+=(xz-utils)
if ((${#missing[@]})); then
	log "installing ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- kernel and busybox packages, through a private apt configuration -----
# (the host's apt sources and state are left alone; the archive is the one
# the host's sources name).
DEBS=$CACHE/debs
if [ ! -e "$DEBS/.done" ]; then
	mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
	[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
	[ -n "$mirror" ] || { log "no Debian archive in the host's apt sources"; exit 1; }
	A=$CACHE/apt
	mkdir -p "$A/lists/partial" "$A/archives/partial" "$DEBS"
	key=/usr/share/keyrings/debian-archive-keyring.gpg
	printf 'deb [signed-by=%s] %s bookworm main\ndeb [signed-by=%s] %s bookworm-backports main\n' "$key" "$mirror" "$key" "$mirror" >"$A/sources.list"
	APT=(-o "Dir::Etc::SourceList=$A/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$A/lists"
		-o "Dir::Cache=$A" -o "Dir::Cache::archives=$A/archives" -o Debug::NoLocking=1 -o APT::Get::List-Cleanup=0)
	log "fetching package lists (bookworm, bookworm-backports)"
	apt-get "${APT[@]}" update -qq
	kpkg=$(apt-cache "${APT[@]}" search --names-only '^linux-image-6\.12\.[0-9]+\+bpo-amd64$|^linux-image-6\.12\.[0-9]+\+deb12-amd64$' | awk '{print $1}' | sort -V | tail -1)
	[ -n "$kpkg" ] || { log "no 6.12 kernel package found in bookworm-backports"; exit 1; }
	log "downloading $kpkg and busybox-static"
	(cd "$DEBS" && apt-get "${APT[@]}" download "$kpkg" busybox-static >/dev/null)
	touch "$DEBS/.done"
fi

# --- unpack the kernel, pick the modules ----------------------------------
K=$CACHE/kernel
if [ ! -e "$K/.done" ]; then
	rm -rf "$K" && mkdir -p "$K"
	for d in "$DEBS"/*.deb; do dpkg-deb -x "$d" "$K"; done
	touch "$K/.done"
fi
vmlinuz=$(ls "$K"/boot/vmlinuz-* | head -1)
kver=${vmlinuz##*/vmlinuz-}
moddir=$K/lib/modules/$kver
log "kernel $kver"

# modules with their dependencies (from each module's modinfo "depends="
# field; the package has no modules.dep), in load order
modfile() { # module name -> path (file names may use - for _)
	find "$moddir/kernel" -name "$1.ko*" -o -name "${1//_/-}.ko*" | head -1
}
declare -A seen=()
order=()
add_mod() {
	local name=$1 f dep
	[ -n "${seen[$name]:-}" ] && return
	seen[$name]=1
	f=$(modfile "$name")
	[ -n "$f" ] || { log "module $name not in $kver (built in?)"; return; }
	for dep in $(xz -dcf "$f" | tr '\0' '\n' | sed -n 's/^depends=//p' | tr ',' ' '); do add_mod "$dep"; done
	order+=("$f")
}
for name in null_blk zonefs; do add_mod "$name"; done
[ -n "$(modfile zonefs)" ] && [ -n "$(modfile null_blk)" ] || { log "null_blk or zonefs missing"; exit 1; }

# --- static binaries -------------------------------------------------------
W=$CACHE/work
rm -rf "$W" && mkdir -p "$W/root"/{bin,lib/modules,proc,sys,dev,tmp,mnt,etc}
log "building the static test binaries"
(cd "$REPO" &&
	CGO_ENABLED=0 $GO test -c -o "$W/root/bin/zoned.test" ./internal/storage/zoned &&
	CGO_ENABLED=0 $GO build -o "$W/root/bin/basalt" ./cmd/basalt &&
	CGO_ENABLED=0 $GO build -o "$W/root/bin/mkzonefs" ./scripts/vm/mkzonefs)
cp "$K/bin/busybox" "$W/root/bin/busybox"
for m in "${order[@]}"; do
	b=$(basename "$m")
	case $b in
	*.xz) xz -dc "$m" >"$W/root/lib/modules/${b%.xz}" ;;
	*.zst) zstd -qdc "$m" >"$W/root/lib/modules/${b%.zst}" ;;
	*) cp "$m" "$W/root/lib/modules/$b" ;;
	esac
	b=${b%.xz}
	echo "${b%.zst}" >>"$W/root/lib/modules/order"
done

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
(cd "$W/root" && find . | cpio -o -H newc --quiet | gzip -1 >"$W/initrd.gz")
log "initramfs $(du -h "$W/initrd.gz" | cut -f1); booting (TCG, timeout ${TIMEOUT}s)"

out=$W/console.log
set +e
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 3G -no-reboot -nodefaults -display none \
	-serial stdio -kernel "$vmlinuz" -initrd "$W/initrd.gz" \
	-append "console=ttyS0 panic=-1 rdinit=/init quiet" </dev/null | tee "$out"
rc=${PIPESTATUS[0]}
set -e
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
