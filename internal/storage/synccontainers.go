package storage

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
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
	vols, all, err := s.volumesOf(ids, make([]*volume, 0, 4))
	if err != nil {
		return err
	}
	if all || len(vols) == len(s.volumes) {
		return s.Sync()
	}
	return onVolumes(vols, s.syncVolume)
}

// volumesOf appends to vols the volumes holding containers ids, or
// reports all if one is unknown (or being imported). It releases s.mu by
// defer: a caller's guard may recover a panic from SyncContainers (the
// datanode's SyncData).
func (s *Store) volumesOf(ids []ContainerID, vols []*volume) (_ []*volume, all bool, err error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return nil, false, cErr("sync", ErrClosed, 0, "", nil)
	}
	for _, id := range ids {
		var v *volume
		if c := s.containers[id]; c != nil {
			v = c.visibleVol()
		}
		if v == nil {
			return nil, true, nil
		}
		if !slices.Contains(vols, v) {
			vols = append(vols, v)
		}
	}
	return vols, false, nil
}

// onVolumes runs f on each of vols, in parallel (a slow disk delays only
// its own call), and joins the errors. A panic in f on a volume's
// goroutine is raised again on the caller's once every call has returned
// (a runtime error stays one, as volumePanic), as with one volume, where f
// runs on the caller's goroutine: a caller's guard sees it either way,
// instead of the process going down with two volumes and not with one.
func onVolumes(vols []*volume, f func(*volume) error) error {
	if len(vols) == 1 {
		return f(vols[0])
	}
	errs := make([]error, len(vols))
	panics := make([]any, len(vols))
	var wg sync.WaitGroup
	for i, v := range vols {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					panics[i] = carried(p)
				}
			}()
			errs[i] = f(v)
		}()
	}
	wg.Wait()
	for _, p := range panics {
		if p != nil {
			panic(p)
		}
	}
	return errors.Join(errs...)
}

// carried wraps a panic value recovered on a volume's goroutine, with the
// goroutine's stack, to raise it again on the caller's (onVolumes).
func carried(p any) any {
	stack := debug.Stack()
	if re, ok := p.(runtime.Error); ok {
		return volumePanic{re, stack}
	}
	return fmt.Sprintf("%v\n[raised on a volume's goroutine]\n%s", p, stack)
}

// volumePanic is a runtime error raised on a volume's goroutine, carried
// to the caller's (onVolumes).
type volumePanic struct {
	err   runtime.Error
	stack []byte
}

func (p volumePanic) RuntimeError() {}
func (p volumePanic) Error() string {
	return p.err.Error() + "\n[raised on a volume's goroutine]\n" + string(p.stack)
}
func (p volumePanic) Unwrap() error { return p.err }
