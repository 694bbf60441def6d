// Command mkzonefs formats a zoned block device for zonefs, as
// zonefs-tools' mkzonefs does (Debian has no zonefs-tools): it resets every
// sequential zone, writes the 4 KiB super block at offset 0 with O_DIRECT,
// finishes zone 0 if it is sequential, and syncs. Used by
// scripts/test-zoned-vm.sh inside the guest.
//
//	mkzonefs [-label L] /dev/nullb0
package main

import (
	"encoding/binary"
	"flag"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	zonefsMagic = 0x5a4f4653
	superSize   = 4096
	// _IOW(0x12, 131 / 136, struct blk_zone_range{u64 sector, nr_sectors})
	blkResetZone  = 0x40101283
	blkFinishZone = 0x40101288
)

type zoneRange struct{ sector, nrSectors uint64 }

func main() {
	label := flag.String("label", "", "volume label (at most 64 bytes)")
	flag.Parse()
	if flag.NArg() != 1 || len(*label) > 64 {
		fmt.Fprintln(os.Stderr, "usage: mkzonefs [-label L] DEVICE")
		os.Exit(2)
	}
	if err := format(flag.Arg(0), *label); err != nil {
		fmt.Fprintln(os.Stderr, "mkzonefs:", err)
		os.Exit(1)
	}
}

func sysfs(dev, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), name))
	return strings.TrimSpace(string(b)), err
}

func format(dev, label string) error {
	if model, err := sysfs(dev, "queue/zoned"); err != nil || model == "none" {
		return fmt.Errorf("%s is not a zoned block device (%q, %v)", dev, model, err)
	}
	chunk, err := sysfs(dev, "queue/chunk_sectors")
	if err != nil {
		return err
	}
	zoneSectors, _ := strconv.ParseUint(chunk, 10, 64)
	sizeStr, err := sysfs(dev, "size")
	if err != nil {
		return err
	}
	sectors, _ := strconv.ParseUint(sizeStr, 10, 64)
	if zoneSectors == 0 || sectors == 0 {
		return fmt.Errorf("zone size %d sectors, capacity %d sectors", zoneSectors, sectors)
	}
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_DIRECT|unix.O_EXCL, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// Reset all sequential zones (a whole-device range is a reset-all,
	// which skips conventional zones).
	r := zoneRange{0, sectors}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), blkResetZone, uintptr(unsafe.Pointer(&r))); e != 0 {
		return fmt.Errorf("reset zones: %w", e)
	}
	// struct zonefs_super: magic, crc, label[64], uuid[16], features,
	// uid, gid, perm, reserved[3988] (all little-endian, reserved zero).
	buf := alignedBuf(superSize)
	binary.LittleEndian.PutUint32(buf[0:], zonefsMagic)
	copy(buf[8:72], label)
	uuid := buf[72:88]
	if _, err := readRandom(uuid); err != nil {
		return err
	}
	uuid[6] = uuid[6]&0x0f | 0x40 // version 4
	uuid[8] = uuid[8]&0x3f | 0x80
	// features, uid, gid, perm: 0 (defaults: root-owned files, 0640)
	// crc32_le(~0, super with s_crc zero), no final inversion.
	binary.LittleEndian.PutUint32(buf[4:], ^crc32.ChecksumIEEE(buf))
	if _, err := f.WriteAt(buf, 0); err != nil {
		return fmt.Errorf("write super block: %w", err)
	}
	// Zone 0 sequential: finish it so zonefs does not expose it.
	if t, err := zoneType0(dev); err == nil && t != "conventional" {
		r := zoneRange{0, zoneSectors}
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), blkFinishZone, uintptr(unsafe.Pointer(&r))); e != 0 {
			return fmt.Errorf("finish zone 0: %w", e)
		}
	}
	if err := unix.Fsync(int(f.Fd())); err != nil {
		return err
	}
	fmt.Printf("mkzonefs: %s formatted (%d zones of %d MiB)\n", dev, (sectors+zoneSectors-1)/zoneSectors, zoneSectors>>11)
	return nil
}

// zoneType0 tells whether zone 0 is conventional: null_blk and QEMU put
// conventional zones first, and the device's conventional zone count is
// in sysfs for null_blk only, so ask BLKREPORTZONE.
func zoneType0(dev string) (string, error) {
	f, err := os.Open(dev)
	if err != nil {
		return "", err
	}
	defer f.Close()
	// struct blk_zone_report { u64 sector; u32 nr_zones; u32 flags; struct blk_zone zones[]; }
	// struct blk_zone is 64 bytes; type at offset 24 (1 = conventional).
	var rep [16 + 64]byte
	binary.LittleEndian.PutUint32(rep[8:], 1)
	const blkReportZone = 0xc0101282 // _IOWR(0x12, 130, struct blk_zone_report)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), blkReportZone, uintptr(unsafe.Pointer(&rep[0]))); e != 0 {
		return "", e
	}
	if rep[16+24] == 1 {
		return "conventional", nil
	}
	return "sequential", nil
}

func readRandom(p []byte) (int, error) {
	f, err := os.Open("/dev/urandom")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.Read(p)
}

func alignedBuf(n int) []byte {
	b := make([]byte, n+4096)
	off := int(uintptr(unsafe.Pointer(&b[0])) & 4095)
	if off != 0 {
		off = 4096 - off
	}
	return b[off : off+n]
}
