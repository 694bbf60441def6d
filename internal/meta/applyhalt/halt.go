// Package applyhalt is the apply halt of the meta service's Raft groups
// other than the namespace (SCM, CA, user tokens): the rule of
// namespace/layout.go for them (docs/ARCHITECTURE.md, "Upgrades").
//
// A replica that meets a committed entry it cannot apply
// deterministically (an entry that does not decode, an op or a top-level
// field of the group's command message its binary does not know) does
// not record an error and go on while newer replicas applied it: it
// halts. The state machine commits what came before the entry and
// nothing after; every later Apply is refused (Results), and so is every
// Restore (CheckRestore: the state past the halt may hold what this
// binary cannot read). The halt is written durably beside the group's
// rows (the m/halt row; Persist): a restart with the same binary halts
// again at load, before applying anything. A binary whose command
// message differs (its schema fingerprint: the fields it knows) removes
// the row at load and tries the entry again: restarted with a binary
// that knows the op, the replica resumes from the halt index (Raft keeps
// the entries: it never compacts past the state machine's applied
// index). The server refuses reads and proposals of a halted group and
// gives up its leadership (internal/meta/upgrade.go).
package applyhalt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/basalt-store/basalt/internal/meta/store"
)

// ErrHalted is the result of every entry a halted replica does not apply.
var ErrHalted = errors.New("meta: this replica halted: it cannot apply its group's log (see basalt admin upgrade status)")

// Halt describes why a replica stopped applying.
type Halt struct {
	Index  uint64 // the first entry not applied
	Op     int32  // its op's field number, 0 if unknown or undecodable
	Reason string
}

// Key is the halt row in each group's store: this replica's row, not a
// replicated one. A snapshot is a checkpoint of the whole store, so one
// sent by a replica that halted while it led (it hands leadership over
// within 250 ms) can hold it: Drop removes it after a Restore, and Load
// ignores (and removes) a row not at the entry after the applied index.
var Key = []byte("m/halt")

const maxReason = 1024

// Group is one state machine's halt. Decode, Stop and Persist run on the
// apply goroutine; Halted anywhere.
type Group struct {
	name   string // in reasons and errors: "scm", "CA", "usertoken"
	st     *store.Store
	desc   protoreflect.MessageDescriptor
	hidden []protoreflect.FieldNumber // ops treated as unknown (tests)
	schema uint64                     // fingerprint of the fields known
	halt   atomic.Pointer[Halt]
	onHalt atomic.Pointer[func(Halt)]
}

// New returns the halt of the group whose commands are messages like cmd,
// stored in st. hidden are ops (field numbers of cmd) this replica treats
// as unknown, as a binary without them would (a test hook; nil in
// production). Call Load before the first Apply.
func New(name string, st *store.Store, cmd proto.Message, hidden []int32) *Group {
	g := &Group{name: name, st: st, desc: cmd.ProtoReflect().Descriptor()}
	for _, n := range hidden {
		g.hidden = append(g.hidden, protoreflect.FieldNumber(n))
	}
	h := fnv.New64a()
	fields := g.desc.Fields()
	for i := range fields.Len() {
		if n := fields.Get(i).Number(); !slices.Contains(g.hidden, n) {
			h.Write(binary.BigEndian.AppendUint32(nil, uint32(n)))
		}
	}
	g.schema = h.Sum64()
	return g
}

// OnHalt sets a function called once when the replica halts (on the apply
// goroutine or in Load; it must not block).
func (g *Group) OnHalt(f func(Halt)) { g.onHalt.Store(&f) }

// Halted returns why this replica stopped applying, or nil.
func (g *Group) Halted() *Halt { return g.halt.Load() }

// Stop halts the replica (in memory; Persist writes it).
func (g *Group) Stop(h Halt) {
	if g.halt.CompareAndSwap(nil, &h) {
		if f := g.onHalt.Load(); f != nil {
			(*f)(h)
		}
	}
}

// Decode decodes a committed entry's command into m, or says why this
// replica cannot apply it (then it must halt there). An empty command
// (no op, no unknown field) decodes: every binary sees it alike.
func (g *Group) Decode(e store.Entry, m proto.Message) *Halt {
	if err := proto.Unmarshal(e.Cmd, m); err != nil {
		return &Halt{Index: e.Index, Reason: fmt.Sprintf("%s entry %d does not decode (%v): a newer binary's command (upgrade this replica's binary) or a damaged entry (a binary with the same command fields halts again: see docs/ARCHITECTURE.md, Upgrades)", g.name, e.Index, err)}
	}
	r := m.ProtoReflect()
	if u := r.GetUnknown(); len(u) > 0 {
		// A field this binary does not know: an op (an unknown oneof
		// member decodes as no op) or a new field of the command.
		op := int32(0)
		if num, _, n := protowire.ConsumeTag(u); n > 0 {
			op = int32(num)
		}
		return &Halt{Index: e.Index, Op: op, Reason: fmt.Sprintf("%s entry %d holds op or field %d, unknown to this binary: upgrade this replica's binary", g.name, e.Index, op)}
	}
	for _, n := range g.hidden {
		if fd := g.desc.Fields().ByNumber(n); fd != nil && r.Has(fd) {
			return &Halt{Index: e.Index, Op: int32(n), Reason: fmt.Sprintf("%s entry %d holds op or field %d, unknown to this binary: upgrade this replica's binary", g.name, e.Index, n)}
		}
	}
	return nil
}

// Cut halts the replica at entries[i], whose Decode answered h: the
// results of entries[i:] are ErrHalted. It returns the entries to commit
// (those before i); the caller commits them, then calls Persist.
func (g *Group) Cut(h *Halt, entries []store.Entry, i int, res []any) []store.Entry {
	g.Stop(*h)
	copy(res[i:], Results(entries[i:]))
	return entries[:i]
}

// Guard runs apply, one command's apply (cmd, decoded from entry e of
// the Apply call whose first entry is first), turning a runtime error
// (a nil message, an index out of range: what the command's content
// causes, the same on every replica) into a halt before first, instead
// of a panic that takes every replica down in a crash loop (the rule of
// namespace.State.Apply's applyGuarded). The caller must then discard
// the call's batch (it may hold part of the command), rebuild any
// in-memory state from the store, Stop with the halt (in memory only: a
// restart with the same binary replays to it and halts again, a fixed
// binary applies it) and answer every entry of the call with Results.
// Other panics (a failed Pebble write: the process cannot go on) go on
// up.
func (g *Group) Guard(e store.Entry, first uint64, cmd proto.Message, apply func() any) (res any, h *Halt) {
	defer func() {
		if r := recover(); r != nil {
			re, ok := r.(runtime.Error)
			if !ok {
				panic(r)
			}
			op := opOf(cmd)
			h = &Halt{Index: first, Op: op, Reason: fmt.Sprintf("%s entry %d (op %d) failed in apply: %v (a bug: this binary cannot apply it; report it, and run a fixed binary)", g.name, e.Index, op, re)}
			res = nil
		}
	}()
	if TestApplyHook != nil {
		TestApplyHook(g.name, cmd)
	}
	return apply(), nil
}

// Run is the loop every group's Apply shares (SCM, CA, user tokens): it
// decodes each entry of the call with a command (into newCmd(); an entry
// without one, or, with skipEmpty, an empty one, is skipped with a nil
// result) and applies it under Guard with apply, in order. It returns:
//
//   - res, one result per entry;
//   - commit, the entries the caller's batch now holds: all of them, or
//     those before an entry this replica cannot apply (Decode), where the
//     replica halts (Cut: the results from that entry on are ErrHalted);
//   - halted, that halt (nil if none): the caller commits its batch of
//     commit (Finish), and only then persists it;
//   - panicked: a command's apply met a runtime error (Guard). The
//     replica is stopped (in memory) and res is Results of every entry
//     of the call: the caller discards its batch, rebuilds any in-memory
//     state from the store, and returns res.
func Run[C proto.Message](g *Group, entries []store.Entry, skipEmpty bool, newCmd func() C, apply func(C) any) (res []any, commit []store.Entry, halted *Halt, panicked bool) {
	res = make([]any, len(entries))
	for i, e := range entries {
		if e.Cmd == nil || (skipEmpty && len(e.Cmd) == 0) {
			continue
		}
		cmd := newCmd()
		if h := g.Decode(e, cmd); h != nil {
			// Never past an entry this binary cannot apply.
			return res, g.Cut(h, entries, i, res), h, false
		}
		r, ph := g.Guard(e, entries[0].Index, cmd, func() any { return apply(cmd) })
		if ph != nil {
			g.Stop(*ph)
			return Results(entries), nil, nil, true
		}
		res[i] = r
	}
	return res, entries, nil, false
}

// ApplyMirrored is the whole Apply of a group that keeps an in-memory
// mirror of its store, guarded by mu (SCM, user tokens): entries apply in
// order into one batch of the group's store under mu (Run, with apply),
// and the batch commits (Finish). A halted replica applies nothing
// (Results). When a command's apply meets a runtime error (Guard),
// nothing of the call commits, and the mirror, which may hold part of
// it, is rebuilt from the store by reload (under mu; its failure
// panics).
func ApplyMirrored[C proto.Message](g *Group, entries []store.Entry, mu sync.Locker, newCmd func() C, apply func(*pebble.Batch, C) any, reload func() error) []any {
	if len(entries) == 0 {
		return nil
	}
	if g.Halted() != nil {
		return Results(entries)
	}
	b := g.st.NewBatch()
	mu.Lock()
	res, commit, halted, panicked := Run(g, entries, false, newCmd, func(cmd C) any { return apply(b, cmd) })
	if panicked {
		b.Close()
		err := reload()
		mu.Unlock()
		if err != nil {
			panic(err)
		}
		return res
	}
	mu.Unlock()
	g.Finish(b, commit, halted)
	return res
}

// Finish commits b, the batch of Run's commit entries, at the last one's
// index (an empty commit: b is closed, nothing committed), then persists
// halted, if not nil. A failed commit panics: the caller's in-memory
// state is ahead of the disk, and the only safe thing is to stop and
// replay the log on restart.
func (g *Group) Finish(b *pebble.Batch, commit []store.Entry, halted *Halt) {
	if len(commit) == 0 {
		b.Close()
	} else if err := g.st.Commit(b, commit[len(commit)-1].Index); err != nil {
		panic(err)
	}
	if halted != nil {
		g.Persist(*halted)
	}
}

// TestApplyHook, when set (tests only), runs in Guard before each
// command's apply, with the group's name ("scm", "CA", "usertoken").
var TestApplyHook func(group string, cmd proto.Message)

// opOf is the field number of cmd's op (its set oneof member), 0 if none.
func opOf(cmd proto.Message) int32 {
	r := cmd.ProtoReflect()
	ods := r.Descriptor().Oneofs()
	for i := range ods.Len() {
		if fd := r.WhichOneof(ods.Get(i)); fd != nil {
			return int32(fd.Number())
		}
	}
	return 0
}

// Results is the result of entries a halted replica does not apply.
func Results(entries []store.Entry) []any {
	res := make([]any, len(entries))
	for i, e := range entries {
		if e.Cmd != nil {
			res[i] = ErrHalted
		}
	}
	return res
}

// CheckRestore refuses a snapshot on a halted replica.
func (g *Group) CheckRestore() error {
	if h := g.Halted(); h != nil {
		return fmt.Errorf("%w: %s at entry %d: %s; a snapshot is not installed", ErrHalted, g.name, h.Index, h.Reason)
	}
	return nil
}

// encode: index, op, schema, reason.
func (g *Group) encode(h Halt) []byte {
	r := h.Reason
	if len(r) > maxReason {
		r = r[:maxReason]
	}
	b := binary.BigEndian.AppendUint64(nil, h.Index)
	b = binary.BigEndian.AppendUint32(b, uint32(h.Op))
	b = binary.BigEndian.AppendUint64(b, g.schema)
	return append(b, r...)
}

func decode(b []byte) (Halt, uint64, bool) {
	if len(b) < 20 || len(b) > 20+maxReason {
		return Halt{}, 0, false
	}
	return Halt{Index: binary.BigEndian.Uint64(b), Op: int32(binary.BigEndian.Uint32(b[8:])), Reason: string(b[20:])},
		binary.BigEndian.Uint64(b[12:]), true
}

// Persist writes the halt durably (on the apply goroutine, only after
// the entries before it committed: never for entries that did not).
// Should it fail, the replica halts in memory only (restarted, it
// replays to the same entry and halts again); the failure is logged as
// an ERROR.
func (g *Group) Persist(h Halt) {
	b := g.st.NewBatch()
	err := b.Set(Key, g.encode(h), nil)
	if err == nil {
		err = g.st.CommitSide(b)
	}
	if err != nil {
		b.Close()
		slog.Error("meta: "+g.name+" apply halted, but the halt could not be recorded (it holds in memory; a restart replays to the entry and halts again)",
			"group", g.name, "index", h.Index, "err", err)
	}
}

// Load reads the halt row (at open): a halt recorded by a binary knowing
// the same command fields, at the entry after the applied index, stands;
// one recorded by another binary is removed: this one may know the entry
// (if not, it halts there again). So is one at another index (stale:
// received in a snapshot, or written ahead of the state), logged.
func (g *Group) Load() error {
	var h Halt
	var schema uint64
	found := false
	err := g.st.View(func(r pebble.Reader) error {
		v, closer, err := r.Get(Key)
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		defer closer.Close()
		var ok bool
		if h, schema, ok = decode(v); !ok {
			return fmt.Errorf("%s: the halt row (%d bytes) does not decode", g.name, len(v))
		}
		found = true
		return nil
	})
	if err != nil || !found {
		return err
	}
	if schema == g.schema {
		if h.Index == g.st.AppliedIndex()+1 {
			g.Stop(h)
			return nil
		}
		slog.Error("meta: "+g.name+" halt row ignored: not at the entry after the applied index (another replica's, from a snapshot, or ahead of the state); the entries apply again",
			"group", g.name, "index", h.Index, "applied", g.st.AppliedIndex())
	}
	return g.Drop()
}

// Drop removes the halt row (after a Restore: the row, if any, is the
// sender's, not this replica's).
func (g *Group) Drop() error {
	b := g.st.NewBatch()
	if err := b.Delete(Key, nil); err != nil {
		b.Close()
		return err
	}
	if err := g.st.CommitSide(b); err != nil {
		b.Close()
		return err
	}
	return nil
}
