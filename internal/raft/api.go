package raft

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Entry is one committed log entry as the state machine sees it.
//
// Meta is what the proposer passed as metadata. Data is never handed to
// Apply: for a DataStateMachine it was already given to WriteData on this
// replica before the entry was acknowledged, so the state machine has it.
type Entry struct {
	Index uint64
	Term  uint64
	// Kind tells normal proposals from entries raft itself creates
	// (the empty entry a new leader appends, membership changes). The state
	// machine must still record their index as applied.
	Kind EntryKind
	Meta []byte
	// HasData reports whether the proposal carried data (kept out of the log).
	HasData bool
	// Data is the entry's data when the log holds it (DataLogger kept it
	// there), nil otherwise. Read-only. A state machine that lost what
	// WriteData stored for such an entry (a restart before the apply made
	// it durable) stores it again from here.
	Data []byte
}

// EntryKind classifies an Entry.
type EntryKind uint8

const (
	// EntryNormal is a proposal made through Group.Propose.
	EntryNormal EntryKind = iota
	// EntryEmpty is the no-op entry a new leader appends.
	EntryEmpty
	// EntryConfChange is a membership change, already applied to raft's
	// configuration by the host before Apply sees it.
	EntryConfChange
)

// StateMachine is what a group replicates. The host calls it from one
// goroutine per group, in log order; implementations need no locking against
// themselves, only against their own readers.
type StateMachine interface {
	// Apply applies committed entries in order and returns one result per
	// entry (or nil). The result of an entry proposed on this host is what
	// Group.Propose returns to its caller; a result that is an error is
	// returned as Propose's error. Apply must be deterministic: every replica
	// applies the same entries.
	Apply(entries []Entry) []any
	// AppliedIndex is the index of the last applied entry whose effects
	// survive a crash. On restart the host resumes applying after it, and it
	// never truncates the log past it.
	AppliedIndex() uint64
	// Snapshot returns the state as of the last applied entry, as a stream,
	// and that entry's index. It is called on the apply goroutine, so no
	// Apply runs concurrently; the returned reader must stay consistent
	// while later entries are applied (for Pebble: a checkpoint or an
	// iterator over a pebble.Snapshot). The host closes the reader.
	Snapshot() (index uint64, r io.ReadCloser, err error)
	// Restore replaces the whole state with a snapshot taken at index. It is
	// called on the apply goroutine. It must be atomic: if it fails halfway,
	// the old state must still be intact (write aside, then swap).
	Restore(index uint64, r io.Reader) error
}

// DataStateMachine is a StateMachine whose proposals may carry bulk data
// that must be kept out of the Raft log (Ozone's stateMachineData, seed 000).
//
// On every replica, for every entry that carries data, the host calls
// WriteData before the entry counts as persisted there (before the log
// store's fsync that acknowledges it). The log stores only the metadata.
// When the leader must resend an entry whose data it no longer has in
// memory, it calls ReadData.
type DataStateMachine interface {
	StateMachine
	// WriteData durably stores (or arranges to store before returning) the
	// data of the entry at index/term. It may be called again for the same
	// index with a different term if an uncommitted entry is overwritten by a
	// new leader; the newest call wins. data is read-only: neither raft
	// (which may keep it for resends) nor the state machine (which may
	// keep a reference instead of a copy) modifies it, and a proposer
	// hands its data over with Propose.
	WriteData(index, term uint64, meta, data []byte) error
	// ReadData returns the data of the entry at index/term, written earlier
	// by WriteData with that metadata. If the data is gone for good (for
	// example an uncommitted block cleaned up after a restart), return an
	// error wrapping ErrDataLost: the entry is then sent without its data
	// and the follower's WriteData receives data == nil, so it can record
	// the loss (a later commit that needs the data must fail there) instead
	// of stalling replication forever.
	ReadData(index, term uint64, meta []byte) ([]byte, error)
}

// DataSyncer is an optional interface of a DataStateMachine whose
// WriteData leaves data not yet durable. The host calls SyncData once after
// the WriteData calls of one Ready and before the log batch that
// acknowledges those entries is committed, so one flush covers every chunk
// of the batch (group commit) and the acknowledgement still follows the
// flush. When SyncData returns nil, the data of every entry handed to
// WriteData before it is durable, or the state machine has recorded which
// it lost (entries that need lost data fail when applied). An error stops
// the group, like a WriteData error.
type DataSyncer interface {
	SyncData() error
}

// DataLogger is an optional interface of a DataStateMachine that may keep
// some entries' data in the log itself (small data: the log's fsync then
// makes it durable, so it needs no flush of its own before the entry is
// acknowledged). The host calls WriteDataLogged instead of WriteData; when
// it returns inLog, the log stores the entry with its data, SyncData need
// not cover it (the state machine must not count on SyncData for it), and
// Apply gets the data again in Entry.Data whenever the entry comes from
// the log: the state machine makes it durable when it applies the entry
// and, after a restart that lost it, writes it again from Entry.Data.
type DataLogger interface {
	WriteDataLogged(index, term uint64, meta, data []byte) (inLog bool, err error)
}

// Result is what a successful proposal returns.
type Result struct {
	// Index is the log index the proposal was committed at; pass it to
	// Group.WaitAppliedAll to wait for every replica.
	Index uint64
	// Value is what StateMachine.Apply returned for the entry.
	Value any
}

// Status is a snapshot of a group's Raft state on this host.
type Status struct {
	Group    uint64
	Host     uint64
	Leader   uint64 // 0 if unknown
	Term     uint64
	Role     string // "leader", "follower", "candidate", "pre-candidate"
	Commit   uint64
	Applied  uint64
	Voters   []uint64
	Learners []uint64
	// Followers, on the leader only: replica → what the leader knows of it.
	Followers map[uint64]FollowerStatus
	// LogDir is the log directory that holds this group's log.
	LogDir string
}

// FollowerStatus is the leader's view of one replica.
type FollowerStatus struct {
	Match   uint64 // highest index known to be in the replica's log
	Applied uint64 // highest index the replica reported as applied
	Active  bool   // heard from recently
}

var (
	// ErrNotLeader: the operation needs the leader and this replica is not
	// it. Use errors.As with *NotLeaderError to learn the leader.
	ErrNotLeader = errors.New("raft: not the leader")
	// ErrGroupNotFound: no group with that ID on this host.
	ErrGroupNotFound = errors.New("raft: group not found")
	// ErrGroupExists: AddGroup for an ID that is already hosted.
	ErrGroupExists = errors.New("raft: group already exists")
	// ErrStopped: the host or group was closed (or stopped after a fatal
	// error, see Group.Stopped). Returned by Propose only when the proposal
	// certainly never entered the log: safe to retry elsewhere.
	ErrStopped = errors.New("raft: stopped")
	// ErrOutcomeUnknown: the proposal was handed to raft (it is, or was,
	// in the leader's log) and then this host stopped tracking it: the
	// caller's context ended, the group stopped, or leadership was lost.
	// It may or may not have committed, and may still commit. Retrying
	// blindly can apply it twice; a caller must read back the state (or
	// make the proposal idempotent) before retrying, and must report it to
	// its own client as an unknown outcome, never as "not done".
	ErrOutcomeUnknown = errors.New("raft: proposal may or may not have committed")
	// ErrProposalDropped: raft dropped the proposal (no leader known, a
	// leadership change, or a membership change in progress). Safe to retry:
	// the proposal was not applied.
	ErrProposalDropped = errors.New("raft: proposal dropped")
	// ErrTooLarge: a proposal bigger than the configured limit.
	ErrTooLarge = errors.New("raft: proposal too large")
	// ErrDataLost: returned (wrapped) by DataStateMachine.ReadData when an
	// entry's data no longer exists anywhere on this replica.
	ErrDataLost = errors.New("raft: entry data lost")
	// ErrLogDiskFull: the disk of the group's log directory is below
	// HostConfig.LogReserveBytes (Group.CheckLogSpace). The log store's
	// Pebble cannot survive ENOSPC, so callers refuse new data first.
	ErrLogDiskFull = errors.New("raft: log disk below its reserve")
	// ErrReplicasLag: WaitAppliedAll timed out; use errors.As with
	// *LagError for the replicas that lag.
	ErrReplicasLag = errors.New("raft: replicas lag")
)

// NotLeaderError says who the leader is, if known (Leader is 0 otherwise).
type NotLeaderError struct {
	Group  uint64
	Leader uint64
}

func (e *NotLeaderError) Error() string {
	if e.Leader == 0 {
		return fmt.Sprintf("raft: group %d: not the leader, leader unknown", e.Group)
	}
	return fmt.Sprintf("raft: group %d: not the leader, leader is %d", e.Group, e.Leader)
}

func (e *NotLeaderError) Unwrap() error { return ErrNotLeader }

// LagError reports the replicas that had not applied Index when
// WaitAppliedAll gave up, with the index each had reported.
type LagError struct {
	Group   uint64
	Index   uint64
	Lagging map[uint64]uint64 // replica → applied index it reported
}

func (e *LagError) Error() string {
	ids := make([]uint64, 0, len(e.Lagging))
	for id := range e.Lagging {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprintf("%d@%d", id, e.Lagging[id])
	}
	return fmt.Sprintf("raft: group %d: index %d not applied on all replicas; lagging (replica@applied): %s",
		e.Group, e.Index, strings.Join(parts, ", "))
}

func (e *LagError) Unwrap() error { return ErrReplicasLag }

// interface guard for documentation: the methods a Group offers.
var _ interface {
	Propose(ctx context.Context, meta, data []byte) (Result, error)
	ProposeAsync(meta, data []byte, done func(Result, error)) error
	ProposeMany(ctx context.Context, metas, datas [][]byte) ([]Result, []error)
	ProposeManyAsync(metas, datas [][]byte, done func(i int, res Result, err error)) []error
	AppliedAll(index uint64) (ok bool, laggards map[uint64]uint64)
	Stopped() bool
	ReadIndex(ctx context.Context) error
	WaitAppliedAll(ctx context.Context, index uint64) error
	Campaign() error
	TransferLeader(to uint64)
	AddMember(ctx context.Context, id uint64) error
	RemoveMember(ctx context.Context, id uint64) error
	Status() Status
	Leader() uint64
	ID() uint64
} = (*Group)(nil)
