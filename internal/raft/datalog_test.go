package raft

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// loggedSM keeps small data in the log (DataLogger): WriteDataLogged only
// notes the data in memory, and Apply records the data the host hands it
// (Entry.Data). AppliedIndex stays 0, as for a state machine that has
// persisted nothing: after a restart the host applies every entry again
// from the log.
type loggedSM struct {
	kvSM
	mu3     sync.Mutex
	written map[uint64][]byte // WriteDataLogged, in memory only
	got     map[uint64][]byte // Entry.Data seen by Apply
	syncs   int
	small   int // data up to this many bytes stays in the log
}

func newLoggedSM() *loggedSM {
	return &loggedSM{written: map[uint64][]byte{}, got: map[uint64][]byte{}, small: 8192}
}

func (s *loggedSM) WriteData(index, term uint64, meta, data []byte) error {
	_, err := s.WriteDataLogged(index, term, meta, data)
	return err
}

func (s *loggedSM) WriteDataLogged(index, term uint64, meta, data []byte) (bool, error) {
	s.mu3.Lock()
	defer s.mu3.Unlock()
	s.written[index] = data
	return len(data) <= s.small, nil
}

func (s *loggedSM) SyncData() error {
	s.mu3.Lock()
	s.syncs++
	s.mu3.Unlock()
	return nil
}

func (s *loggedSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	s.mu3.Lock()
	defer s.mu3.Unlock()
	if d, ok := s.written[index]; ok {
		return d, nil
	}
	return nil, fmt.Errorf("entry %d: %w", index, ErrDataLost)
}

func (s *loggedSM) Apply(ents []Entry) []any {
	s.mu3.Lock()
	for _, e := range ents {
		if e.Data != nil {
			s.got[e.Index] = append([]byte(nil), e.Data...)
		}
	}
	s.mu3.Unlock()
	return s.kvSM.Apply(ents)
}

func (s *loggedSM) AppliedIndex() uint64 { return 0 }

// TestDataLoggerKeepsDataInLog: entries whose data the state machine
// leaves in the log (DataLogger) are stored with it: no SyncData is asked
// for them before the append, and after every host restarts with a state
// machine that lost everything, each replica's replay hands every entry's
// data back to Apply from its own log (Entry.Data), the former leader's
// included. Fails on the old code (no DataLogger; the log kept the data
// elided and a replay had nothing but the metadata).
func TestDataLoggerKeepsDataInLog(t *testing.T) {
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	all := []uint64{1, 2, 3}
	sms := map[uint64]*loggedSM{}
	for _, id := range all {
		sms[id] = newLoggedSM()
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
	want := map[uint64][]byte{}
	metas := make([][]byte, 16)
	datas := make([][]byte, 16)
	for i := range metas {
		metas[i] = []byte(fmt.Sprintf("small-%d", i))
		datas[i] = bytes.Repeat([]byte{byte(i + 1)}, 4096)
	}
	res, errs := lead.ProposeMany(ctx, metas, datas)
	var last uint64
	for i := range res {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		want[res[i].Index] = datas[i]
		last = max(last, res[i].Index)
	}
	if err := lead.WaitAppliedAll(ctx, last); err != nil {
		t.Fatal(err)
	}
	for _, id := range all {
		sms[id].mu3.Lock()
		n := sms[id].syncs
		sms[id].mu3.Unlock()
		if n != 0 {
			t.Errorf("host %d: SyncData called %d times for data kept in the log", id, n)
		}
	}
	// Every host goes down; each comes back with a state machine that
	// kept nothing (AppliedIndex 0): the data can only come from the log.
	for _, id := range all {
		c.hosts[id].Close()
	}
	fresh := map[uint64]*loggedSM{}
	for _, id := range all {
		h := c.start(id, 20*time.Millisecond)
		fresh[id] = newLoggedSM()
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: all, StateMachine: fresh[id]}); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range all {
		for {
			fresh[id].mu3.Lock()
			n := len(fresh[id].got)
			fresh[id].mu3.Unlock()
			if n >= len(want) {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("host %d: after the restart, Apply got the data of %d of %d entries from the log", id, n, len(want))
			}
			time.Sleep(10 * time.Millisecond)
		}
		fresh[id].mu3.Lock()
		for idx, d := range want {
			if !bytes.Equal(fresh[id].got[idx], d) {
				t.Errorf("host %d: entry %d: Apply got %d bytes of data from the log, want its %d bytes", id, idx, len(fresh[id].got[idx]), len(d))
			}
		}
		fresh[id].mu3.Unlock()
	}
}
