package raft

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"math/rand"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func dirSize(t *testing.T, dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// TestDataKeptOutOfLog proposes 32 MiB of data and checks that it reached
// every replica's state machine storage while the log directories hold
// only a small fraction of it; then a follower that was down catches up
// through resends that must read the data back (ReadData).
func TestDataKeptOutOfLog(t *testing.T) {
	const (
		chunk  = 256 << 10
		chunks = 128 // 32 MiB
	)
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	sms := map[uint64]*dataSM{}
	for id, h := range c.hosts {
		sms[id] = &dataSM{dir: filepath.Join(c.dir, fmt.Sprint(id), "data")}
		os.MkdirAll(sms[id].dir, 0o755)
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	all := []uint64{1, 2, 3}
	var lead *Group
	for lead == nil {
		lead = c.leaderOf(1, all)
		time.Sleep(10 * time.Millisecond)
	}
	// Stop one follower so that it will need resends of old entries.
	down := lead.host.id%3 + 1
	c.hosts[down].Close()
	delete(c.hosts, down)

	rnd := rand.New(rand.NewSource(1))
	payloads := map[uint64][]byte{}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := 0; i < chunks; i++ {
		data := make([]byte, chunk)
		rnd.Read(data)
		st := time.Now()
		res, err := lead.Propose(ctx, []byte(fmt.Sprintf("chunk-%d", i)), data)
		if err != nil {
			t.Fatal(err)
		}
		if d := time.Since(st); d > 50*time.Millisecond {
			t.Logf("slow proposal %d: %v", i, d)
		}
		payloads[res.Index] = data
	}
	// Bring the follower back on its old disk: it catches up from the log.
	h := c.start(down, 20*time.Millisecond)
	if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: all, StateMachine: sms[down]}); err != nil {
		t.Fatal(err)
	}
	var last uint64
	for idx := range payloads {
		last = max(last, idx)
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if err := lead.WaitAppliedAll(wctx, last); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, id := range all {
		sm := sms[id]
		for idx, want := range payloads {
			term := uint64(0)
			// Find the file for idx (the term is part of the name).
			matches, _ := filepath.Glob(filepath.Join(sm.dir, fmt.Sprintf("%d-*", idx)))
			if len(matches) != 1 {
				t.Fatalf("host %d: data of entry %d: %d files", id, idx, len(matches))
			}
			got, err := os.ReadFile(matches[0])
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("host %d: data of entry %d differs (%v)", id, idx, err)
			}
			_ = term
		}
		logBytes := dirSize(t, filepath.Join(c.dir, fmt.Sprint(id), "log"))
		total += logBytes
		t.Logf("host %d: log dir %d bytes for %d bytes of data (%.2f%%)", id, logBytes, chunks*chunk, 100*float64(logBytes)/float64(chunks*chunk))
		// The bound: the log holds metadata, not data. Pebble's fixed
		// files (OPTIONS, MANIFEST) are a few KiB; 2% of 32 MiB is 670 KB.
		if logBytes > chunks*chunk/50 {
			t.Errorf("host %d: log directory holds %d bytes, more than 2%% of the %d bytes proposed", id, logBytes, chunks*chunk)
		}
	}
	lsm := sms[lead.host.id]
	lsm.mu2.Lock()
	reads := lsm.reads
	lsm.mu2.Unlock()
	if reads == 0 {
		t.Error("the leader never read data back for a resend; the catch-up did not exercise ReadData")
	}
	t.Logf("leader ReadData calls: %d", reads)
}
