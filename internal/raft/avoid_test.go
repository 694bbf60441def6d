package raft

import (
	"sync/atomic"
	"testing"
	"time"
)

// New groups go to the least-loaded log directory that is not avoided (a
// slow disk); groups already on an avoided one stay; when every directory
// is avoided, placement falls back to least-loaded.
func TestNewGroupsAvoidSlowLogDir(t *testing.T) {
	net := NewMemNetwork(13)
	var slowB, all atomic.Bool
	h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/a", "/b", "/c"}, FS: newMemFS(), Transport: net.Transport(1), TickInterval: 2 * time.Millisecond,
		AvoidLogDir: func(dir string) bool { return all.Load() || slowB.Load() && dir == "/b" }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	add := func(id uint64) string {
		t.Helper()
		g, err := h.AddGroup(GroupConfig{ID: id, Peers: []uint64{1}, StateMachine: &kvSM{}})
		if err != nil {
			t.Fatal(err)
		}
		return g.Status().LogDir
	}
	for id := uint64(1); id <= 3; id++ {
		add(id)
	}
	slowB.Store(true)
	for id := uint64(4); id <= 9; id++ {
		if d := add(id); d == "/b" {
			t.Fatalf("group %d placed on the avoided log dir", id)
		}
	}
	groups := map[string]int{}
	for _, d := range h.LogDirs() {
		groups[d.Dir] = d.Groups
	}
	if groups["/a"] != 4 || groups["/b"] != 1 || groups["/c"] != 4 {
		t.Fatalf("groups per log dir %v", groups)
	}
	all.Store(true)
	if d := add(10); d != "/b" {
		t.Fatalf("every dir avoided: group on %s, want the least-loaded /b", d)
	}
}
