package meta

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// MembersGroup is the Raft group of the member table (members.go): every
// meta node hosts it, as it hosts the namespace, SCM, CA and user-token
// groups.
const MembersGroup uint64 = 5

// Bounds of the member table (Apply refuses beyond them).
const (
	maxMembers       = 1024 // rows, removed members included
	maxMemberAddrLen = 256
)

var membersPfx = []byte("m/")

// membersState is the state machine of the members group: node ID →
// addresses, or removed. A removed row is kept for good: the ID may not
// come back (a node that kept its old log under that ID could otherwise
// rejoin with votes and entries the others no longer count on).
type membersState struct {
	st *store.Store

	mu      sync.RWMutex
	members map[uint64]*metapb.MemberInfo
	// changed is called after an Apply or Restore changed the table, with
	// s.mu not held.
	changed func()
}

func openMembersState(dir string, opts store.Options) (*membersState, error) {
	st, err := store.Open(dir, opts)
	if err != nil {
		return nil, err
	}
	s := &membersState{st: st}
	if err := s.load(); err != nil {
		st.Close()
		return nil, err
	}
	return s, nil
}

func (s *membersState) load() error {
	m := map[uint64]*metapb.MemberInfo{}
	err := s.st.View(func(r pebble.Reader) error {
		return store.Scan(r, membersPfx, func(k, v []byte) error {
			mi := &metapb.MemberInfo{}
			if err := proto.Unmarshal(v, mi); err != nil {
				return fmt.Errorf("members: row %q: %w", k, err)
			}
			m[mi.GetId()] = mi
			return nil
		})
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.members = m
	s.mu.Unlock()
	return nil
}

// Table returns a copy of the table, sorted by ID.
func (s *membersState) Table() []*metapb.MemberInfo {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.MemberInfo, 0, len(s.members))
	for _, m := range s.members {
		out = append(out, proto.Clone(m).(*metapb.MemberInfo))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetId() < out[j].GetId() })
	return out
}

// Removed reports whether id's row says removed, without copying the
// row (checked on every RPC from a meta certificate: auth.go).
func (s *membersState) Removed(id uint64) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.members[id].GetRemoved()
}

// Get returns id's row (nil: none).
func (s *membersState) Get(id uint64) *metapb.MemberInfo {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if m := s.members[id]; m != nil {
		return proto.Clone(m).(*metapb.MemberInfo)
	}
	return nil
}

func (s *membersState) Close() error                             { return s.st.Close() }
func (s *membersState) AppliedIndex() uint64                     { return s.st.DurableIndex() }
func (s *membersState) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }

func (s *membersState) Restore(index uint64, r io.Reader) error {
	if err := s.st.Restore(index, r); err != nil {
		return err
	}
	if err := s.load(); err != nil {
		return err
	}
	if s.changed != nil {
		s.changed()
	}
	return nil
}

// validateMemberInfo checks a SetMember command (the proposer checked it
// already; Apply checks again: the log is the contract).
func validateMemberInfo(m *metapb.MemberInfo) error {
	if m.GetId() == 0 {
		return errors.New("node ID 0")
	}
	if m.GetRemoved() {
		return errors.New("set_member with removed set")
	}
	for _, a := range []string{m.GetRaftAddr(), m.GetGrpcAddr()} {
		if err := validateHostPort(a); err != nil {
			return err
		}
	}
	return nil
}

// Apply applies entries in one batch; a result is nil or a status error
// (a refused command changes nothing).
func (s *membersState) Apply(entries []store.Entry) []any {
	out := make([]any, len(entries))
	if len(entries) == 0 {
		return out
	}
	s.mu.Lock()
	next := make(map[uint64]*metapb.MemberInfo, len(s.members)+1)
	for id, m := range s.members {
		next[id] = m
	}
	s.mu.Unlock()
	b := s.st.NewBatch()
	changed := false
	put := func(m *metapb.MemberInfo) {
		v, err := proto.Marshal(m)
		if err != nil {
			panic(err)
		}
		if err := b.Set(append(append([]byte(nil), membersPfx...), store.U64(m.GetId())...), v, nil); err != nil {
			panic(err)
		}
		next[m.GetId()] = m
		changed = true
	}
	for i, e := range entries {
		if len(e.Cmd) == 0 {
			continue // raft's own entries (leader no-ops, membership changes)
		}
		cmd := &metapb.MembersCommand{}
		if err := proto.Unmarshal(e.Cmd, cmd); err != nil {
			out[i] = status.Errorf(codes.InvalidArgument, "members: undecodable command at index %d: %v", e.Index, err)
			continue
		}
		switch op := cmd.GetOp().(type) {
		case *metapb.MembersCommand_SetMember:
			m := op.SetMember
			if err := validateMemberInfo(m); err != nil {
				out[i] = status.Errorf(codes.InvalidArgument, "members: %v", err)
				continue
			}
			if old := next[m.GetId()]; old != nil && old.GetRemoved() {
				out[i] = status.Errorf(codes.FailedPrecondition, "members: node %d was removed; a replacement takes a new ID", m.GetId())
				continue
			}
			if next[m.GetId()] == nil && len(next) >= maxMembers {
				out[i] = status.Errorf(codes.ResourceExhausted, "members: the table holds %d nodes, at most %d", len(next), maxMembers)
				continue
			}
			put(&metapb.MemberInfo{Id: m.GetId(), RaftAddr: m.GetRaftAddr(), GrpcAddr: m.GetGrpcAddr()})
		case *metapb.MembersCommand_RemoveMember:
			id := op.RemoveMember
			if id == 0 {
				out[i] = status.Errorf(codes.InvalidArgument, "members: remove node 0")
				continue
			}
			if next[id] == nil && len(next) >= maxMembers {
				out[i] = status.Errorf(codes.ResourceExhausted, "members: the table holds %d nodes, at most %d", len(next), maxMembers)
				continue
			}
			m := &metapb.MemberInfo{Id: id, Removed: true}
			if old := next[id]; old != nil {
				m.RaftAddr, m.GrpcAddr = old.GetRaftAddr(), old.GetGrpcAddr()
			}
			put(m)
		default:
			// A command of a newer binary: refused, never ignored silently.
			out[i] = status.Errorf(codes.Unimplemented, "members: unknown command at index %d (a newer binary's?)", e.Index)
		}
	}
	if err := s.st.Commit(b, entries[len(entries)-1].Index); err != nil {
		panic(fmt.Sprintf("members: commit: %v", err)) // replay the log on restart
	}
	if changed {
		s.mu.Lock()
		s.members = next
		s.mu.Unlock()
		if s.changed != nil {
			s.changed()
		}
	}
	return out
}
