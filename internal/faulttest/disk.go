package faulttest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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

// ownerFile names the PID of the test process that owns a run directory.
const ownerFile = "owner.pid"

// ClaimDir records this process as the owner of a run directory.
func ClaimDir(dir string) error {
	return os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644)
}

// CleanStale cleans the run directories (matching pattern) that a test
// process which no longer runs left behind: a go test timeout kills the
// test binary without running its deferred cleanup (the servers die with
// it, through Pdeathsig, but the loop mounts and the data stay). It
// unmounts and removes everything but the logs. Directories whose owner
// still runs (another test in progress) or that a finished run released
// (logs kept on purpose) are left alone. It returns what it cleaned.
func CleanStale(pattern string) []string {
	dirs, _ := filepath.Glob(pattern)
	var out []string
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue // not ours, or not claimed yet
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) == nil || errors.Is(syscall.Kill(pid, 0), syscall.EPERM) {
			continue // its owner still runs
		}
		mounts, _ := filepath.Glob(filepath.Join(dir, "*-disk"))
		ok := true
		for _, m := range mounts {
			if err := unix.Unmount(m, 0); err != nil && !errors.Is(err, unix.EINVAL) {
				if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
					ok = false
				}
			}
		}
		if !ok {
			continue
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if e.Name() != "logs" {
				os.RemoveAll(filepath.Join(dir, e.Name()))
			}
		}
		out = append(out, dir)
	}
	return out
}
