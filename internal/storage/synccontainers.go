package storage

import (
	"errors"
	"slices"
	"sync"
)

// SyncContainers is Sync limited to the volumes holding the given
// containers: every chunk on those volumes whose WriteChunk returned before
// the call is durable when it returns nil. Other volumes are neither
// flushed nor waited for, so a slow disk delays only the writes whose data
// is on it (seed 001: with Sync, one slow volume stalled every pipeline of
// the datanode). An unknown container makes it a full Sync.
func (s *Store) SyncContainers(ids []ContainerID) error {
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return cErr("sync", ErrClosed, 0, "", nil)
	}
	var vols []*volume
	all := false
	for _, id := range ids {
		var v *volume
		if c := s.containers[id]; c != nil {
			v = c.visibleVol()
		}
		if v == nil {
			all = true
			break
		}
		if !slices.Contains(vols, v) {
			vols = append(vols, v)
		}
	}
	s.mu.RUnlock()
	if all || len(vols) == len(s.volumes) {
		return s.Sync()
	}
	return onVolumes(vols, s.syncVolume)
}

// onVolumes runs f on each of vols, in parallel (a slow disk delays only
// its own call), and joins the errors.
func onVolumes(vols []*volume, f func(*volume) error) error {
	if len(vols) == 1 {
		return f(vols[0])
	}
	errs := make([]error, len(vols))
	var wg sync.WaitGroup
	for i, v := range vols {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(v)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
