package storage

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// VolumeCheck is the result of one volume's health check.
type VolumeCheck struct {
	Path string
	// Failed: the volume is failed (now or before this check).
	Failed bool
	// NewlyFailed: this check failed it, or it was failed since the last
	// check by a fatal error of its metadata store or a panic on a
	// storage goroutine (fatal.go), reported by this check.
	NewlyFailed bool
	Err         error
	Took        time.Duration
}

// probeName is the health check's file in <volume>/basalt/.
const probeName = "health.probe"

// probeSize: one 4 KiB page, enough to go through the device.
const probeSize = 4096

// CheckVolumes runs the health check of every volume not yet failed, in
// parallel, as HDFS's DiskChecker does: create a probe file in the
// volume's basalt directory, write it, fsync it, read it back and compare,
// delete it. A volume whose probe fails, or does not finish within
// timeout (a hung disk), is failed: its containers are reported UNHEALTHY
// and re-replicated from other datanodes. A full disk (ENOSPC, EDQUOT) is
// not a failure. A probe still running from an earlier, timed-out check
// is not started again. This is, with Pebble errors and write errors, the
// only way a volume fails: a missing or unreadable block file fails only
// its container (see VerifyBlock).
func (s *Store) CheckVolumes(timeout time.Duration) []VolumeCheck {
	if timeout <= 0 {
		timeout = time.Minute
	}
	s.mu.RLock()
	closed := s.closed
	s.mu.RUnlock()
	out := make([]VolumeCheck, len(s.volumes))
	if closed {
		return out
	}
	type result struct {
		i    int
		err  error
		took time.Duration
	}
	done := make(chan result, len(s.volumes))
	running := map[int]bool{}
	for i, v := range s.volumes {
		out[i].Path = v.path
		s.checkBackend(v)
		if v.failed.Load() {
			out[i].Failed, out[i].Err = true, v.err()
			// A volume failed by a fatal error of its metadata store (or
			// a panic on a storage goroutine) since the last check is
			// reported newly failed once, so the caller acts on it as on
			// a failed probe (the datanode logs it at ERROR, counts it,
			// reports soon and closes its replicas).
			out[i].NewlyFailed = v.fatalLogged.Load() && v.fatalChecked.CompareAndSwap(false, true)
			// Reported failed: a fatal error after this is no news
			// (the datanode would log, count and close it twice).
			v.fatalChecked.Store(true)
			continue
		}
		if !v.probing.CompareAndSwap(false, true) {
			continue // an earlier probe is stuck; its check failed the volume
		}
		running[i] = true
		go func() {
			start := time.Now()
			err := v.guardedProbe()
			v.probing.Store(false)
			done <- result{i, err, time.Since(start)}
		}()
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for len(running) > 0 {
		select {
		case r := <-done:
			delete(running, r.i)
			out[r.i].Took = r.took
			if r.err != nil {
				v := s.volumes[r.i]
				out[r.i].NewlyFailed = !v.failed.Load()
				out[r.i].Failed, out[r.i].Err = true, r.err
				v.fatalChecked.Store(true) // reported; see above
				v.fail(fmt.Errorf("health check: %w", r.err), s.opts.Logf)
			}
		case <-timer.C:
			for i := range running {
				v := s.volumes[i]
				err := fmt.Errorf("probe did not finish within %v", timeout)
				out[i].Err, out[i].Failed, out[i].NewlyFailed, out[i].Took = err, true, !v.failed.Load(), timeout
				v.fail(fmt.Errorf("health check: %w", err), s.opts.Logf)
			}
			return out
		}
	}
	return out
}

// guardedProbe is probe on its own goroutine: a panic in it fails the
// probe (so the volume), not the process.
func (v *volume) guardedProbe() (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic in the probe: %v", p)
		}
	}()
	return v.probe()
}

// probe creates, writes, syncs, reads back and removes the probe file.
func (v *volume) probe() error {
	dir := filepath.Join(v.path, "basalt")
	name := filepath.Join(dir, probeName)
	want := make([]byte, probeSize)
	rand.Read(want)
	full := func(err error) bool { return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) }
	// A probe left by a crash is replaced.
	if err := v.fs.Remove(name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove old probe: %w", err)
	}
	f, err := v.fs.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o644)
	if err != nil {
		if full(err) {
			return nil
		}
		return fmt.Errorf("create probe: %w", err)
	}
	err = func() error {
		defer f.Close()
		if _, err := f.WriteAt(want, 0); err != nil {
			return fmt.Errorf("write probe: %w", err)
		}
		if err := f.Sync(); err != nil {
			return fmt.Errorf("sync probe: %w", err)
		}
		got := make([]byte, probeSize)
		n, err := f.ReadAt(got, 0)
		if n < len(got) && err != nil {
			return fmt.Errorf("read probe: %w", err)
		}
		if !bytes.Equal(got, want) {
			return errors.New("probe read back differs from what was written")
		}
		return nil
	}()
	if rerr := v.fs.Remove(name); rerr != nil && err == nil {
		err = fmt.Errorf("remove probe: %w", rerr)
	}
	if err != nil && full(err) {
		return nil
	}
	if err == nil {
		if serr := vfs.SyncDir(v.fs, dir); serr != nil {
			err = fmt.Errorf("sync directory: %w", serr)
		}
	}
	return err
}
