package namespace

// Upgrades: layout versions and the apply halt (docs/ARCHITECTURE.md,
// "Upgrades"; Ozone's layout versions and "finalize upgrade").
//
// Every command a meta binary can apply belongs to a layout version: the
// ops of the first versioned binary are layout 1; an op added later is
// registered in layoutFeatures with the version that introduced it. The
// cluster's finalized version is replicated (the m/layout row, written by
// a LayoutOp); the leader refuses, before the log, a command whose op needs
// a version above it, so no replica meets a command it may not know until
// every member reported that it supports it and an operator finalized.
//
// Should a replica still meet an entry it cannot apply deterministically
// (a command of a newer binary that reached the log without the gate, an
// entry that does not decode, a finalized version above its own), it does
// not record an error and go on, as the others applied it: it halts. Its
// durable applied index stays before that entry (Apply commits what came
// before and nothing after), every later Apply and Restore is refused, and
// the server refuses reads and leadership on it. Raft keeps the entries
// (it never truncates past the state machine's applied index), so the
// replica, restarted with a binary that knows the command, resumes from
// that index.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	iofs "io/fs"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/basalt-store/basalt/internal/vfs"
	"github.com/cockroachdb/pebble/v2"
	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// LayoutFeature is a command (an NsCommand op) introduced at a layout
// version above 1.
type LayoutFeature struct {
	Name        string
	Version     uint32
	Op          protoreflect.FieldNumber // NsCommand's oneof field number
	Description string
}

// layoutFeatures: registering an op as a layout feature is one line here,
// e.g.
//
//	{Name: "block-reservations", Version: 2, Op: 2000, Description: "ReserveBlocks ..."},
var layoutFeatures = []LayoutFeature{
	{Name: "block-reservations", Version: 2, Op: 2000, Description: "ReserveBlocks: blocks reserved ahead of need, committed by a CommitKey naming the key (issue 15)"},
}

// MaxLayoutVersion bounds a layout version anywhere it is read.
const MaxLayoutVersion = 1 << 16

var (
	featuresMu    sync.Mutex
	extraFeatures []LayoutFeature // RegisterLayoutFeature (tests)
	// features is the table the apply path reads (no lock, no allocation).
	features atomic.Pointer[featureTable]
)

type featureTable struct {
	all      []LayoutFeature // by version
	byOp     map[protoreflect.FieldNumber]LayoutFeature
	software uint32
}

func init() { rebuildFeatures() }

// rebuildFeatures publishes the table; featuresMu held or at init.
func rebuildFeatures() {
	t := &featureTable{all: append(slices.Clone(layoutFeatures), extraFeatures...), byOp: map[protoreflect.FieldNumber]LayoutFeature{}, software: 1}
	slices.SortStableFunc(t.all, func(a, b LayoutFeature) int { return int(a.Version) - int(b.Version) })
	for _, f := range t.all {
		t.byOp[f.Op] = f
		t.software = max(t.software, f.Version)
	}
	features.Store(t)
}

// RegisterLayoutFeature adds a feature to this process's binary (tests:
// a test-only feature; production features go in layoutFeatures) and
// returns its removal. Register before the servers start.
func RegisterLayoutFeature(f LayoutFeature) (unregister func()) {
	featuresMu.Lock()
	extraFeatures = append(extraFeatures, f)
	rebuildFeatures()
	featuresMu.Unlock()
	return func() {
		featuresMu.Lock()
		extraFeatures = slices.DeleteFunc(extraFeatures, func(g LayoutFeature) bool { return g == f })
		rebuildFeatures()
		featuresMu.Unlock()
	}
}

// LayoutFeatures returns this binary's layout features by version.
func LayoutFeatures() []LayoutFeature { return slices.Clone(features.Load().all) }

// SoftwareLayoutVersion is the highest layout version this binary
// supports: 1, or its newest feature's.
func SoftwareLayoutVersion() uint32 { return features.Load().software }

// opLayout is the layout version an op needs (1 for the original ops).
func opLayout(op protoreflect.FieldNumber) (uint32, string) {
	if f, ok := features.Load().byOp[op]; ok {
		return f.Version, f.Name
	}
	return 1, ""
}

var nsOpOneof = (&metapb.NsCommand{}).ProtoReflect().Descriptor().Oneofs().ByName("op")

// opNumber is the field number of cmd's op, 0 if none.
func opNumber(cmd *metapb.NsCommand) protoreflect.FieldNumber {
	if fd := cmd.ProtoReflect().WhichOneof(nsOpOneof); fd != nil {
		return fd.Number()
	}
	return 0
}

// ErrHalted is the result of every entry a halted replica does not apply.
var ErrHalted = errors.New("namespace: this replica halted: it cannot apply the namespace log (see basalt admin upgrade status)")

// Halt describes why a replica stopped applying.
type Halt struct {
	Index  uint64 // the first entry not applied
	Op     int32  // its op's field number, 0 if unknown or undecodable
	Reason string
}

// layoutState is the State's part of upgrades.
type layoutState struct {
	// supported is the version this replica supports: the binary's, or
	// lower through SetSupportedLayout (tests: an older binary).
	supported atomic.Uint32
	// finalized mirrors the m/layout row (0: none, i.e. layout 1).
	finalized atomic.Uint32
	halt      atomic.Pointer[Halt]
	// onHalt is called once, on the apply goroutine, when the replica halts.
	onHalt func(Halt)
	// fresh: this replica applied its log from the first entry with a
	// layout-aware binary and met no command that uses the namespace
	// (the file freshFile exists).
	fresh     atomic.Bool
	freshPath string
	// clearHalt: load found a halt row an older binary wrote.
	clearHalt bool
	fs        vfs.FS
}

// freshFile marks a namespace replica created by a layout-aware binary
// that never applied a command using the namespace. A replica created by
// an older binary never has it (its applied index is past 0 when a newer
// binary first opens it), nor does one that installed a snapshot. It is a
// file beside the Pebble, not a row: it says something about this
// replica's history, not about the replicated state.
const freshFile = "layout-fresh"

// openFresh creates freshFile in a brand-new replica (nothing applied)
// and loads it.
func (s *State) openFresh(dir string, fs vfs.FS) error {
	if fs == nil {
		fs = vfs.Default
	}
	s.layout.fs, s.layout.freshPath = fs, filepath.Join(dir, freshFile)
	if s.st.AppliedIndex() == 0 {
		f, err := fs.Create(s.layout.freshPath, pvfs.WriteCategoryUnspecified)
		if err != nil {
			return fmt.Errorf("namespace: create %s: %w", s.layout.freshPath, err)
		}
		err = errors.Join(f.Sync(), f.Close(), vfs.SyncDir(fs, dir))
		if err != nil {
			return fmt.Errorf("namespace: create %s: %w", s.layout.freshPath, err)
		}
	}
	ok, err := vfs.Exists(fs, s.layout.freshPath)
	if err != nil {
		return fmt.Errorf("namespace: %w", err)
	}
	s.layout.fresh.Store(ok)
	return nil
}

// clearFresh removes freshFile (durably: before the command that uses
// the namespace commits).
func (s *State) clearFresh() error {
	if !s.layout.fresh.Load() {
		return nil
	}
	s.layout.fresh.Store(false)
	if err := s.layout.fs.Remove(s.layout.freshPath); err != nil && !errors.Is(err, iofs.ErrNotExist) {
		return fmt.Errorf("namespace: remove %s: %w", s.layout.freshPath, err)
	}
	return vfs.SyncDir(s.layout.fs, filepath.Dir(s.layout.freshPath))
}

// usesNamespace: every command but the two a new cluster's first leaders
// propose on their own (the service token, the layout record).
func usesNamespace(cmd *metapb.NsCommand) bool {
	switch cmd.Op.(type) {
	case *metapb.NsCommand_SetServiceToken, *metapb.NsCommand_Layout:
		return false
	}
	return true
}

var keyLayout = []byte("m/layout")

// SetSupportedLayout makes this replica support only layouts up to v: ops
// of features above it are unknown to it, as to an older binary (a test
// hook). Call before the state applies anything.
func (s *State) SetSupportedLayout(v uint32) { s.layout.supported.Store(v) }

// SupportedLayout is the highest layout version this replica applies.
func (s *State) SupportedLayout() uint32 {
	if v := s.layout.supported.Load(); v != 0 {
		return v
	}
	return SoftwareLayoutVersion()
}

// FinalizedLayout is the cluster's finalized layout version as this
// replica's state has it (1 when none is recorded: a cluster created
// before layout versions).
func (s *State) FinalizedLayout() uint32 { return max(1, s.layout.finalized.Load()) }

// LayoutRecorded reports whether a finalized version is recorded.
func (s *State) LayoutRecorded() bool { return s.layout.finalized.Load() != 0 }

// Halted returns why this replica stopped applying, or nil.
func (s *State) Halted() *Halt { return s.layout.halt.Load() }

// OnHalt sets a function called once when the replica halts (on the
// apply goroutine; it must not block).
func (s *State) OnHalt(f func(Halt)) { s.layout.onHalt = f }

// Empty reports whether this replica can tell that the cluster was never
// used: it applied the whole log itself with a layout-aware binary
// (freshFile) and its state holds nothing but what a new cluster's
// leaders write on their own. A cluster an older binary created and used
// (S3 keys, volumes since deleted...) is never empty. (A fresh cluster's
// first leader records its layout.)
func (s *State) Empty() bool {
	if !s.layout.fresh.Load() {
		return false
	}
	// From Pebble, not the counters Apply owns: called off the apply
	// goroutine.
	empty := false
	err := s.st.View(func(r pebble.Reader) (err error) {
		empty, err = onlyNewClusterRows(r, nil)
		return err
	})
	return err == nil && empty
}

// onlyNewClusterRows reports whether r holds no row but the store's
// applied index, the service token, the layout record and the counters at
// their initial value (counter, if set, overrides the counter rows).
func onlyNewClusterRows(r pebble.Reader, counter func([]byte) uint64) (bool, error) {
	it, err := r.NewIter(nil)
	if err != nil {
		return false, err
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		k := it.Key()
		switch {
		case len(k) > 0 && k[0] == 0: // the store's own rows
		case bytes.Equal(k, keyToken), bytes.Equal(k, keyLayout):
		case bytes.Equal(k, keyNextBkt), bytes.Equal(k, keyNextOpn), bytes.Equal(k, keyNextID):
			if counter != nil {
				continue
			}
			if v := it.Value(); len(v) != 8 || decodeU64(v) != 1 {
				return false, nil
			}
		default:
			return false, nil
		}
	}
	return true, it.Error()
}

func (s *State) loadLayout(r pebble.Reader) error {
	row := &metapb.LayoutOp{}
	ok, err := get(r, keyLayout, row)
	if err != nil {
		return err
	}
	v := uint32(0)
	if ok {
		v = max(1, row.Version)
	}
	s.layout.finalized.Store(v)
	if s.layout.clearHalt, err = s.loadHalt(r); err != nil {
		return err
	}
	if v > s.SupportedLayout() {
		s.halt(Halt{Index: s.st.DurableIndex() + 1, Reason: fmt.Sprintf("the cluster's finalized layout version %d is above this binary's %d: upgrade this replica's binary", v, s.SupportedLayout())})
	}
	return nil
}

// keyHalt records this replica's halt (persistHalt): a restart with the
// same binary halts at load, before applying past it or installing a
// snapshot. It is this replica's row, not a replicated one: a halted
// replica hands leadership over, but may lead for a moment and send a
// snapshot holding it, so Restore removes it; and a binary that supports
// a higher layout removes it at load and tries the entry again.
var keyHalt = []byte("m/halt")

const maxHaltReason = 1024

// encodeHalt: index, op, the supported layout when it halted, reason.
func encodeHalt(h Halt, supported uint32) []byte {
	r := h.Reason
	if len(r) > maxHaltReason {
		r = r[:maxHaltReason]
	}
	b := binary.BigEndian.AppendUint64(nil, h.Index)
	b = binary.BigEndian.AppendUint32(b, uint32(h.Op))
	b = binary.BigEndian.AppendUint32(b, supported)
	return append(b, r...)
}

func decodeHalt(b []byte) (Halt, uint32, bool) {
	if len(b) < 16 || len(b) > 16+maxHaltReason {
		return Halt{}, 0, false
	}
	return Halt{Index: binary.BigEndian.Uint64(b), Op: int32(binary.BigEndian.Uint32(b[8:])), Reason: string(b[16:])},
		binary.BigEndian.Uint32(b[12:]), true
}

// persistHalt writes the halt durably (on the apply goroutine, after the
// entries before it committed). Should it fail, the replica halts in
// memory only: restarted, it replays to the same entry and halts again
// (what a lost write costs: a snapshot past it is not refused then).
func (s *State) persistHalt(h Halt) {
	b := s.st.NewBatch()
	if err := b.Set(keyHalt, encodeHalt(h, s.SupportedLayout()), nil); err != nil {
		b.Close()
		return
	}
	if err := s.st.CommitSide(b); err != nil {
		b.Close()
	}
}

// loadHalt: a halt recorded by a binary supporting no more than this one
// stands (before anything applies); one recorded by an older binary is
// removed: this one may know the entry.
func (s *State) loadHalt(r pebble.Reader) (clear bool, err error) {
	v, closer, err := r.Get(keyHalt)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer closer.Close()
	h, sup, ok := decodeHalt(v)
	if !ok {
		return false, fmt.Errorf("namespace: the halt row (%d bytes) does not decode", len(v))
	}
	if sup < s.SupportedLayout() {
		return true, nil
	}
	s.halt(h)
	return false, nil
}

// clearHalt removes a halt row an older binary wrote.
func (s *State) clearHalt() error {
	b := s.st.NewBatch()
	if err := b.Delete(keyHalt, nil); err != nil {
		b.Close()
		return err
	}
	if err := s.st.CommitSide(b); err != nil {
		b.Close()
		return err
	}
	return nil
}

func (s *State) halt(h Halt) {
	if s.layout.halt.CompareAndSwap(nil, &h) && s.layout.onHalt != nil {
		s.layout.onHalt(h)
	}
}

// decodeEntry decodes a committed entry's command, or says why this
// replica cannot apply it (then it must halt there).
func (s *State) decodeEntry(e store.Entry) (*metapb.NsCommand, *Halt) {
	cmd := &metapb.NsCommand{}
	if err := proto.Unmarshal(e.Cmd, cmd); err != nil {
		return nil, &Halt{Index: e.Index, Reason: fmt.Sprintf("entry %d does not decode (%v): a newer binary's command or a damaged log: upgrade this replica's binary", e.Index, err)}
	}
	if u := cmd.ProtoReflect().GetUnknown(); len(u) > 0 {
		// A field this binary does not know: an op (an unknown oneof
		// member decodes as Op == nil) or a new field of the command.
		num, _, n := protowire.ConsumeTag(u)
		op := int32(0)
		if n > 0 {
			op = int32(num)
		}
		return nil, &Halt{Index: e.Index, Op: op, Reason: fmt.Sprintf("entry %d holds op %d, unknown to this binary (layout %d): upgrade this replica's binary", e.Index, op, s.SupportedLayout())}
	}
	if len(features.Load().byOp) > 0 {
		num := opNumber(cmd)
		if v, name := opLayout(num); v > s.SupportedLayout() {
			return nil, &Halt{Index: e.Index, Op: int32(num), Reason: fmt.Sprintf("entry %d holds op %d (%s, layout %d), unknown to this binary (layout %d): upgrade this replica's binary", e.Index, num, name, v, s.SupportedLayout())}
		}
	}
	if l, ok := cmd.Op.(*metapb.NsCommand_Layout); ok && l.Layout.Version > s.SupportedLayout() {
		return nil, &Halt{Index: e.Index, Op: 2100, Reason: fmt.Sprintf("entry %d finalizes layout %d, above this binary's %d: upgrade this replica's binary", e.Index, l.Layout.Version, s.SupportedLayout())}
	}
	return cmd, nil
}

// CheckLayout refuses, before the log, a command whose op needs a layout
// above the finalized one.
func (s *State) CheckLayout(cmd *metapb.NsCommand) error {
	num := opNumber(cmd)
	v, name := opLayout(num)
	if fin := s.FinalizedLayout(); v > fin {
		st, _ := status.Newf(codes.FailedPrecondition, "namespace: %s (op %d) needs layout version %d; the cluster is finalized at %d: not available until every meta replica runs a binary with it and `basalt admin upgrade finalize` ran", name, num, v, fin).
			WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonLayoutNotFinalized, Domain: metapb.ReasonDomain})
		return st.Err()
	}
	return nil
}

// CheckLayoutOp refuses a LayoutOp out of range (the leader, before the
// log; and applyLayout).
func CheckLayoutOp(op *metapb.LayoutOp) error {
	if op.Version == 0 || op.Version > MaxLayoutVersion || len(op.Replicas) > 64 {
		return invalid("layout %d with %d replicas: want 1..%d and at most 64", op.Version, len(op.Replicas), MaxLayoutVersion)
	}
	return nil
}

// applyLayout applies a LayoutOp; its result is the finalized version.
func (t *tx) applyLayout(op *metapb.LayoutOp) any {
	row := &metapb.LayoutOp{}
	have := t.get(keyLayout, row)
	cur := uint32(1)
	if have {
		cur = max(1, row.Version)
	}
	if err := CheckLayoutOp(op); err != nil {
		// (Reached with version 0 or too many replicas: every replica
		// records the same error. A version above this binary's halts in
		// decodeEntry first, on every replica that does not know it: the
		// leader refuses it before the log.)
		return err
	}
	if op.Init && (have || !t.empty()) {
		// Only a cluster that never held anything starts at a version
		// above 1; one made by an older binary stays at 1 until finalized.
		return cur
	}
	if have && op.Version <= cur {
		return cur
	}
	t.put(keyLayout, op)
	t.layoutChanged = op.Version
	return op.Version
}

// empty is what applyLayout may check of Empty deterministically (the
// replicated state only: freshFile is this replica's, and a replica that
// installed a snapshot lacks it): no row but those a new cluster's leaders
// write on their own. (An Init reaches the log only from a leader whose
// own replica applied the whole log and met no command using it.)
func (t *tx) empty() bool {
	if t.s.nextBucket != 1 || t.s.nextOpen != 1 || t.s.nextID != 1 {
		return false
	}
	ok, err := onlyNewClusterRows(t.b, func([]byte) uint64 { return 1 })
	if err != nil {
		panic(err)
	}
	return ok
}

func haltedResults(entries []store.Entry) []any {
	res := make([]any, len(entries))
	for i, e := range entries {
		if e.Cmd != nil {
			res[i] = ErrHalted
		}
	}
	return res
}
