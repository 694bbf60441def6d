# Guest plumbing shared by the QEMU tests (scripts/test-pmem.sh; the same
# steps as scripts/test-zoned-vm.sh): host tools, Debian's
# bookworm-backports 6.12 kernel and busybox-static fetched once into
# $CACHE (never into the repository), modules with their dependencies,
# host binaries with their libraries, the initramfs, and a non-interactive
# QEMU run under software emulation (TCG; see
# ../shared/reference/vm-testing.md). Source it with CACHE and log set.

vm_host_tools() {
	local missing=()
	command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
	command -v cpio >/dev/null || missing+=(cpio)
	command -v xz >/dev/null || missing+=(xz-utils)
	if ((${#missing[@]})); then
		log "installing ${missing[*]}"
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
	fi
}

# vm_kernel fetches (once) and unpacks the kernel and busybox packages
# through a private apt configuration (the host's apt sources and state
# are left alone; the archive is the one the host's sources name), and
# sets vmlinuz, kver, moddir and busybox.
vm_kernel() {
	local DEBS=$CACHE/debs K=$CACHE/kernel
	if [ ! -e "$DEBS/.done" ]; then
		local mirror A key kpkg
		mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
		[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
		[ -n "$mirror" ] || { log "no Debian archive in the host's apt sources"; return 1; }
		A=$CACHE/apt
		mkdir -p "$A/lists/partial" "$A/archives/partial" "$DEBS"
		key=/usr/share/keyrings/debian-archive-keyring.gpg
		printf 'deb [signed-by=%s] %s bookworm main\ndeb [signed-by=%s] %s bookworm-backports main\n' "$key" "$mirror" "$key" "$mirror" >"$A/sources.list"
		local APT=(-o "Dir::Etc::SourceList=$A/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$A/lists"
			-o "Dir::Cache=$A" -o "Dir::Cache::archives=$A/archives" -o Debug::NoLocking=1 -o APT::Get::List-Cleanup=0)
		log "fetching package lists (bookworm, bookworm-backports)"
		apt-get "${APT[@]}" update -qq
		kpkg=$(apt-cache "${APT[@]}" search --names-only '^linux-image-6\.12\.[0-9]+\+bpo-amd64$|^linux-image-6\.12\.[0-9]+\+deb12-amd64$' | awk '{print $1}' | sort -V | tail -1)
		[ -n "$kpkg" ] || { log "no 6.12 kernel package found in bookworm-backports"; return 1; }
		log "downloading $kpkg and busybox-static"
		(cd "$DEBS" && apt-get "${APT[@]}" download "$kpkg" busybox-static >/dev/null)
		touch "$DEBS/.done"
	fi
	if [ ! -e "$K/.done" ]; then
		rm -rf "$K" && mkdir -p "$K"
		for d in "$DEBS"/*.deb; do dpkg-deb -x "$d" "$K"; done
		touch "$K/.done"
	fi
	vmlinuz=$(ls "$K"/boot/vmlinuz-* | head -1)
	kver=${vmlinuz##*/vmlinuz-}
	moddir=$K/lib/modules/$kver
	busybox=$K/bin/busybox
	log "kernel $kver"
}

# vm_modules NAME... collects the modules and their dependencies (from
# each module's modinfo "depends=" field; the package has no modules.dep)
# in load order into vm_mods.
vm_mods=()
declare -A vm_seen=()
vm_modfile() { # module name -> path (file names may use - for _)
	find "$moddir/kernel" -name "$1.ko*" -o -name "${1//_/-}.ko*" | head -1
}
vm_add_mod() {
	local name=$1 f dep
	[ -n "${vm_seen[$name]:-}" ] && return
	vm_seen[$name]=1
	f=$(vm_modfile "$name")
	[ -n "$f" ] || { log "module $name not in $kver (built in?)"; return; }
	for dep in $(xz -dcf "$f" | tr '\0' '\n' | sed -n 's/^depends=//p' | tr ',' ' '); do vm_add_mod "$dep"; done
	vm_mods+=("$f")
}
vm_modules() {
	local n
	for n in "$@"; do vm_add_mod "$n"; done
}

# vm_root DIR makes the initramfs tree: busybox, the collected modules
# (decompressed, in DIR/lib/modules with their load order in
# DIR/lib/modules/order).
vm_root() {
	local R=$1 m b
	rm -rf "$R" && mkdir -p "$R"/{bin,sbin,lib/modules,proc,sys,dev,tmp,mnt,etc}
	cp "$busybox" "$R/bin/busybox"
	for m in "${vm_mods[@]}"; do
		b=$(basename "$m")
		case $b in
		*.xz) xz -dc "$m" >"$R/lib/modules/${b%.xz}" ;;
		*.zst) zstd -qdc "$m" >"$R/lib/modules/${b%.zst}" ;;
		*) cp "$m" "$R/lib/modules/$b" ;;
		esac
		b=${b%.xz}
		echo "${b%.zst}" >>"$R/lib/modules/order"
	done
}

# vm_host_bin DIR SRC DEST copies a dynamically linked host program into
# the tree with its libraries and loader (busybox runs its own applets
# ahead of PATH: give DEST a name busybox has no applet for).
vm_host_bin() {
	local R=$1 src=$2 dst=$3 lib
	cp "$src" "$R$dst"
	for lib in $(ldd "$src" | awk '/=>/ {print $3} /^\t\/lib/ {print $1}'); do
		mkdir -p "$R$(dirname "$lib")"
		cp -L "$lib" "$R$lib"
	done
}

# vm_pack DIR OUT writes DIR as a gzipped newc initramfs.
vm_pack() {
	(cd "$1" && find . | cpio -o -H newc --quiet | gzip -1 >"$2")
	log "initramfs $(du -h "$2" | cut -f1)"
}

# vm_qemu TIMEOUT LOG INITRD EXTRA-QEMU-ARGS... boots the kernel with the
# initramfs under TCG, the serial console on stdout and in LOG; returns
# QEMU's exit status (124 on timeout).
vm_qemu() {
	local timeout=$1 out=$2 initrd=$3 rc
	shift 3
	set +e
	timeout "$timeout" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -no-reboot -nodefaults -display none \
		-serial stdio -kernel "$vmlinuz" -initrd "$initrd" \
		-append "console=ttyS0 panic=-1 rdinit=/init quiet ${VM_APPEND:-}" "$@" </dev/null | tee "$out"
	rc=${PIPESTATUS[0]}
	set -e
	return "$rc"
}
