package raft

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// stackSM is a DataStateMachine whose WriteData notes whether it runs on
// a host's store-loop goroutine (its stack reaches storeLoop.run) or on a
// goroutine started for it.
type stackSM struct {
	kvSM
	mu       sync.Mutex
	onLoop   int
	elsewise int
}

func (s *stackSM) WriteData(index, term uint64, meta, data []byte) error {
	buf := make([]byte, 64<<10)
	st := string(buf[:runtime.Stack(buf, false)])
	s.mu.Lock()
	if strings.Contains(st, ".(*storeLoop).run(") {
		s.onLoop++
	} else {
		s.elsewise++
	}
	s.mu.Unlock()
	return nil
}

func (s *stackSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	return nil, fmt.Errorf("entry %d: %w", index, ErrDataLost)
}

// TestWriteDataOnStoreLoop: with one group writing data in a Ready (the
// datanode's usual case, one pipeline per log store), the store loop
// writes it on its own goroutine instead of starting one per Ready, whose
// fresh stack grew through the state machine's write every time (issue
// 15: ~0.7% of a small-PUT server's CPU in runtime.copystack). Fails on
// the old code (every WriteData on a goroutine of its own).
func TestWriteDataOnStoreLoop(t *testing.T) {
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	all := []uint64{1, 2, 3}
	sms := map[uint64]*stackSM{}
	for _, id := range all {
		sms[id] = &stackSM{}
		if _, err := c.hosts[id].AddGroup(GroupConfig{ID: 1, Peers: all, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var lead *Group
	for lead == nil {
		if ctx.Err() != nil {
			t.Fatal("no leader")
		}
		lead = c.leaderOf(1, all)
		time.Sleep(10 * time.Millisecond)
	}
	for round := range 4 {
		metas, datas := make([][]byte, 8), make([][]byte, 8)
		for i := range metas {
			metas[i] = []byte(fmt.Sprintf("r%d-%d", round, i))
			datas[i] = bytes.Repeat([]byte{byte(i)}, 4096)
		}
		res, errs := lead.ProposeMany(ctx, metas, datas)
		var last uint64
		for i := range res {
			if errs[i] != nil {
				t.Fatal(errs[i])
			}
			last = max(last, res[i].Index)
		}
		if err := lead.WaitAppliedAll(ctx, last); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range all {
		s := sms[id]
		s.mu.Lock()
		on, off := s.onLoop, s.elsewise
		s.mu.Unlock()
		// (At least 32: a leader change resends entries.)
		if on < 32 || off != 0 {
			t.Errorf("host %d: WriteData %d times on the store loop, %d on other goroutines; want at least 32 and 0", id, on, off)
		}
	}
}
