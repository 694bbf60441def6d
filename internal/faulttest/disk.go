package faulttest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// SmallDisk is a loop-mounted ext4 file system for one datanode's data
// volume (its own disk), so the test can fill it to ENOSPC without
// filling the machine's disk. The image is sparse; the ballast that fills it is fallocated
// (unwritten extents), so filling costs neither time nor real space.
//
// Its size must leave room for a whole container (storage places a
// container only on a volume with ContainerSize free, 5 GiB by default):
// until the ballast goes in, the datanode behaves like the others.
type SmallDisk struct {
	Image string
	Mount string
	// Dir is the datanode's volume directory on the mount.
	Dir     string
	ballast string
	mounted bool
}

// NewSmallDisk creates a sparse image of size bytes in dir, formats it
// and mounts it on dir/name. It needs root.
func NewSmallDisk(dir, name string, size int64) (*SmallDisk, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("not root: cannot loop-mount a file system")
	}
	d := &SmallDisk{Image: filepath.Join(dir, name+"-disk.img"), Mount: filepath.Join(dir, name+"-disk")}
	d.Dir = filepath.Join(d.Mount, "vol")
	d.ballast = filepath.Join(d.Mount, "ballast")
	f, err := os.Create(d.Image)
	if err != nil {
		return nil, err
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		return nil, err
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", d.Image).CombinedOutput(); err != nil {
		os.Remove(d.Image)
		return nil, fmt.Errorf("mkfs.ext4 %s: %v: %s", d.Image, err, out)
	}
	if err := os.MkdirAll(d.Mount, 0o755); err != nil {
		return nil, err
	}
	if out, err := exec.Command("mount", "-o", "loop", d.Image, d.Mount).CombinedOutput(); err != nil {
		os.Remove(d.Image)
		return nil, fmt.Errorf("mount -o loop %s: %v: %s", d.Image, err, out)
	}
	d.mounted = true
	if err := os.MkdirAll(d.Dir, 0o755); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// Avail returns the bytes available to unprivileged users of the mount.
func (d *SmallDisk) Avail() (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(d.Mount, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// Fill allocates a ballast file until the file system has no free block
// left, and returns the bytes it took.
func (d *SmallDisk) Fill() (int64, error) {
	f, err := os.OpenFile(d.ballast, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	off, start := st.Size(), st.Size()
	avail, err := d.Avail()
	if err != nil {
		return 0, err
	}
	for n := avail; n >= 4096; {
		if err := unix.Fallocate(int(f.Fd()), 0, off, n); err != nil {
			if errors.Is(err, unix.ENOSPC) {
				n /= 2
				continue
			}
			return off - start, fmt.Errorf("fallocate %s at %d (+%d): %w", d.ballast, off, n, err)
		}
		off += n
	}
	// The last few blocks: write until ENOSPC.
	buf := make([]byte, 4096)
	for i := 0; i < 1024; i++ {
		if _, err := f.WriteAt(buf, off); err != nil {
			break
		}
		off += int64(len(buf))
	}
	f.Sync()
	return off - start, nil
}

// Release removes the ballast.
func (d *SmallDisk) Release() error {
	err := os.Remove(d.ballast)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// Close unmounts the file system and removes the image.
func (d *SmallDisk) Close() error {
	var errs []error
	if d.mounted {
		if out, err := exec.Command("umount", d.Mount).CombinedOutput(); err != nil {
			// A process still holding files open: detach lazily so the
			// image can go.
			if out2, err2 := exec.Command("umount", "-l", d.Mount).CombinedOutput(); err2 != nil {
				errs = append(errs, fmt.Errorf("umount %s: %v: %s; umount -l: %v: %s", d.Mount, err, out, err2, out2))
			}
		}
		d.mounted = false
	}
	if err := os.Remove(d.Image); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		os.Remove(d.Mount) // the empty mount point
	}
	return errors.Join(errs...)
}
