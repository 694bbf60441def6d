package meta

import (
	"fmt"
	"sync"
)

// A meta node has one raft log directory (DATA_DIR/raft), holding every
// group it runs (namespace, SCM, members, CA, user tokens). When that
// directory fails (internal/raft/logfatal.go: a fatal I/O error of its
// Pebble, ENOSPC on its WAL included), every group stops and the node
// could serve nothing but errors. Before the raft log store contained such
// failures, Pebble's panic ended the process and its supervisor restarted
// it, which also heals a transient cause such as a full disk. So a meta
// node fail-stops: onLogDirFailed logs at ERROR and closes the server, and
// Failed/Err tell the process's main (`basalt meta` exits non-zero), so
// its supervisor restarts it as before. A restart re-opens the directory;
// if the disk still fails, New fails.

// failStop records the node's fatal failure.
type failStop struct {
	mu  sync.Mutex
	ch  chan struct{} // closed when err is set
	err error
}

func (f *failStop) done() chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ch == nil {
		f.ch = make(chan struct{})
	}
	return f.ch
}

// set records err and reports whether it is the first.
func (f *failStop) set(err error) bool {
	ch := f.done()
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return false
	}
	f.err = err
	close(ch)
	return true
}

// Failed is closed when the server stopped itself after a fatal failure
// (its raft log directory failed); Err then says why. The process should
// exit non-zero.
func (s *Server) Failed() <-chan struct{} { return s.fail.done() }

// Err is why the server stopped itself (see Failed), or nil.
func (s *Server) Err() error {
	s.fail.mu.Lock()
	defer s.fail.mu.Unlock()
	return s.fail.err
}

// onLogDirFailed is the raft host's OnLogDirFailed. It runs on the failed
// directory's loop goroutine, which Close waits for: the close runs aside.
func (s *Server) onLogDirFailed(dir string, err error, groups []uint64) {
	ferr := fmt.Errorf("meta: node %d: raft log directory %s failed (groups %v stopped); stopping the node so that it restarts: %w", s.cfg.NodeID, dir, groups, err)
	if !s.fail.set(ferr) {
		return
	}
	s.log.Error("meta node stopping: its raft log directory failed, every group on it is stopped", "dir", dir, "groups", groups, "err", err)
	go func() { _ = s.Close() }()
}
